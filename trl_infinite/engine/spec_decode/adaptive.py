"""Adaptive speculation: per-sample draft length from recent acceptance, batch switch from an online cost model.

Acceptance: each sample keeps decayed counts of accepted (`a`) and rejected (`b`) draft tokens, starting from a
Beta(1, 1) prior that decays too; `alpha = a / (a + b)` estimates the per-token acceptance probability. With k
drafts a verification emits `1 + E_k` tokens in expectation, `E_k = sum_{i=1..k} alpha^i` (i.i.d. approximation).

Cost (SpecActor's affine model): the time of a decode/verify forward with `b` samples and `D` draft tokens is
`t(b, D) = c0 + c1 b + c2 D`, fitted online by decayed ridge least squares on the measured steps. The marginal cost
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


class CostModel:
    """Online ridge fit of `t(b, D) = c0 + c1 b + c2 D` (seconds) with exponential forgetting.

    `c2` is only identifiable from a mix of plain (D = 0) and drafting steps at similar batch sizes, so the model
    asks for a plain step (`wants_plain`) for its first `min_plain` observations and then once every
    `explore_every` drafting steps; a plain step costs no extra forward pass, only the drafts it skips."""

    def __init__(
        self, decay: float = 0.98, ridge: float = 1e-3, min_plain: int = 2, explore_every: int = 32,
        min_gamma: float = 0.05,
    ):
        self.decay, self.ridge, self.min_gamma = decay, ridge, min_gamma
        self.min_plain, self.explore_every = min_plain, explore_every
        self.xtx = torch.zeros(3, 3, dtype=torch.float64)
        self.xty = torch.zeros(3, dtype=torch.float64)
        self.n = 0
        self.plain_obs = self.draft_obs = 0
        self.since_plain = 0
        self.coef: torch.Tensor | None = None

    def wants_plain(self) -> bool:
        return self.plain_obs < self.min_plain or self.since_plain >= self.explore_every

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        if drafts == 0:
            self.plain_obs += 1
            self.since_plain = 0
        else:
            self.draft_obs += 1
            self.since_plain += 1
        x = torch.tensor([1.0, batch, drafts], dtype=torch.float64)
        self.xtx = self.decay * self.xtx + torch.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.n += 1
        scale = float(self.xtx.diagonal().mean())
        coef = torch.linalg.solve(self.xtx + self.ridge * scale * torch.eye(3, dtype=torch.float64), self.xty)
        self.coef = coef.clamp_min(0.0)

    @property
    def ready(self) -> bool:
        return self.coef is not None and self.plain_obs > 0 and self.draft_obs > 0

    def time(self, batch: int, drafts: int) -> float:
        c0, c1, c2 = self.coef.tolist()
        return max(c0 + c1 * batch + c2 * drafts, 1e-9)

    def gamma(self, batch: int, default: float = 0.1) -> float:
        """Cost of one draft token relative to one sample's share of a plain decode step."""
        if not self.ready:
            return default
        return max(self.coef[2].item() * batch / self.time(batch, 0), self.min_gamma)


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
