"""Sampling modes (`EngineConfig.sampling_mode`): how the samples of a call share the decode batch.

A `SamplingMode` is built for each `generate` call with the scheduler's other plug-ins (`call.py`) and answers the
scheduler's three questions: the slot limit, whether it may admit while samples run, and how many free blocks to
keep per running sample. Pure Python, shared by the engine and the simulator.

- `full_group`: every sample of the call at once (one round; memory permitting).
- `micro_group`: rounds of g = `max_active_sequences` samples; a round starts when the previous one has finished.
- `fixed_slot`: g continuous slots; a finished sample's slot is refilled at once (continuous micro-group sampling).
- `dynamic_slot`: as many samples as memory allows, refilled continuously, one block per running sample kept free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from trl_infinite.engine.config.registry import register_sampling_mode

if TYPE_CHECKING:
    from trl_infinite.engine.config.engine_config import SchedulingConfig


class SamplingMode:
    """`uses_slots`: bounded by g = `max_active_sequences`; `rounds`: admits only while nothing runs."""

    name = "base"
    uses_slots: ClassVar[bool] = True
    rounds: ClassVar[bool] = False

    def __init__(self, config: SchedulingConfig):
        self.slot_limit: int | None = config.max_active_sequences if self.uses_slots else None

    def admits(self, num_running: int) -> bool:
        """Whether samples may be admitted while `num_running` run."""
        return not (self.rounds and num_running)

    def headroom(self, num_running: int) -> int:
        """Free blocks an admission must leave (beyond its own) while `num_running` samples run."""
        return 0

    def live_samples(self, num_samples: int, parks: bool) -> int:
        """Most samples holding completion blocks at once (sizing a call's KV pool); with divided rollout (`parks`)
        parked samples keep theirs, so every sample may."""
        return num_samples if self.slot_limit is None or parks else min(num_samples, self.slot_limit)


@register_sampling_mode("full_group")
class FullGroup(SamplingMode):
    uses_slots = False
    rounds = True


@register_sampling_mode("micro_group")
class MicroGroup(SamplingMode):
    rounds = True


@register_sampling_mode("fixed_slot")
class FixedSlot(SamplingMode):
    pass


@register_sampling_mode("dynamic_slot")
class DynamicSlot(SamplingMode):
    uses_slots = False

    def headroom(self, num_running: int) -> int:
        return num_running  # every running sample may need one more block
