"""Adaptive speculation: per-sample draft length from recent acceptance, batch switch from an online cost model.

Acceptance: each sample keeps decayed counts of accepted (`a`) and rejected (`b`) draft tokens, starting from a
Beta(1, 1) prior that decays too; `alpha = a / (a + b)` estimates the per-token acceptance probability. With k
drafts a verification emits `1 + E_k` tokens in expectation, `E_k = sum_{i=1..k} alpha^i` (i.i.d. approximation).

Cost (SpecActor's affine model, plus the fixed cost of a verification): the time of a decode/verify forward with `b`
samples and `D` draft tokens is `t(b, D) = c0 + c1 b + c2 D + c3 [D > 0]`, fitted online by decayed ridge least
squares on the measured steps. `c3` is what a step pays for verifying at all: a step without drafts is the plain
static decode step (on CUDA a captured graph, on CPU the prebuilt cascade), a step with drafts an eager
multi-token forward that also makes the next plain step rebuild its rows (`benchmarks/spec_costs.py`, SmolLM2-135M,
CPU, 8 rows: c3 = 20 ms against c2 = 2 ms per draft token, on plain steps of 138 ms). The marginal cost
of one draft token relative to one sample's share of a plain step is `gamma(b) = c2 b / t(b, 0)`, floored at
`min_gamma` (drafting and bookkeeping are not free either).
Each sample takes `k* = argmax_k (1 + E_k) / (1 + gamma k)` (k = 0 when `alpha <= gamma`), and the step speculates
only if the batch's expected tokens per second beat plain decoding:
`sum_i (1 + E_{k_i}) / t(b, sum_i k_i) > b / t(b, 0)`. Large batches make `c2` dominate, so speculation turns off
there and comes back in the tail, where `c0` dominates.
"""

from __future__ import annotations

import torch


class AcceptanceTracker:
    """Decayed Beta counts of draft acceptance per key (sample id, or (sample id, drafter))."""

    def __init__(self, decay: float = 0.7, prior: tuple[float, float] = (1.0, 1.0)):
        self.decay, self.prior = decay, prior
        self.counts: dict = {}

    def alpha(self, key) -> float:
        a, b = self.counts.get(key, self.prior)
        return a / (a + b)

    def observe(self, key, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        a, b = self.counts.get(key, self.prior)
        self.counts[key] = (self.decay * a + accepted, self.decay * b + (1 if accepted < drafted else 0))

    def forget(self, key) -> None:
        self.counts.pop(key, None)


def sample_acceptance(accepted: int, rejecting: int) -> float:
    """One sample's per-token acceptance estimate from its call's counts: accepted drafts over accepted drafts +
    verifications that rejected one, with a Beta(1, 1) prior (a sample never verified: 0.5)."""
    return (accepted + 1) / (accepted + rejecting + 2)


def expected_accepted(alpha: float, k: int) -> float:
    """E_k = sum_{i=1..k} alpha^i."""
    return sum(alpha**i for i in range(1, k + 1))


def best_length(alpha: float, gamma: float, k_max: int) -> int:
    """argmax_k (1 + E_k) / (1 + gamma k) over 0..k_max."""
    best_k, best = 0, 1.0
    gain = 1.0
    for k in range(1, k_max + 1):
        gain += alpha**k
        value = gain / (1.0 + gamma * k)
        if value > best:
            best_k, best = k, value
    return best_k


class AffineFit:
    """Online ridge least squares of `seconds = coef . x` with exponential forgetting (x: the features), the
    coefficients clamped at 0. The ridge is relative to each feature's own scale (`ridge * diag(X^T X)`), so a
    feature of small values (the intercept, an indicator) is not shrunk toward 0 because another one (the number
    of drafts) has large values."""

    def __init__(self, n: int, decay: float = 0.98, ridge: float = 1e-3):
        self.decay, self.ridge = decay, ridge
        self.xtx = torch.zeros(n, n, dtype=torch.float64)
        self.xty = torch.zeros(n, dtype=torch.float64)
        self.n_obs = 0
        self.coef: tuple[float, ...] | None = None

    def observe(self, x, seconds: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        self.xtx = self.decay * self.xtx + torch.outer(v, v)
        self.xty = self.decay * self.xty + v * seconds
        self.n_obs += 1
        diag = self.xtx.diagonal()
        reg = self.ridge * (diag + 1e-6 * diag.mean())  # a feature never seen (all 0) keeps the system solvable
        self.coef = tuple(torch.linalg.solve(self.xtx + torch.diag(reg), self.xty).clamp_min(0.0).tolist())


class CostModel:
    """Online ridge fit (`AffineFit`) of `t(b, D) = c0 + c1 b + c2 D + c3 [D > 0]` (seconds).

    `c2` and `c3` are only identifiable from a mix of plain (D = 0) and drafting steps at similar batch sizes, so
    the model asks for a plain step (`wants_plain`) for its first `min_plain` observations and then once every
    `explore_every` drafting steps; a plain step costs no extra forward pass, only the drafts it skips."""

    def __init__(
        self, decay: float = 0.98, ridge: float = 1e-3, min_plain: int = 2, explore_every: int = 32,
        min_gamma: float = 0.05,
    ):
        self.fit = AffineFit(4, decay, ridge)
        self.min_gamma = min_gamma
        self.min_plain, self.explore_every = min_plain, explore_every
        self.plain_obs = self.draft_obs = 0
        self.since_plain = 0

    @property
    def coef(self) -> tuple[float, float, float, float] | None:
        """(c0, c1, c2, c3), None before the first observation."""
        return self.fit.coef

    def wants_plain(self) -> bool:
        return self.plain_obs < self.min_plain or self.since_plain >= self.explore_every

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        if drafts == 0:
            self.plain_obs += 1
            self.since_plain = 0
        else:
            self.draft_obs += 1
            self.since_plain += 1
        self.fit.observe(features(batch, drafts), seconds)

    @property
    def ready(self) -> bool:
        return self.coef is not None and self.plain_obs > 0 and self.draft_obs > 0

    def time(self, batch: int, drafts: int) -> float:
        return max(sum(c * x for c, x in zip(self.coef, features(batch, drafts), strict=True)), 1e-9)

    def gamma(self, batch: int, default: float = 0.1) -> float:
        """Cost of one draft token relative to one sample's share of a plain decode step."""
        if not self.ready:
            return default
        return max(self.coef[2] * batch / self.time(batch, 0), self.min_gamma)


def features(batch: float, drafts: float) -> tuple[float, float, float, float]:
    """The cost model's regressors of a forward with `batch` rows and `drafts` draft tokens: (1, b, D, [D > 0])."""
    return 1.0, float(batch), float(drafts), 1.0 if drafts > 0 else 0.0


def plan_lengths(alphas: list[float], caps: list[int], cost: CostModel, adaptive: bool) -> list[int]:
    """Draft length per sample for one step (all zero when speculation does not pay at this batch size)."""
    if not adaptive:
        return list(caps)
    if cost.wants_plain():
        return [0] * len(alphas)
    b = len(alphas)
    gamma = cost.gamma(b)
    ks = [best_length(a, gamma, c) for a, c in zip(alphas, caps)]
    total = sum(ks)
    if total == 0 or not cost.ready:
        return ks
    expected = sum(1.0 + expected_accepted(a, k) for a, k in zip(alphas, ks))
    if expected / cost.time(b, total) <= b / cost.time(b, 0):
        return [0] * b
    return ks
