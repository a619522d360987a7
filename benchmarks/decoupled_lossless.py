"""Losslessness of decoupled speculation on real weights, with speculation forced on (issue 27).

`decoupled.py`'s engines decide from wall-clock timings when to speculate, so under load they verify drafts at
different steps, in different batch shapes. Here the situations are forced, the same whatever the load: per seed,
SmolLM2-135M-Instruct on chat-formatted GSM8K train questions, b samples decoding together, plain decoding against
coupled speculation with `speculative_adaptive=False` (every row verifies up to k drafts at every step) and
decoupled speculation with a fixed window (`speculative_draft_window=k`: every row verifies the window drafted ahead
on the drafter thread when it is still valid). Each speculative row is checked against plain decoding with
`decoupled.py`'s check: a row may leave plain decoding's tokens only at a tie at float32 rounding, and every
difference is printed with its margin and the run-to-run rounding noise (`Difference`).

    python benchmarks/decoupled_lossless.py --batch 64 --seeds 0 1 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
from common import Table, pick_device, run_header, write_results
from decoupled import TIE_TOLERANCE, differences, engine_config, gsm8k_train_prompts, truncated

from trl_infinite.engine import RolloutEngine, SamplingParams
from trl_infinite.testing.offline_models import load_smollm2

FORCED = ("coupled", "decoupled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["suffix", "draft_model"], default="suffix")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-tokens", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device("cpu")
    model, tok = load_smollm2()
    draft = truncated(model, args.draft_layers) if args.drafter == "draft_model" else None
    header = run_header(device, "python benchmarks/decoupled_lossless.py " + shlex.join(sys.argv[1:]))
    table = Table(["seed", "mode", "wall_s", "verify_fwd", "draft_tokens", "accepted", "rows_differing", "ties",
                   "max_tie_margin", "not_ties"])
    b, g = args.batch, args.group_size
    prompts = gsm8k_train_prompts(tok, max(1, b // g))
    failures = []
    for seed in args.seeds:
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=seed,
                            eos_token_ids=[tok.eos_token_id])
        ref = RolloutEngine(model, engine_config(args, "none", b, None)).generate(prompts, g, sp)
        for mode in FORCED:
            t0 = time.perf_counter()
            out = RolloutEngine(model, engine_config(args, mode, b, draft, forced=True)).generate(prompts, g, sp)
            wall = time.perf_counter() - t0
            diffs = differences(model, prompts, g, sp, mode, out, ref)
            for d in diffs:
                print(f"seed {seed}: {d}", file=sys.stderr, flush=True)
            ties = [d for d in diffs if d.tie]
            failures += [(seed, d) for d in diffs if not d.tie]
            s = out.stats
            table.add(seed=seed, mode=mode, wall_s=wall, verify_fwd=s.verify_steps, draft_tokens=s.draft_tokens,
                      accepted=s.accepted_tokens, rows_differing=len(diffs), ties=len(ties),
                      max_tie_margin=max((d.margin for d in ties), default=None), not_ties=len(diffs) - len(ties))
    write_results(args.json, header, table, {"args": vars(args), "tolerance": TIE_TOLERANCE})
    if failures:
        raise SystemExit("differences that are not ties: " + "; ".join(f"seed {s}: {d}" for s, d in failures))


if __name__ == "__main__":
    main()
