"""Interfaces of the scheduling plug-ins.

A `SchedulePolicy` decides *which* pending sample takes a free slot (and which running one is preempted); an
`AdmissionPolicy` decides *how many* samples may run at once. Both are pure Python over `Sequence` objects, so the
engine and the trace simulator (`trl_infinite.sim`) run exactly the same code. Both are built by name for each call
(`call.RolloutCall.build`): `SCHEDULERS.build(name, config, predictor, slot_limit)`,
`BATCH_POLICIES.build(name, config)`, with `config` the `SchedulingConfig`; each reads its own section of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trl_infinite.engine.sched.sequence import Group, Sequence

if TYPE_CHECKING:
    from trl_infinite.engine.config.engine_config import SchedulingConfig
    from trl_infinite.engine.sched.predictors.base import LengthPredictor


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

    def __init__(self, config: SchedulingConfig, predictor: LengthPredictor, slot_limit: int | None) -> None:
        """`predictor`: the engine's length predictor (it learns across calls); `slot_limit`: the sampling mode's
        slots (None: no slot bound)."""

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

    def __init__(self, config: SchedulingConfig) -> None:
        pass

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
