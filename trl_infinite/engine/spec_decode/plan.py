"""SpecActor's decoupled-speculation plan (§4.1): the TGS model, the window search (Alg. 1) and the per-request
reconfiguration (Alg. 2), for the execution `decoupled.py` runs.

Step times (seconds), affine as in the paper, fitted online (`AffineFit`):

    V(b, D) = v0 + v1 b + v2 D            verification forward, b rows, D draft tokens in all
    Dr(b, w) = d0 + d1 w + d2 b w         drafting w tokens for each of b rows (w rounds)

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COUPLED, DECOUPLED = "coupled", "decoupled"


class AffineFit:
    """Online ridge least squares of `seconds = coef . x` with exponential forgetting (x: the features)."""

    def __init__(self, n: int, decay: float = 0.98, ridge: float = 1e-3):
        self.decay, self.ridge = decay, ridge
        self.xtx = torch.zeros(n, n, dtype=torch.float64)
        self.xty = torch.zeros(n, dtype=torch.float64)
        self.n_obs = 0
        self.coef: tuple[float, ...] | None = None

    def observe(self, x: list[float], seconds: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        self.xtx = self.decay * self.xtx + torch.outer(v, v)
        self.xty = self.decay * self.xty + v * seconds
        self.n_obs += 1
        scale = float(self.xtx.diagonal().mean())
        eye = torch.eye(len(x), dtype=torch.float64)
        self.coef = tuple(torch.linalg.solve(self.xtx + self.ridge * scale * eye, self.xty).clamp_min(0.0).tolist())


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
    """The two affine step-time models (module docstring): `verify` = (v0, v1, v2), `draft` = (d0, d1, d2)."""

    verify: tuple[float, float, float]
    draft: tuple[float, float, float]

    def verify_time(self, b: float, drafts: float) -> float:
        v0, v1, v2 = self.verify
        return max(v0 + v1 * b + v2 * drafts, 1e-9)

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
    out = {}
    for key, p in acceptance.items():
        if p >= mean:
            out[key] = base
            continue
        dec, cpl = best_decoupled(times, p, batch, w_max), best_coupled(times, p, batch, w_max)
        out[key] = dec if dec.tgs > cpl.tgs else cpl
    return out
