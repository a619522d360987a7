"""Built-in admission (batch size) policies."""

from __future__ import annotations

import math
from statistics import NormalDist, mean, pstdev
from typing import TYPE_CHECKING

from trl_infinite.engine.config.registry import register_batch_policy
from trl_infinite.engine.sched.block_manager import blocks_for
from trl_infinite.engine.sched.policies.base import AdmissionPolicy, SchedulerView
from trl_infinite.engine.sched.sequence import Sequence

if TYPE_CHECKING:
    from trl_infinite.engine.config.engine_config import SchedulingConfig


@register_batch_policy("static")
class StaticAdmission(AdmissionPolicy):
    """Admit while the sampling mode's slot limit and the free blocks allow (no prediction of growth)."""


@register_batch_policy("memory")
class MemoryAdmission(AdmissionPolicy):
    """Memory-aware dynamic batching (Alg. 1 of "Memory-aware and SLA-constrained dynamic batching").

    Admit a sample while the *expected* KV of every running sample plus the new one, plus the safety buffer
    theta * sigma_S (sigma_S = sqrt(b) * std of completion lengths, theta = Phi^-1(1 - eps_m)), fits the pool.
    A running sample's expected final length is max(mu, generated + 1), mu/std from the finished samples
    (`max_new_tokens` and 0 until `min_observations` finished: conservative). A wrong guess is not an error: the
    scheduler preempts when a running sample needs a block the pool no longer has. Options: `config.memory`.
    """

    def __init__(self, config: SchedulingConfig) -> None:
        self.theta = NormalDist().inv_cdf(1.0 - config.memory.eps)
        self.min_obs = config.memory.min_observations
        self.lengths: list[int] = []

    def on_finish(self, seq: Sequence) -> None:
        self.lengths.append(seq.num_generated)

    def length_stats(self, max_new_tokens: int) -> tuple[float, float]:
        """(mu, sigma) of completion lengths in tokens."""
        if len(self.lengths) < self.min_obs:
            return float(max_new_tokens), 0.0
        return mean(self.lengths), pstdev(self.lengths)

    def fits(self, seq: Sequence, blocks_needed: int, view: SchedulerView) -> bool:
        mu, sigma = self.length_stats(seq.max_new_tokens)
        bs = view.block_size

        def growth(s: Sequence, held: int) -> int:  # expected blocks still to come
            final = min(s.max_new_tokens, max(mu, s.num_generated + 1))
            return max(0, blocks_for(math.ceil(final), bs) - held)

        used = view.num_blocks - view.free_blocks + blocks_needed
        expected = used + sum(growth(s, len(s.blocks)) for s in view.running)
        expected += growth(seq, len(seq.blocks) + blocks_needed)
        buffer = self.theta * sigma * math.sqrt(len(view.running) + 1) / bs
        return expected + buffer <= view.num_blocks and blocks_needed <= view.free_blocks


@register_batch_policy("sla")
class SLAAdmission(AdmissionPolicy):
    """SLA-constrained dynamic batching (Alg. 2): binary search of the batch size on the measured decode step
    latency against `sla_decode_ms` (+- `sla_tolerance_ms`, default 5% of it), between `sla_min_batch` and the
    scheduling config's `max_batch` (`max_active_sequences`); `sla_alpha`, `sla_delta`, `sla_window` steps per
    adjustment (`config.sla`). The step times come from the executor (`Executor.step_seconds`): measured by the
    engine, from a step-time model in the simulator."""

    def __init__(self, config: SchedulingConfig) -> None:
        sla = config.sla
        if sla.decode_ms is None:
            raise ValueError("batch_policy='sla' needs `sla_decode_ms` > 0, got None.")
        self.sla = float(sla.decode_ms)
        self.tol = float(sla.tolerance_ms or 0.05 * self.sla)
        self.b_min, self.b_max = sla.min_batch, config.max_batch
        if not 1 <= self.b_min <= self.b_max:
            raise ValueError(f"`sla_min_batch` must be in [1, {self.b_max}] (the batch bound), got {self.b_min!r}.")
        self.alpha, self.delta, self.window = sla.alpha, sla.delta, sla.window
        self.low, self.high = self.b_min, self.b_max
        self.batch = self.b_max
        self.samples: list[tuple[int, float]] = []  # (batch size, step ms) since the last adjustment
        self.history: list[int] = []

    def on_step_time(self, num_running: int, seconds: float) -> None:
        self.samples.append((num_running, seconds * 1000.0))
        if len(self.samples) >= self.window:
            self._adjust()

    def _adjust(self) -> None:
        tau = mean(t for _, t in self.samples)
        b_bar = round(mean(b for b, _ in self.samples))
        self.samples = []
        if tau > self.sla + self.tol:
            self.high = max(b_bar, self.low + self.alpha)
            self.low = max(self.low - self.delta, self.b_min)
        elif tau < self.sla - self.tol:
            self.low = min(b_bar, self.high - self.alpha)
            self.high = min(self.high + self.delta, self.b_max)
        else:
            self.high = min(b_bar + self.alpha // 2, self.b_max)
            self.low = max(b_bar - self.alpha // 2, self.b_min)
        self.low, self.high = max(self.low, self.b_min), min(max(self.high, self.low), self.b_max)
        b = (self.low + self.high) // 2
        self.batch = min(max(b, self.b_min), self.b_max)
        self.history.append(self.batch)  # Alg. 2 line 15: running samples are never evicted for a smaller bound

    def max_running(self, view: SchedulerView) -> int | None:
        return self.batch
