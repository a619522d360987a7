"""Where a speculative rollout's time goes on SmolLM2-135M-Instruct (real weights, GSM8K train prompts): the cost of
a verification step against a plain one, the fit of the speculation cost model on those steps, and the host work of
the speculative step beside the forwards.

1. Step times. A coupled engine (`suffix` drafter, the adaptive controller) makes a warm-up call, then a measured
   call in which every decode step's (rows, draft tokens, seconds) is recorded as the cost model receives it
   (`Speculator.cost.observe`). Table "steps": the steps at the full batch by number of draft tokens, with their
   median time. Table "fit": the cost model `t = c0 + c1 b + c2 D + c3 [D > 0]` fitted on those steps by the
   engine's `AffineFit` (ridge relative to each regressor's scale), by the same fit with the ridge scaled by the
   mean of the diagonal (the fit before issue 27's change), and by plain least squares.
2. Profile. One thread, cProfile of the measured call of a fresh engine per mode (`none`, `coupled`, `decoupled`):
   process CPU seconds; seconds inside the suffix drafter (`spec_decode/suffix.py`: the cumulative time its
   functions got from callers outside it); seconds of the verification forwards (`ModelRunner.forward` called by
   the speculative step); and the speculative step's host work (`SpeculativeStep.run` minus those forwards and
   minus the plain static decode steps it launches: drafting, planning, verification sampling, bookkeeping).

    python benchmarks/spec_costs.py --batch 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shlex
import statistics
import sys
import time

import torch
from common import Table, pick_device, run_header
from decoupled import engine_config, gsm8k_train_prompts

from trl_infinite.engine import RolloutEngine, SamplingParams
from trl_infinite.engine.spec_decode.adaptive import AffineFit, features
from trl_infinite.testing.offline_models import load_smollm2


def fit(steps: list[tuple[int, int, float]], ridge: float, per_regressor: bool) -> tuple[float, ...]:
    """(c0, c1, c2, c3) in ms fitted on `steps` without forgetting."""
    if per_regressor:
        f = AffineFit(4, decay=1.0, ridge=ridge)
        for b, d, s in steps:
            f.observe(features(b, d), s)
        return tuple(1000 * c for c in f.coef)
    x = torch.tensor([features(b, d) for b, d, _ in steps], dtype=torch.float64)  # [n, 4]
    y = torch.tensor([s for _, _, s in steps], dtype=torch.float64)  # [n]
    xtx = x.T @ x
    reg = ridge * float(xtx.diagonal().mean()) * torch.eye(4, dtype=torch.float64)
    return tuple(1000 * c for c in torch.linalg.solve(xtx + reg, x.T @ y).clamp_min(0.0).tolist())


def bucket(d: int) -> str:
    return "0" if d == 0 else "1" if d == 1 else "2-4" if d <= 4 else "5-8" if d <= 8 else "9+"


def split(stats: pstats.Stats) -> tuple[float, float, float]:
    """(suffix drafter seconds, verification forward seconds, speculative step host seconds), from the cumulative
    times each function got from each caller (no nested call counted twice)."""
    suffix = run = static = verify = 0.0
    for (path, _, name), (_, _, _, cum, callers) in stats.stats.items():
        outside = sum(ct for (cpath, _, _), (_, _, _, ct) in callers.items()
                      if not cpath.endswith("spec_decode/suffix.py"))
        from_step = sum(ct for (cpath, _, _), (_, _, _, ct) in callers.items() if cpath.endswith("spec_decode/step.py"))
        if path.endswith("spec_decode/suffix.py"):
            suffix += outside
        elif path.endswith("spec_decode/step.py") and name == "run":
            run += cum
        elif path.endswith("engine/decode/static.py") and name == "_run":
            static += cum
        elif path.endswith("engine/runner/model_runner.py") and name == "forward":
            verify += from_step
    return suffix, verify, (run - static - verify if run else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=64)
    ap.add_argument("--num-tokens", type=int, default=5)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of part 1 (part 2: one)")
    args = ap.parse_args()
    args.drafter = "suffix"
    device = pick_device("cpu")
    model, tok = load_smollm2()
    prompts = gsm8k_train_prompts(tok, max(1, args.batch // args.group_size))
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0, eos_token_ids=[tok.eos_token_id])
    warm = SamplingParams(max_new_tokens=args.warmup_tokens, temperature=1.0, seed=1,
                          eos_token_ids=[tok.eos_token_id])
    header = run_header(device, "python benchmarks/spec_costs.py " + shlex.join(sys.argv[1:]))
    print("\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n")

    torch.set_num_threads(args.threads)
    engine = RolloutEngine(model, engine_config(args, "coupled", args.batch, None))
    engine.generate(prompts, args.group_size, warm)
    steps: list[tuple[int, int, float]] = []
    observe = engine.speculator.cost.observe

    def recorded(batch: int, drafts: int, seconds: float) -> None:
        steps.append((batch, drafts, seconds))
        observe(batch, drafts, seconds)

    engine.speculator.cost.observe = recorded
    engine.generate(prompts, args.group_size, sp)
    full = [(d, s) for b, d, s in steps if b == args.batch]
    print(f"steps at b = {args.batch} (threads {args.threads}), measured call:\n")
    table = Table(["draft_tokens", "steps", "median_ms"])
    for key in ("0", "1", "2-4", "5-8", "9+"):
        times = [s for d, s in full if bucket(d) == key]
        if times:
            table.add(draft_tokens=key, steps=len(times), median_ms=1000 * statistics.median(times))
    print(f"\ncost model fitted on the {len(steps)} steps of the measured call:\n")
    fits = Table(["fit", "c0_ms", "c1_ms", "c2_ms", "c3_ms"])
    for name, ridge, per in (("per-regressor ridge (engine)", 1e-3, True), ("mean-diagonal ridge (before)", 1e-3, False),
                             ("least squares", 1e-12, True)):
        c = fit(steps, ridge, per)
        fits.add(fit=name, c0_ms=c[0], c1_ms=c[1], c2_ms=c[2], c3_ms=c[3])

    torch.set_num_threads(1)
    print(f"\none thread, cProfile of the measured call (b = {args.batch}):\n")
    prof = Table(["mode", "cpu_s", "verify_fwd", "suffix_drafter_s", "verify_forward_s", "spec_step_host_s"])
    for mode in ("none", "coupled", "decoupled"):
        engine = RolloutEngine(model, engine_config(args, mode, args.batch, None))
        engine.generate(prompts, args.group_size, warm)
        profile = cProfile.Profile()
        c0 = time.process_time()
        profile.enable()
        out = engine.generate(prompts, args.group_size, sp)
        profile.disable()
        cpu = time.process_time() - c0
        suffix, verify, host = split(pstats.Stats(profile))
        prof.add(mode=mode, cpu_s=cpu, verify_fwd=out.stats.verify_steps, suffix_drafter_s=suffix,
                 verify_forward_s=verify, spec_step_host_s=host)


if __name__ == "__main__":
    main()
