"""Predictor-free orders for divided rollout (`chunk_tokens`): by the tokens a sample already generated."""

from __future__ import annotations

from ..sequence import Sequence
from .base import SchedulePolicy
from .registry import register_scheduler


@register_scheduler("lef")
class LEFPolicy(SchedulePolicy):
    """Longest elapsed first: a returning chunk with the most generated tokens first (a sample that already ran
    long is likely a long one), fresh samples in submission order last."""

    def priority(self, seq: Sequence) -> tuple:
        return (-seq.num_generated, seq.group_id, seq.sample_idx)


@register_scheduler("las")
class LASPolicy(SchedulePolicy):
    """Least attained service first (round robin over chunks): fresh samples first, then the least advanced."""

    def priority(self, seq: Sequence) -> tuple:
        return (seq.num_generated, seq.group_id, seq.sample_idx)
