"""The engine under autocast (TRL's `bf16=True` / `fp16=True` on float32 weights): how close it is to the model.

Two tables, CPU autocast (`torch.autocast("cpu", dtype)`, what accelerate enters for TRL on CPU).

1. Logits (`--model smollm2`, SmolLM2-135M-Instruct, 30 layers; or `--model tiny`): the support contract's exactness
   check (a prompt of N probe tokens prefilled, 3 tokens decoded) for each weights dtype x autocast setting: the KV
   pool's dtype, the relative logit error (max |engine - model| / max |model|) of the engine's eager and static
   decode paths against the model's own forward without a cache, the same error of the model's *own* KV-cached
   decode (what `generate` runs) against that forward, and the tolerance the check applies.
2. Greedy agreement (tiny random models of several architectures, `--seeds` each, the model matrix's 4 prompts x
   G=3, 12 new tokens, an early EOS, two engine layouts): the share of sequences where the engine's greedy output
   differs from `model.generate` of that prompt alone (batch 1) under the same autocast, and the share where
   `generate` of the 4 prompts batched (left-padded) differs from `generate` batch 1: how often the rounding order
   of 16-bit matmuls and attention (padded context, other blocking) flips a near-tie argmax, for `generate` itself.
3. Decode step cost (`--timing`; SmolLM2-135M's shape with random weights, one prompt of 128 tokens x 16 samples,
   32 forced new tokens, one torch thread, process CPU time, best of 3, the C++ kernel off so every setting runs the
   torch backend): ms per decode step for float32, float32 weights under bf16 autocast and bf16 weights, each with the
   static step's cascade decode (each group's prompt attended once, the default) and with the whole context per row
   (the step given no group slots), which rounds like the model's single attention call but gathers the prompt for
   every row.

    python benchmarks/autocast_exactness.py --model smollm2 --seeds 3 --timing
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import Table, pick_device, run_header, write_results

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.model import exactness as E
from trl_infinite.engine.model.probe import probe_tokens, record_attention_calls
from trl_infinite.engine.model.support import verdict
from trl_infinite.testing.model_matrix import MAX_NEW, G, early_eos, prompts, reference
from trl_infinite.testing.model_zoo import random_model
from trl_infinite.testing.tiny_configs import build_tiny_model, sizes

SETTINGS = [(torch.float32, None), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
            (torch.bfloat16, None)]
ARCHS = ("llama", "qwen3", "mistral", "cohere2", "gemma2")


def _name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def logit_errors(model: torch.nn.Module, table: Table, lengths: list[int]) -> None:
    errors: list[float] = []
    measure = E._relative_error

    def record(got, ref):
        errors.append(measure(got, ref))
        return errors[-1]

    for weights, autocast in SETTINGS:
        m = model.to(weights)
        for n in lengths:
            ids = probe_tokens(m.config.vocab_size, n, torch.device("cpu"))
            with torch.no_grad(), _autocast(autocast):
                support = verdict(m, record_attention_calls(m, ids))
                errors.clear()
                E._relative_error = record
                try:
                    problem = E.exactness_problem(m, support, "torch", ids)
                finally:
                    E._relative_error = measure
                own = E.own_cache_error(m, ids, E.DECODE_TOKENS)
            table.add(weights=_name(weights), autocast=_name(autocast), N=n, kv_pool=_name(support.kv_dtype),
                      engine_eager=errors[0], engine_static=errors[1], model_own_cache=own,
                      tolerance=E.exactness_tolerance(support.compute_dtype), passed=problem is None)


def _batched_generate(model, ps: list[list[int]], eos: int | None) -> list[list[int]]:
    width = max(len(p) for p in ps)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
                         repetition_penalty=1.0, no_repeat_ngram_size=0, pad_token_id=0, eos_token_id=eos)
    rows = []
    for row in out[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


def greedy_agreement(table: Table, seeds: int) -> None:
    for autocast in (None, torch.bfloat16, torch.float16):
        seqs = engine_diff = batched_diff = 0
        for arch in ARCHS:
            for head_dim in (8, 16):
                for seed in range(seeds):
                    model = build_tiny_model(arch, seed=seed, size=sizes(head_dim))
                    ps = prompts(seed)
                    with _autocast(autocast):
                        eos = early_eos(model, ps)
                        refs = [reference(model, p, eos) for p in ps]
                        batched = _batched_generate(model, ps, eos)
                        batched_diff += sum(b != r for b, r in zip(batched, refs))
                        for mode, block in (("fixed_slot", 16), ("full_group", 5)):
                            engine = RolloutEngine(model, EngineConfig(
                                sampling_mode=mode, max_active_sequences=2, block_size=block, kv_cache_tokens=1024,
                                max_prefill_tokens=12))
                            sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                      eos_token_ids=[eos] if eos is not None else [])
                            got = engine.generate(ps, G, sampling).completion_ids
                            engine_diff += sum(g != refs[k // G] for k, g in enumerate(got))
                            seqs += len(got)
        runs = len(ARCHS) * 2 * seeds
        table.add(autocast=_name(autocast), models=runs, engine_sequences=seqs,
                  engine_vs_generate_differ=engine_diff / seqs, generate_batched_sequences=runs * 4,
                  generate_batched_vs_batch1_differ=batched_diff / (runs * 4))


def decode_step_ms(table: Table, rows: int = 16, prompt_len: int = 128, new_tokens: int = 32) -> None:
    prompt = torch.randint(2, 1000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[1])

    def seconds(engine, tokens: int) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            engine.generate([prompt], rows, sampling, forced_lengths=[[tokens] * rows])
            best = min(best, time.process_time() - start)
        return best

    for weights, autocast in ((torch.float32, None), (torch.float32, torch.bfloat16), (torch.bfloat16, None)):
        model = random_model("smollm2-135m", dtype=weights)
        with _autocast(autocast):
            for cascade in (True, False):
                engine = RolloutEngine(model, EngineConfig(max_active_sequences=rows, cpu_decode_kernel=False,
                                                           kv_cache_tokens=4 * rows * (prompt_len + new_tokens)))
                if not cascade:  # benchmark only: the step passes no group slots, so every row attends whole
                    engine.decoder.cascade_slots = False
                ms = (seconds(engine, new_tokens) - seconds(engine, 1)) / (new_tokens - 1) * 1e3
                table.add(weights=_name(weights), autocast=_name(autocast), kv_pool=_name(engine.pool.dtype),
                          decode=("cascade (default)" if cascade else "whole context"), ms_per_step=ms)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--seeds", type=int, default=3, help="random tiny models per architecture and head dim")
    ap.add_argument("--timing", action="store_true", help="also time decode steps (table 3)")
    ap.add_argument("--json", default=None, help="also write the tables to this JSON file (and .md beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = pick_device("cpu")
    if args.model == "smollm2":
        from transformers import AutoModelForCausalLM

        from trl_infinite.testing.offline_models import smollm2_path

        model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).eval()
    else:
        model = build_tiny_model("llama", size=sizes(16))
    header = run_header(device, "python benchmarks/autocast_exactness.py " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv))
    logits = Table(["weights", "autocast", "N", "kv_pool", "engine_eager", "engine_static", "model_own_cache",
                    "tolerance", "passed"])
    logit_errors(model, logits, [24, 64])
    greedy = Table(["autocast", "models", "engine_sequences", "engine_vs_generate_differ",
                    "generate_batched_sequences", "generate_batched_vs_batch1_differ"])
    greedy_agreement(greedy, args.seeds)
    timing = Table(["weights", "autocast", "kv_pool", "decode", "ms_per_step"])
    if args.timing:
        decode_step_ms(timing)
    write_results(None, header, logits, {})
    if args.timing:
        write_results(None, header, timing, {})
    write_results(args.json, header, greedy, {"logits": logits.rows, "timing": timing.rows})


if __name__ == "__main__":
    main()
