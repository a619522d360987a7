"""Speculative rollouts on SmolLM2-135M-Instruct over GSM8K test prompts: none / ngram / suffix / best_of_n.

For each (G, temperature, method) the same prompts are rolled out with the same seed (`RolloutEngine`, all samples
decoding at once in fixed slots, at most 256 new tokens) and the table reports the mean acceptance length (tokens
emitted per sample per verification forward, bonus included), the decode forward passes, the forward passes of the
tail (while the last 10% of samples to finish, at least one, were still running), wall time and generated tokens
per second. Offline; CPU by default.

`--epochs 2` measures drafting from history (RhymeRL's HistoSpec): the same prompts are first rolled out once without
speculation (epoch 1, seed `--seed`), their completions go into each measured engine's per-prompt history (exactly
what the engine records after a call), then epoch 2 (seed `--seed + 1`) is measured per method; the suffix drafter
runs once per `--suffix-sources` ("siblings" = this call only, "siblings+history", "history" = earlier visit only).

    python benchmarks/speculative.py --num-prompts 2                      # CPU, ~10-15 min on 2 cores
    python benchmarks/speculative.py --epochs 2 --methods none suffix --group-sizes 16 --threads 1
    python benchmarks/speculative.py --device cuda --num-prompts 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = ("none", "ngram", "suffix", "best_of_n")


def default_data() -> Path:
    from trl_infinite.utils.shared_data import dataset_file

    return dataset_file("gsm8k")


def load_prompts(tokenizer, path: Path, n: int, offset: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[offset : offset + n]]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for r in rows
    ]


def run_one(model, prompts, g: int, temperature: float, method: str, adaptive: bool, args, eos: list[int],
            sources: str = "siblings+history", earlier=None, seed: int | None = None) -> dict:
    """One measured rollout -> (table row, `RolloutResult`); `earlier` (a `RolloutResult` of the same prompts) is
    put in the engine's history first."""
    from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams

    config = EngineConfig(
        sampling_mode="fixed_slot",
        max_active_sequences=len(prompts) * g,
        kv_cache_tokens=args.kv_cache_tokens,
        speculative_method=None if method == "none" else method,
        num_speculative_tokens=args.k,
        speculative_adaptive=adaptive,
        speculative_suffix_sources=sources,
    )
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, eos_token_ids=eos,
                              seed=args.seed if seed is None else seed)
    engine = RolloutEngine(model, config)
    if earlier is not None:  # what the engine itself records after the earlier call
        for i, p in enumerate(prompts):
            comps = earlier.completion_ids[i * g : (i + 1) * g]
            engine.history.record(p, [len(c) for c in comps], comps)
    forwards, finished_at = [0], []
    forward = engine.runner.forward

    def counting_forward(*a, **kw):  # target-model forwards (prefill happens before the tail, so it cancels out)
        forwards[0] += 1
        return forward(*a, **kw)

    engine.runner.forward = counting_forward
    result = engine.generate(prompts, g, sampling, on_sample_finished=lambda *_: finished_at.append(forwards[0]))
    s = result.stats
    n_tail = max(1, math.ceil(0.1 * len(finished_at)))  # the last 10% of samples to finish (at least one)
    tail = forwards[0] - finished_at[-n_tail - 1] if len(finished_at) > n_tail else forwards[0]
    label = f"{method}[{sources}]" if method == "suffix" else method
    return {
        "method": label, "adaptive": adaptive if method != "none" else None, "epoch": 2 if earlier else 1, "G": g,
        "temperature": temperature, "num_prompts": len(prompts),
        "mean_acceptance_length": s.mean_acceptance_length if s.verify_steps else 1.0,
        "decode_steps": s.decode_steps, "verify_steps": s.verify_steps, "tail_decode_steps": tail,
        "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
        "generated_tokens": s.generated_tokens, "wall_time_s": s.wall_time_s, "tokens_per_second": s.tokens_per_second,
    }, result


def _epoch_one(model, prompts, g, temp, args, eos, rows):
    """The first visit (no speculation, seed --seed); adds its row and returns its `RolloutResult`."""
    row, result = run_one(model, prompts, g, temp, "none", True, args, eos)
    rows.append(row)
    _emit(rows, args)
    return result


def _emit(rows, args) -> None:
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def _flag(adaptive: bool | None) -> str:
    return "-" if adaptive is None else ("on" if adaptive else "off")


def table(rows: list[dict]) -> str:
    head = ("| epoch | G | T | method | adaptive | mean acc. len | decode fwd | tail fwd | verify fwd | drafted | "
            "accepted | tokens | wall s | tok/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['epoch']} | {r['G']} | {r['temperature']} | {r['method']} | {_flag(r['adaptive'])} | "
            f"{r['mean_acceptance_length']:.2f} | "
            f"{r['decode_steps']} | {r['tail_decode_steps']} | {r['verify_steps']} | {r['draft_tokens']} | "
            f"{r['accepted_tokens']} | {r['generated_tokens']} | {r['wall_time_s']:.1f} | "
            f"{r['tokens_per_second']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--prompt-offset", type=int, default=0)
    p.add_argument("--group-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--adaptive", choices=["on", "off", "both"], default="both",
                   help="speculative_adaptive: on = the product default (cost model may switch speculation off), "
                   "off = always draft k tokens; both = one row each")
    p.add_argument("--epochs", type=int, default=1, choices=[1, 2], help="2: measure the second visit of the "
                   "prompts, with the first visit's completions in the engine's history")
    p.add_argument("--suffix-sources", nargs="+", default=None, choices=["siblings", "siblings+history", "history"],
                   help="speculative_suffix_sources of the suffix rows (default: all three with --epochs 2)")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--kv-cache-tokens", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=default_data())
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    import torch

    from trl_infinite.utils.offline_models import load_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_smollm2(device=args.device)
    model.eval()
    prompts = load_prompts(tok, args.data, args.num_prompts, args.prompt_offset)
    eos = [tok.eos_token_id]
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.adaptive]
    rows = []
    t0 = time.perf_counter()
    all_sources = ["siblings", "siblings+history", "history"] if args.epochs == 2 else ["siblings+history"]
    for g in args.group_sizes:
        for temp in args.temperatures:
            earlier = None
            if args.epochs == 2:  # epoch 1: plain rollout, its completions feed every epoch-2 engine's history
                earlier = _epoch_one(model, prompts, g, temp, args, eos, rows)
            for method in args.methods:
                for sources in (args.suffix_sources or all_sources) if method == "suffix" else ["siblings+history"]:
                    for adaptive in ([True] if method == "none" else modes):
                        rows.append(run_one(model, prompts, g, temp, method, adaptive, args, eos, sources, earlier,
                                            args.seed + (1 if earlier is not None else 0))[0])
                        _emit(rows, args)
    print(f"device={args.device} prompts={len(prompts)} k={args.k} epochs={args.epochs} "
          f"total {time.perf_counter() - t0:.0f}s\n")
    print(table(rows))


if __name__ == "__main__":
    main()
