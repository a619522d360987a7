"""Built-in ordering policies."""

from __future__ import annotations

from ..registry import register_scheduler
from ..sequence import Sequence
from .base import SchedulePolicy


@register_scheduler("fifo")
class FIFOPolicy(SchedulePolicy):
    """Submission order (prompt-major), preempted samples first so they resume before new ones start."""

    def priority(self, seq: Sequence) -> tuple:
        return (seq.num_preemptions == 0, seq.group_id, seq.sample_idx)
