"""SpecActor's decoupled-speculation plan (§4.1): the TGS model, the window search (Alg. 1) and the per-request
reconfiguration (Alg. 2), for the execution `decoupled.py` runs.

Step times (seconds), affine as in the paper, fitted online (`adaptive.AffineFit`):

    V(b, D) = v0 + v1 b + v2 D + v3 [D > 0]   verification forward, b rows, D draft tokens in all (v3: the fixed
                                              cost of verifying at all, `adaptive.CostModel`)
    Dr(b, w) = d0 + d1 w + d2 b w             drafting w tokens for each of b rows (w rounds)

Execution (per row, window w, i.i.d. acceptance p per draft token). While the verifier checks the row's drafts
`D` (|D| = w), the drafter drafts `E = e_1 .. e_{w+1}` on its own thread as if `D` were accepted (`e_1` is its guess
of the bonus token). If the verifier accepted all of `D` and its bonus token is `e_1`, the row's next drafts are
`e_2 .. e_{w+1}`, ready without drafting on the critical path (state S1); otherwise `E` is wasted and the row's next
step verifies no draft (it emits one token, state S0) while the drafter drafts again from the corrected context.

    tokens of an S1 step   1 + E_w = sum_{a=0..w} p^a            (a accepted drafts, then the correction/bonus)
    tokens of an S0 step   1
    P(S1 -> S1) = p^{w+1},  P(S0 -> S1) = p   =>   share of S1 steps  pi_w = p / (p + 1 - p^{w+1})
    TGS_d(w, b) = b (pi_w (1 + E_w) + 1 - pi_w) / max(Dr(b, w + 1), V(b, pi_w b w))

Coupled (draft, then verify; w = 0 is plain decoding):

    TGS_c(w, b) = b (1 + E_w) / (Dr(b, w) [w > 0] + V(b, b w))

Alg. 1 on one device: `w* = argmax_{1 <= w <= w_max} TGS_d(w, b)`; decoupled runs only if it beats the best coupled
window (`plan`). Alg. 2: each request below the mean acceptance gets the better of `argmax_w TGS_c(w, b)` and
`argmax_w TGS_d(w, b)` at its own acceptance (`reconfigure`; the paper evaluates it at b = 1, see there).

Draining (nothing left to admit; `drain`): the call ends when its slowest row does, so the plan minimises the
makespan instead of the batch's tokens per second. Row r with R_r tokens to go at most and window w_r needs
n_r = R_r / tok(p_r, w_r) steps (tok: 1 + E_w coupled, pi_w (1 + E_w) + 1 - pi_w decoupled); the call takes
M = max_r n_r steps of

    S_c(w) = Dr(#{r: w_r > 0}, max_r w_r) + V(b, sum_r w_r)                            coupled
    S_d(w) = max(Dr(#{r: w_r > 0}, max_r w_r + 1), V(b, sum_r pi_{w_r}(p_r) w_r))      decoupled

seconds each (every row counted at every step: an upper bound once rows finish). Departure from the paper, whose
objective is throughput throughout: in an RL rollout every sample is submitted at once, so a call spends its end
(all of it, when every sample fits at once) with nothing to admit, where a faster row that is not the slowest only
adds verification work (SmolLM2-135M, CPU, 8 rows: speculation raised tokens per second but not one row finished
sooner, and the call took longer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_infinite.engine.spec_decode.adaptive import AffineFit, features

COUPLED, DECOUPLED = "coupled", "decoupled"


class DraftTimes:
    """The drafter's step time `Dr(b, w) = d0 + d1 w + d2 b w`, from timed `propose` calls (b rows drafting, w the
    longest draft, b w approximated by the tokens asked for)."""

    def __init__(self):
        self.fit = AffineFit(3)

    def observe(self, rows: int, rounds: int, tokens: int, seconds: float) -> None:
        if rows > 0 and rounds > 0:
            self.fit.observe([1.0, float(rounds), float(tokens)], seconds)

    @property
    def ready(self) -> bool:
        """One timed drafting step is enough for a first plan (the ridge keeps the fit defined); each later one
        refines it."""
        return self.fit.n_obs >= 1


@dataclass(frozen=True)
class StepTimes:
    """The two affine step-time models (module docstring): `verify` = (v0, v1, v2, v3), `draft` = (d0, d1, d2)."""

    verify: tuple[float, float, float, float]
    draft: tuple[float, float, float]

    def verify_time(self, b: float, drafts: float) -> float:
        return max(sum(c * x for c, x in zip(self.verify, features(b, drafts), strict=True)), 1e-9)

    def draft_time(self, b: float, w: int) -> float:
        if w <= 0 or b <= 0:
            return 0.0
        d0, d1, d2 = self.draft
        return d0 + d1 * w + d2 * b * w


def emitted(p: float, w: int) -> float:
    """1 + E_w = sum_{a=0..w} p^a: expected tokens a verification of w drafts emits (bonus included)."""
    return sum(p**a for a in range(w + 1))


def chain_share(p: float, w: int) -> float:
    """pi_w: the long-run share of steps whose drafts were drafted ahead and are still valid (S1)."""
    return p / (p + 1.0 - p ** (w + 1)) if p > 0 else 0.0


def tgs_coupled(times: StepTimes, p: float, w: int, b: float) -> float:
    """Tokens per second of coupled speculation with window w (w = 0: plain decoding) at batch b."""
    return b * emitted(p, w) / (times.draft_time(b, w) + times.verify_time(b, b * w))


def tgs_decoupled(times: StepTimes, p: float, w: int, b: float) -> float:
    """Tokens per second of decoupled speculation with window w >= 1 at batch b (module docstring)."""
    pi = chain_share(p, w)
    tokens = pi * emitted(p, w) + 1.0 - pi
    return b * tokens / max(times.draft_time(b, w + 1), times.verify_time(b, pi * b * w))


@dataclass(frozen=True)
class Plan:
    """`mode` (`COUPLED` or `DECOUPLED`), `window` (drafts per step; 0 = no drafts), `tgs` (predicted tokens/s)."""

    mode: str
    window: int
    tgs: float


def best_coupled(times: StepTimes, p: float, b: float, w_max: int) -> Plan:
    w = max(range(w_max + 1), key=lambda k: (tgs_coupled(times, p, k, b), -k))
    return Plan(COUPLED, w, tgs_coupled(times, p, w, b))


def best_decoupled(times: StepTimes, p: float, b: float, w_max: int) -> Plan:
    w = max(range(1, w_max + 1), key=lambda k: (tgs_decoupled(times, p, k, b), -k))
    return Plan(DECOUPLED, w, tgs_decoupled(times, p, w, b))


def plan(times: StepTimes, p: float, b: int, w_max: int) -> Plan:
    """Alg. 1 on one device (one drafter, one verifier): the decoupled window with the highest TGS at the initial
    batch `b`, or the best coupled window (possibly 0, plain decoding) when that is faster."""
    dec, cpl = best_decoupled(times, p, b, w_max), best_coupled(times, p, b, w_max)
    return dec if dec.tgs > cpl.tgs else cpl


def reconfigure(times: StepTimes, base: Plan, acceptance: dict, w_max: int, batch: int) -> dict:
    """Alg. 2: `acceptance[key] = p_r`; requests below the mean get the better of the coupled and the decoupled
    window (ties: coupled, which wastes nothing); the others keep `base`. Returns {key: Plan}.

    Departure from the paper: a request is evaluated at the current verification batch `batch`, not at b = 1. In a
    batch that is compute-bound, the extra positions a request verifies cost what they cost at that batch; at b = 1
    every request looks cheap to speculate for, and a batch planned as "no speculation" got windows anyway (64 rows
    on CPU: 30 verification forwards, 2x slower than plain decoding)."""
    if not acceptance:
        return {}
    mean = sum(acceptance.values()) / len(acceptance)
    return {key: base if p >= mean else plan(times, p, batch, w_max) for key, p in acceptance.items()}


@dataclass(frozen=True)
class DrainPlan:
    """The drain plan (module docstring): `mode`, each row's window, the predicted steps `M` and seconds `M S(w)`."""

    mode: str
    windows: tuple[int, ...]
    steps: float
    seconds: float


def _drain_mode(times: StepTimes, remaining: list[int], acceptance: list[float], w_max: int, mode: str) -> DrainPlan:
    """The least predicted makespan of one mode: for a candidate M each row takes its smallest window with
    n_r <= M (a row that is not the slowest gains nothing from drafting more), and M ranges over the b (w_max + 1)
    values n_r(w); ties go to the larger M (fewer drafts)."""
    f64 = torch.float64
    ws = torch.arange(w_max + 1, dtype=f64)  # [W]
    p = torch.tensor(acceptance, dtype=f64).clamp(0.0, 1.0)[:, None]  # [b, 1]
    tok = (p**ws).cumsum(1)  # [b, W]: 1 + E_w
    pi = torch.where(p > 0, p / (p + 1.0 - p ** (ws + 1)), torch.zeros((), dtype=f64))  # [b, W]: pi_w, pi_0 = p
    if mode == DECOUPLED:
        tok = pi * tok + 1.0 - pi  # [b, W]; w = 0: one token
    steps = torch.tensor(remaining, dtype=f64)[:, None] / tok  # [b, W]: n_r(w)
    cand = steps.flatten().unique().flip(0)  # [C], descending
    ok = steps[None] <= cand[:, None, None]  # [C, b, W]
    feasible = ok.any(2).all(1)  # [C]
    cand, ok = cand[feasible], ok[feasible]
    w = ok.to(torch.uint8).argmax(2)  # [C, b]: the first (smallest) window that makes it
    drafting = (w > 0).sum(1).to(f64)  # [C]
    longest = w.max(1).values.to(f64)  # [C]
    d0, d1, d2 = times.draft
    v0, v1, v2, v3 = times.verify
    verified = w.to(f64) if mode == COUPLED else (pi.gather(1, w.T).T * w)  # [C, b]: drafts verified per step
    drafts = verified.sum(1)  # [C]
    verify = (v0 + v1 * len(remaining) + v2 * drafts + v3 * (drafts > 0).to(f64)).clamp_min(1e-9)  # [C]
    rounds = longest if mode == COUPLED else longest + 1
    draft = torch.where(drafting > 0, d0 + d1 * rounds + d2 * drafting * rounds, torch.zeros((), dtype=f64))
    step = draft + verify if mode == COUPLED else torch.maximum(draft, verify)  # [C]
    total = cand * step  # [C]
    best = int(total.argmin())
    return DrainPlan(mode, tuple(int(k) for k in w[best].tolist()), float(cand[best]), float(total[best]))


def drain(times: StepTimes, remaining: list[int], acceptance: list[float], w_max: int) -> DrainPlan:
    """The drain plan (module docstring) of rows with `remaining[r]` tokens to go at most and acceptance
    `acceptance[r]`: the mode and per-row windows with the least predicted makespan (ties: coupled, which wastes
    nothing; all windows 0 is plain decoding)."""
    if not remaining:
        return DrainPlan(COUPLED, (), 0.0, 0.0)
    cpl = _drain_mode(times, remaining, acceptance, w_max, COUPLED)
    dec = _drain_mode(times, remaining, acceptance, w_max, DECOUPLED)
    return dec if dec.seconds < cpl.seconds and any(dec.windows) else cpl


def replan_due(step: int, every: int, draining: bool, drain_plan: bool, drafting: bool, unplanned: bool) -> bool:
    """Whether a planned decoupled step (no fixed window) plans again at decode step `step` (the engine's and the
    simulator's rule): every `every` steps (0: never after the first plan); and, with `every` > 0, at once when
    the call starts `draining` or a row has no plan while draining (`unplanned`: prefilled in the step draining
    began), and at every step of a drain plan that is `drafting`: each verification refines the per-row
    acceptance the makespan turns on."""
    if not every:
        return False
    return step % every == 0 or (draining and (not drain_plan or drafting or unplanned))


def drain_rows(times: StepTimes, rows: dict, w_max: int) -> tuple[Plan, dict]:
    """`drain` for `rows[key] = (remaining, acceptance)`: the batch plan (its mode, the largest window, the
    predicted tokens per second of the rest of the call, at most) and {key: Plan} per row."""
    keys = list(rows)
    d = drain(times, [rows[k][0] for k in keys], [rows[k][1] for k in keys], w_max)
    tgs = sum(rows[k][0] for k in keys) / d.seconds if d.seconds > 0 else 0.0
    return Plan(d.mode, max(d.windows, default=0), tgs), {k: Plan(d.mode, w, tgs) for k, w in zip(keys, d.windows)}
