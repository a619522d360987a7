"""Speculative rollouts: none / ngram / suffix / best_of_n, the same prompts and seed for every method.

For each (G, temperature, method, adaptive) the prompts are rolled out by `RolloutEngine` (all samples decoding at
once in fixed slots) and the table reports the mean acceptance length (tokens emitted per sample per verification
forward, bonus included), the decode forward passes, the forward passes of the tail (while the last 10% of samples
to finish, at least one, were still running), wall time and generated tokens per second.

Models:
- `--model smollm2-real` (default): SmolLM2-135M-Instruct's real weights on chat-formatted GSM8K test prompts;
  samples end at their EOS (or `--max-new-tokens`).
- any `model_zoo` name (e.g. `qwen3-1.7b`, random weights: the GPU runs, where the real weights cannot travel):
  random prompts of `--prompt-len` tokens, every sample forced to a length from `--trace` or the log-normal default
  (`--mean`, `--sigma`), the same lengths for every method. A random model at temperature 1 samples almost
  uniformly, so drafts are almost never accepted: that measures what speculation costs when it cannot help (the
  adaptive switch must turn it off). Greedy decoding (`--temperatures 0`) of a random model falls into repetition
  loops, which n-gram and suffix drafts predict: that measures the gain when drafts are accepted.

`graphs`: whether the decode steps ran on the CUDA-graph path (`EngineConfig.cuda_graphs`, CUDA only). The
speculative step always runs the eager model forward, so `--eager-none` adds a second `none` row with CUDA graphs
off (at the first temperature only: a plain step's cost does not depend on it): the same eager path the speculative
rows run on, next to the product default.

`--epochs 2` measures drafting from history (RhymeRL's HistoSpec): the same prompts are first rolled out once without
speculation (epoch 1, seed `--seed`), their completions go into each measured engine's per-prompt history (exactly
what the engine records after a call), then epoch 2 (seed `--seed + 1`) is measured per method; the suffix drafter
runs once per `--suffix-sources` ("siblings" = this call only, "siblings+history", "history" = earlier visit only).

    python benchmarks/speculative.py --num-prompts 2                      # CPU, ~10-15 min on 2 cores
    python benchmarks/speculative.py --model qwen3-1.7b --num-prompts 1 --group-sizes 32 --temperatures 1 0 \\
        --methods none ngram suffix --adaptive on --eager-none --max-new-tokens 1024 --json out.json
    python benchmarks/speculative.py --epochs 2 --methods none suffix --group-sizes 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import torch
from common import (
    Table,
    dtype_for,
    load_model,
    make_workload,
    pick_device,
    run_header,
    save_json,
    trace_lengths,
    write_results,
)

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.shared_data import dataset_file

METHODS = ("none", "ngram", "suffix", "best_of_n")
SOURCES = ("siblings", "siblings+history", "history")
COLUMNS = ["epoch", "G", "T", "method", "adaptive", "graphs", "mean_acc_len", "decode_fwd", "tail_fwd", "verify_fwd",
           "drafted", "accepted", "tokens", "wall_s", "tok/s", "host_ms"]


def load_prompts(tokenizer, path: Path, n: int, offset: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[offset : offset + n]]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for r in rows
    ]


def run_one(model, prompts, lengths, g: int, temperature: float, method: str, adaptive: bool, graphs: bool, args,
            eos: list[int], sources: str = "siblings+history", earlier=None) -> tuple[dict, object]:
    """One rollout -> (table row, `RolloutResult`); `lengths` ([num_prompts][G] forced lengths) or None (samples end
    at EOS); `earlier` (a `RolloutResult` of the same prompts) is put in the engine's history first and the rollout
    runs with seed `--seed + 1` (the next visit)."""
    config = EngineConfig(
        sampling_mode="fixed_slot",
        max_active_sequences=len(prompts) * g,
        kv_cache_tokens=args.kv_cache_tokens,
        speculative_method=None if method == "none" else method,
        speculative_num_tokens=args.k,
        speculative_adaptive=adaptive,
        cuda_graphs=graphs,
        speculative_suffix_sources=sources,
    )
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, eos_token_ids=eos,
                              seed=args.seed + (earlier is not None))
    engine = RolloutEngine(model, config)
    if method == "none":  # warm-up: kernels, and the CUDA graph of every bucket (samples finish one by one)
        warm = [[2 + (i * g + j) % 48 for j in range(g)] for i in range(len(prompts))]
        engine.generate(prompts, g, sampling, forced_lengths=warm)
    if earlier is not None:  # what the engine itself records after the earlier call
        for i, p in enumerate(prompts):
            comps = earlier.completion_ids[i * g : (i + 1) * g]
            engine.history.record(p, [len(c) for c in comps], comps)
    steps, finished_at = [0], []

    def count(batch, seconds):  # decode forwards (verification included)
        steps[0] += 1

    result = engine.generate(prompts, g, sampling, forced_lengths=lengths, on_decode_step=count,
                             on_sample_finished=lambda *_: finished_at.append(steps[0]))
    s = result.stats
    n_tail = max(1, math.ceil(0.1 * len(finished_at)))  # the last 10% of samples to finish (at least one)
    tail = steps[0] - finished_at[-n_tail - 1] if len(finished_at) > n_tail else steps[0]
    on_graphs = graphs and method == "none" and engine.device.type == "cuda"
    label = f"{method}[{sources}]" if method == "suffix" else method
    return {
        "epoch": 2 if earlier is not None else 1, "G": g, "T": temperature, "method": label, "adaptive": ("on" if adaptive else "off") if method != "none"
        else "-", "graphs": ("on" if on_graphs else "off") if engine.device.type == "cuda" else "-",
        "mean_acc_len": s.mean_acceptance_length if s.verify_steps else 1.0, "decode_fwd": s.decode_steps,
        "tail_fwd": tail, "verify_fwd": s.verify_steps, "drafted": s.draft_tokens, "accepted": s.accepted_tokens,
        "tokens": s.generated_tokens, "wall_s": s.wall_time_s, "tok/s": s.tokens_per_second,
        "host_ms": s.host_ms_per_step,
    }, result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-real", help="'smollm2-real' or a model_zoo name (random weights)")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--prompt-offset", type=int, default=0, help="first GSM8K test row (smollm2-real)")
    p.add_argument("--group-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--adaptive", choices=["on", "off", "both"], default="both",
                   help="speculative_adaptive: on = the product default (cost model may switch speculation off), "
                   "off = always draft k tokens; both = one row each")
    p.add_argument("--eager-none", action="store_true",
                   help="also a `none` row with EngineConfig.cuda_graphs=False (first temperature only)")
    p.add_argument("--epochs", type=int, default=1, choices=[1, 2], help="2: measure the second visit of the "
                   "prompts, with the first visit's completions in the engine's history")
    p.add_argument("--suffix-sources", nargs="+", default=None, choices=SOURCES,
                   help="speculative_suffix_sources of the suffix rows (default: all three with --epochs 2)")
    p.add_argument("--k", type=int, default=5, help="speculative_num_tokens")
    p.add_argument("--kv-cache-tokens", type=int, default=20_000)
    p.add_argument("--trace", default=None, help="random-weight models: JSONL length trace (else log-normal)")
    p.add_argument("--mean", type=float, default=256.0, help="random-weight models: log-normal mean length")
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--prompt-len", type=int, default=128, help="random-weight models: prompt tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=None, help="GSM8K test jsonl (smollm2-real); default: shared data")
    p.add_argument("--json", default=None, help="also write the rows as JSON (and the table as .md) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    model, tok = load_model(args.model, dtype_for(args.dtype, device), device)
    header = run_header(device, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    header.update({"model": args.model, "k": args.k, "max_new_tokens": args.max_new_tokens})
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.adaptive]
    table = Table(COLUMNS)
    all_sources = list(SOURCES) if args.epochs == 2 else ["siblings+history"]
    for g in args.group_sizes:
        if tok is not None:
            prompts = load_prompts(tok, args.data or dataset_file("gsm8k"), args.num_prompts, args.prompt_offset)
            lengths, eos, header["lengths"] = None, [tok.eos_token_id], "EOS (real weights)"
        else:
            records, source = trace_lengths(args.num_prompts, g, args.max_new_tokens, args.trace, args.mean,
                                            args.sigma, args.prompt_len, args.seed)
            work = make_workload(model, None, records, source, args.seed)
            prompts, lengths, eos, header["lengths"] = work.prompt_ids, work.lengths, [work.eos_id], source
        for temp in args.temperatures:
            earlier = None
            if args.epochs == 2:  # epoch 1: plain rollout, its completions feed every epoch-2 engine's history
                row, earlier = run_one(model, prompts, lengths, g, temp, "none", True, True, args, eos)
                table.add(**row)
            for method in args.methods:
                for sources in (args.suffix_sources or all_sources) if method == "suffix" else ["siblings+history"]:
                    for adaptive in ([True] if method == "none" else modes):
                        eager = method == "none" and args.eager_none and temp == args.temperatures[0]
                        for graphs in [True, False] if eager else [True]:
                            row, _ = run_one(model, prompts, lengths, g, temp, method, adaptive, graphs, args, eos,
                                             sources, earlier)
                            table.add(**row)
                            save_json(args.json, header, table, {"partial": True})
    write_results(args.json, header, table, {"args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
