"""Built-in ordering policies."""

from __future__ import annotations

from trl_infinite.engine.config.registry import register_scheduler
from trl_infinite.engine.sched.policies.base import SchedulePolicy
from trl_infinite.engine.sched.sequence import Sequence


@register_scheduler("fifo")
class FIFOPolicy(SchedulePolicy):
    """Submission order (prompt-major), preempted samples first so they resume before new ones start."""

    def priority(self, seq: Sequence) -> tuple:
        return (seq.num_preemptions == 0, seq.group_id, seq.sample_idx)
