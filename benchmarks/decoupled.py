"""Decoupled speculation (SpecActor §4.1, issue 27): none / coupled / decoupled rollouts of SmolLM2-135M-Instruct's
real weights on chat-formatted GSM8K train questions, at several batch sizes, with the simulator's prediction beside
each measured row.

Per batch size b (b / G prompts, G samples each, all b samples decoding together: `sampling_mode="full_group"`), three
fresh engines roll out the same prompts with the same seed: no speculation, coupled speculation (today's adaptive
controller) and decoupled speculation (the TGS plan, Alg. 1 + 2, or the drain plan once nothing is left to admit,
which here is from the first step; the drafter drafts ahead on its own thread). Each
engine first makes a warm-up call with another seed (`--warmup-tokens`; it profiles the step-time models and the
acceptance the plan needs, as a training run's earlier calls would), then the measured call. Columns: wall seconds and
process CPU seconds (both threads) of the call, decode forwards (every decode/verify forward), verify forwards
(forwards that verified at least one draft), the mean acceptance length, the plan the decoupled engine chose (at the
first decode step of the call), the measured speed (generated tokens / wall second), the simulator's predicted speed
for the same mode (`sim/speculative.py`: the call replayed on its own lengths and per-sample acceptance with the
engine's fitted step times, host work outside the forwards not modelled), and the speed-up over `none`. `same_as_none`:
whether the call emitted plain decoding's tokens; a row may differ only after a tie at float32 rounding (checked, as
the fuzzer does; anything else raises, naming the mode, row, token and margin).

`--repeats N`: N repetitions per batch size with fresh engines, the three modes interleaved (each mode runs first in
turn), so that the machine's load drifts over all of them alike; `wall_s` / `cpu_s` are the medians over the
repetitions, `wall_range` their spread, `verify_fwd_reps` the verify forwards of each repetition, `load` the range of
the 1-minute load average when the measured calls started (on a shared machine wall times are only comparable at a load
below the core count; the drafter thread needs a free core); the other columns are the last repetition's.
`wall_vs_none` / `wall_vs_coupled`: the paired comparison, the median over repetitions of this mode's wall time over
`none`'s (`coupled`'s) in the same repetition, with its distribution-free confidence interval (order statistics;
`ci_coverage` is its coverage, >= 0.95 from 6 repetitions on): the calls of one repetition run back to back, so the
ratio cancels the load that drifts between repetitions, which the medians of each mode do not.

`--forced-windows N ...`: two more modes per N, `coupled-wN` and `decoupled-wN`, that speculate at every step with
window N whatever the plan would say (every row drafts N tokens; decoupled-wN drafts them ahead on the drafter thread
at every step). They bound what any window could give on this machine, and time the drafter thread itself
(`decoupled-wN` against `coupled-wN` in `wall_vs_coupled`: the same windows, drafted ahead instead of before the
forward). Their `sim_tok_s`: the replay with the same fixed window (decoupled only; the replay's coupled mode is the
controller's best window).

Drafters: `--drafter suffix` (the group's suffix tree: nearly free drafting, so the plan is expected to keep coupled
execution) or `--drafter draft_model` (a truncated SmolLM2, its first `--draft-layers` layers with the final norm and
head: costly drafting, the case decoupled execution is for).

    python benchmarks/decoupled.py --drafter suffix --batches 8 32 64 --max-new-tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from common import Table, median_ci, pick_device, run_header, write_results

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.runner.sampler import Sampler, row_keys, uniform64
from trl_infinite.sim import SimConfig
from trl_infinite.sim.speculative import SpecReplay, acceptance_from_stats, simulate_speculative
from trl_infinite.sim.traces import TraceRecord
from trl_infinite.testing.offline_models import load_smollm2
from trl_infinite.testing.shared_data import dataset_file

MODES = ("none", "coupled", "decoupled")


def gsm8k_train_prompts(tokenizer, n: int) -> list[list[int]]:
    lines = dataset_file("gsm8k", "train").read_text().splitlines()[:n]
    msgs = [[{"role": "user", "content": json.loads(line)["question"]}] for line in lines]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


TIE_TOLERANCE = 1e-5  # the fuzzer's (`tests/fuzz/_fuzz_engine.py`): relative to the row's total mass


@dataclass
class Difference:
    """Where a row of `mode` first leaves plain decoding's tokens, judged on the model's own full forward.

    `margin`: distance of the inverse-CDF target (uniform x total mass) to the nearest CDF boundary between the two
    tokens, relative to the total mass (greedy: the two logits' difference relative to the largest); a tie at
    float32 rounding when `margin <= TIE_TOLERANCE`; `lp_got` /
    `lp_ref`: the full forward's processed log-probs of the two tokens; `noise`: the largest difference between the
    two runs' emitted log-probs over the row's common prefix (0..k-1), and `noise_k`: the engine's log-prob of plain
    decoding's token k against the full forward's (the size of the float32 rounding between forwards of different
    shapes, to judge `margin` against)."""

    mode: str
    row: int
    k: int
    got: int
    ref: int
    margin: float
    lp_got: float
    lp_ref: float
    noise: float
    noise_k: float

    @property
    def tie(self) -> bool:
        return self.margin <= TIE_TOLERANCE

    def __str__(self) -> str:
        return (f"{self.mode} row {self.row} token {self.k}: {self.got} vs plain {self.ref}, margin "
                f"{self.margin:.3g} = {self.margin / TIE_TOLERANCE:.3g} x tolerance, full-forward log-probs "
                f"{self.lp_got:.6g} / {self.lp_ref:.6g}, run-to-run log-prob noise on the prefix {self.noise:.3g}, "
                f"plain run vs full forward at k {self.noise_k:.3g}")


def differences(model, prompts, g: int, sp: SamplingParams, mode: str, got, ref) -> list[Difference]:
    """Every row of `got` (a `RolloutResult`) that leaves `ref`'s tokens (plain decoding), with its diagnosis."""
    out = []
    for row, (a, r) in enumerate(zip(got.completion_ids, ref.completion_ids)):
        if a == r:
            continue
        k = next((i for i in range(min(len(a), len(r))) if a[i] != r[i]), None)
        if k is None:
            raise RuntimeError(f"{mode} row {row}: one output is a prefix of the other ({len(a)} vs {len(r)} tokens)")
        prompt = prompts[row // g]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + r[:k]])).logits[0, -1:].float()
        processed = Sampler(sp).process(logits)[0].double()  # [V]
        if sp.greedy:  # an argmax tie: the two logits within the tolerance of the largest
            margin = abs(processed[a[k]] - processed[r[k]]).item() / max(1.0, processed.abs().max().item())
        else:
            cdf = processed.exp().cumsum(0)
            key = row_keys(sp.seed, torch.tensor([row // g]), torch.tensor([row % g]),
                           torch.tensor([len(prompt) + k]))
            target = uniform64(key)[0].item() * cdf[-1].item()
            lo, hi = min(a[k], r[k]), max(a[k], r[k])
            margin = (cdf[lo:hi] - target).abs().min().item() / cdf[-1].item()
        noise = max((abs(x - y) for x, y in zip(got.logprobs[row][:k], ref.logprobs[row][:k])), default=0.0)
        out.append(Difference(mode, row, k, a[k], r[k], margin, processed[a[k]].item(), processed[r[k]].item(),
                              noise, abs(ref.logprobs[row][k] - processed[r[k]].item())))
    return out


def check_same(model, prompts, g: int, sp: SamplingParams, mode: str, got, ref) -> str:
    """'identical', or 'n ties' when n rows differ from plain decoding's (`ref`) and each first difference is a tie
    at float32 rounding (the inverse-CDF uniform within `TIE_TOLERANCE` of the CDF boundary between the two tokens,
    in the processed distribution of the model's own full forward: a verification forward and a one-token forward
    round differently, `tests/fuzz/_fuzz_engine.py`); raises on a difference that is not a tie, naming the mode,
    row, token, both tokens, the margin and the rounding noise (`Difference`). Greedy: a tie is two logits within
    the tolerance (the fuzzer's rule)."""
    diffs = differences(model, prompts, g, sp, mode, got, ref)
    for d in diffs:
        print(f"  difference: {d}", file=sys.stderr, flush=True)
    bad = [d for d in diffs if not d.tie]
    if bad:
        raise RuntimeError("differs from plain decoding without a tie: " + "; ".join(map(str, bad)))
    return "identical" if not diffs else f"{len(diffs)} ties"


def truncated(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The model's first `layers` decoder layers with its embeddings, final norm and head (a self-draft)."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    draft = type(model)(cfg)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"truncated draft model: weights missing {missing[:3]}")
    return draft.eval()


def paired_ratio(walls: list[float], base: list[float]) -> str:
    """`"median [lo, hi]"` of the per-repetition ratios `walls[r] / base[r]` (the calls of one repetition run back
    to back), the interval `median_ci`'s."""
    ratios = [w / b for w, b in zip(walls, base, strict=True)]
    lo, hi, _ = median_ci(ratios)
    return f"{statistics.median(ratios):.3f} [{lo:.3f}, {hi:.3f}]"


def forced_mode(mode: str) -> tuple[str, int | None]:
    """`"coupled-w2"` -> `("coupled", 2)`: a mode of `--forced-windows`; a planned mode -> `(mode, None)`."""
    base, _, w = mode.partition("-w")
    return base, int(w) if w else None


def engine_config(args, mode: str, b: int, draft, forced: bool = False) -> EngineConfig:
    """The engine of one mode (`none`, `coupled`, `decoupled`, or a forced one, `coupled-wN` / `decoupled-wN`).
    `forced` (and every forced mode): speculation at every step whatever the timings (no adaptive controller, every
    row drafting the full window; decoupled execution with that window drafted ahead instead of the TGS plan), with
    window N for a forced mode, `--num-tokens` otherwise (`decoupled_lossless.py`)."""
    mode, window = forced_mode(mode)
    forced = forced or window is not None
    k = window or args.num_tokens
    spec = {} if mode == "none" else dict(
        speculative_method=args.drafter, speculative_num_tokens=k,
        speculative_draft_model=draft if args.drafter == "draft_model" else None,
        speculative_decoupled=mode == "decoupled")
    if forced and mode != "none":
        spec.update(speculative_adaptive=False, speculative_draft_window=k if mode == "decoupled" else None)
    return EngineConfig(kv_cache_tokens=args.kv_tokens, block_size=16, sampling_mode="full_group",
                        max_active_sequences=b, **spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["suffix", "draft_model"], default="draft_model")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--warmup-tokens", type=int, default=64,
                    help="max_new_tokens of each engine's warm-up call (not measured; it profiles the step-time models "
                         "and the acceptance, as the earlier calls of a training run would)")
    ap.add_argument("--num-tokens", type=int, default=5, help="speculative_num_tokens (largest window)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--order", nargs=3, default=["none", "coupled", "decoupled"], choices=MODES,
                    help="order in which the three engines of a batch size run (wall times drift on a shared CPU)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="repetitions per batch size, the three modes interleaved (each runs first in turn, fresh "
                         "engines each time); wall_s / cpu_s are the medians, wall_range the spread")
    ap.add_argument("--forced-windows", type=int, nargs="*", default=[],
                    help="also run coupled-wN and decoupled-wN for each N: speculation at every step with window N "
                         "whatever the plan would say (the bound on what any window gives; decoupled-wN drafts on the "
                         "drafter thread at every step)")
    ap.add_argument("--json", default=None, help="write the run as JSON (and the markdown beside it)")
    args = ap.parse_args()
    if sorted(args.order) != sorted(MODES):
        ap.error(f"--order must name each of {list(MODES)} once")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(w < 1 for w in args.forced_windows):
        ap.error(f"--forced-windows must be >= 1, got {args.forced_windows}")
    modes = list(args.order) + [f"{m}-w{w}" for w in args.forced_windows for m in ("coupled", "decoupled")]
    torch.set_num_threads(args.threads)
    device = pick_device("cpu")
    model, tok = load_smollm2()
    draft = truncated(model, args.draft_layers) if args.drafter == "draft_model" else None
    header = run_header(device, "python benchmarks/decoupled.py " + shlex.join(sys.argv[1:]))
    table = Table(["batch", "mode", "same_as_none", "wall_s", "wall_range", "cpu_s", "load", "decode_fwd", "verify_fwd",
                   "verify_fwd_reps", "accept_len", "plan", "tok_s", "sim_tok_s", "speedup_vs_none", "wall_vs_none",
                   "wall_vs_coupled", "ci_coverage"])
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                        eos_token_ids=[tok.eos_token_id])
    warm = SamplingParams(max_new_tokens=args.warmup_tokens, temperature=args.temperature, seed=args.seed + 1,
                          eos_token_ids=[tok.eos_token_id])
    for b in args.batches:
        g = args.group_size
        prompts = gsm8k_train_prompts(tok, max(1, b // g))
        walls: dict[str, list[float]] = {m: [] for m in modes}
        cpus: dict[str, list[float]] = {m: [] for m in modes}
        loads: list[float] = []
        same: dict[str, list[str]] = {m: [] for m in modes}
        verifies: dict[str, list[int]] = {m: [] for m in modes}
        runs = {}
        for rep in range(args.repeats):
            r = rep % len(modes)
            order = modes[r:] + modes[:r]  # interleaved: each mode first in turn
            reps = {}
            for mode in order:
                engine = RolloutEngine(model, engine_config(args, mode, b, draft))
                engine.generate(prompts, g, warm)
                loads.append(os.getloadavg()[0])
                t0, c0 = time.perf_counter(), time.process_time()
                out = engine.generate(prompts, g, sp)
                reps[mode] = (out, time.perf_counter() - t0, time.process_time() - c0, engine)
                walls[mode].append(reps[mode][1])
                cpus[mode].append(reps[mode][2])
                verifies[mode].append(out.stats.verify_steps)
                print(f"b={b} rep {rep} {mode}: {reps[mode][1]:.1f}s wall, {reps[mode][2]:.1f}s cpu, load "
                      f"{loads[-1]:.2f}", file=sys.stderr, flush=True)
            for m in modes:
                same[m].append(check_same(model, prompts, g, sp, m, reps[m][0], reps["none"][0]))
            runs = reps  # the columns other than wall / cpu: the last repetition
        ref = runs["none"][0].completion_ids
        base_speed = None
        fitted = [m for m in ("decoupled", "coupled", *modes[3:]) if runs[m][3].speculator.step_times() is not None]
        pairs = [(m, "none") for m in modes if m != "none"] + [("decoupled", "coupled")] + \
            [(f"decoupled-w{w}", f"coupled-w{w}") for w in args.forced_windows]
        paired = {(m, base): paired_ratio(walls[m], walls[base]) for m, base in pairs}
        for mode in (*MODES, *modes[3:]):  # rows in a fixed order, `none` first (`speedup_vs_none`)
            out, _, _, engine = runs[mode]
            wall, cpu = statistics.median(walls[mode]), statistics.median(cpus[mode])
            s = out.stats
            source = mode if mode in fitted else (fitted[0] if fitted else None)  # the step times and acceptance
            times = runs[source][3].speculator.step_times() if source else None
            extra = runs[source][0].stats.extra if source else {}
            records = [TraceRecord(prompt_len=len(p), lengths=[len(c) for c in ref[i * g:(i + 1) * g]],
                                   prompt_index=i, extra={"acceptance": acceptance_from_stats(extra, i, g)})
                       for i, p in enumerate(prompts)]
            sim_speed = None
            base_mode, window = forced_mode(mode)
            if times is not None and not (window is not None and base_mode == "coupled"):  # the sim's coupled
                # mode is the controller's best window, not a forced one
                replay = SpecReplay(times, mode=base_mode, num_tokens=window or args.num_tokens, seed=args.seed,
                                    draft_window=window)
                sim = simulate_speculative(records, SimConfig(engine=engine_config(args, "none", b, None),
                                                              prompts_per_call=len(prompts)), replay)
                call = sim.calls[0]
                sim_speed = call.generated_tokens / call.extra["sim_seconds"]
            speed = s.generated_tokens / wall
            base_speed = base_speed or speed
            plan = (f"{s.extra['spec_plan_mode']} w={s.extra['spec_plan_window']}" if "spec_plan_mode" in s.extra
                    else f"forced w={window}" if window is not None else "-" if mode != "decoupled" else "none made")
            table.add(batch=b, mode=mode, same_as_none=", ".join(sorted(set(same[mode]))), wall_s=wall,
                      wall_range=f"{min(walls[mode]):.3g}-{max(walls[mode]):.3g}", cpu_s=cpu,
                      load=f"{min(loads):.2f}-{max(loads):.2f}", decode_fwd=s.decode_steps,
                      verify_fwd=s.verify_steps, verify_fwd_reps=" ".join(map(str, verifies[mode])),
                      accept_len=s.mean_acceptance_length, plan=plan, tok_s=speed,
                      sim_tok_s=sim_speed, speedup_vs_none=speed / base_speed,
                      wall_vs_none=paired.get((mode, "none")),
                      wall_vs_coupled=paired.get((mode, "coupled" if window is None else f"coupled-w{window}")),
                      ci_coverage=median_ci(walls[mode])[2])
    write_results(args.json, header, table, {"args": vars(args)})


if __name__ == "__main__":
    main()
