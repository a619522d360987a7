"""Interfaces of the scheduling plug-ins.

A `SchedulePolicy` decides *which* pending sample takes a free slot (and which running one is preempted); an
`AdmissionPolicy` decides *how many* samples may run at once. Both are pure Python over `Sequence` objects, so the
engine and the trace simulator (`trl_infinite.sim`) run exactly the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..sequence import Group, Sequence

if TYPE_CHECKING:
    from .predictors import LengthPredictor


@dataclass(frozen=True)
class PolicyOptions:
    """Everything a scheduling plug-in built by name may take (`EngineConfig`'s fields of the same names; see
    `factory.policy_options`). Each plug-in's `from_options` passes its own to its typed constructor."""

    predictor: LengthPredictor | None = None  # the engine's length predictor (learns across calls)
    num_slots: int | None = None  # g, for plans (FPTAS bins)
    fptas_epsilon: float = 0.1
    memory_eps: float = 0.05  # "memory": eps_m of the safety buffer
    memory_min_observations: int = 4  # "memory": finished samples before the length statistics are used
    sla_decode_ms: float | None = None  # "sla": target decode step latency
    sla_tolerance_ms: float | None = None  # "sla": +- band around the target (None: 5% of it)
    sla_min_batch: int = 1
    sla_max_batch: int | None = None  # None: 256
    sla_alpha: int = 2  # "sla": search window width
    sla_delta: int = 1  # "sla": widening step
    sla_window: int = 4  # "sla": decode steps per adjustment


@dataclass
class SchedulerView:
    """What a policy may look at when it decides (read-only by convention)."""

    running: list[Sequence]
    waiting: list[Sequence]
    free_blocks: int
    num_blocks: int
    block_size: int
    step: int


class SchedulePolicy:
    """Orders the waiting queue. Subclasses override `priority` (lower runs first) or `ordered` as a whole."""

    name = "base"

    @classmethod
    def from_options(cls, options: PolicyOptions) -> SchedulePolicy:
        """Build by registry name (subclasses that take options override this)."""
        return cls()

    def on_submit(self, groups: list[Group], sequences: list[Sequence]) -> None:
        """Called once per `generate` with everything that will run (plans such as FPTAS are made here)."""

    def on_step(self, view: SchedulerView) -> None:
        """Called after every step with the state after the step's tokens were appended."""

    def on_finish(self, seq: Sequence) -> None:
        """Called when a sample finishes (its true length is now known)."""

    def priority(self, seq: Sequence) -> tuple:
        raise NotImplementedError

    def ordered(self, view: SchedulerView) -> list[Sequence]:
        """The waiting samples in the order they should be admitted."""
        return sorted(view.waiting, key=self.priority)

    @property
    def chunks(self) -> bool:
        """Whether this policy overrides `chunk_limit` (the scheduler skips the per-sample check otherwise)."""
        return type(self).chunk_limit is not SchedulePolicy.chunk_limit

    def chunk_limit(self, seq: Sequence) -> int | None:
        """Output length at which a running sample goes back to the queue with its KV kept (None = runs to the
        end). Length predictors that need the first k tokens use it to probe; `chunk_tokens` adds its own limit."""
        return None

    def strict(self) -> bool:
        """When True, admission stops at the first sample that does not fit (no overtaking)."""
        return True

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sample to preempt when memory runs out: by default the most recently admitted."""
        return max(candidates, key=lambda s: s.admit_order)


class AdmissionPolicy:
    """Bounds the number of running samples beyond the slot limit of the sampling mode."""

    name = "base"

    @classmethod
    def from_options(cls, options: PolicyOptions) -> AdmissionPolicy:
        """Build by registry name (subclasses that take options override this)."""
        return cls()

    def max_running(self, view: SchedulerView) -> int | None:
        """Most samples that may run after this step's admissions (None = no bound beyond memory)."""
        return None

    def fits(self, seq: Sequence, blocks_needed: int, view: SchedulerView) -> bool:
        """Whether admitting `seq` (which needs `blocks_needed` blocks now) is allowed. Never asked while nothing
        runs: the first sample is always admitted when it fits the free blocks, so a policy cannot stall progress."""
        return blocks_needed <= view.free_blocks

    def on_step_time(self, num_running: int, seconds: float) -> None:
        """Measured wall time of one decode step with `num_running` samples (SLA policies use it)."""

    def on_finish(self, seq: Sequence) -> None:
        """A sample finished (memory policies learn length statistics from it)."""
