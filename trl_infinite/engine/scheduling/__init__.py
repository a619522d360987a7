"""Scheduling plug-ins: ordering policies (`EngineConfig.scheduler`) and admission policies
(`EngineConfig.batch_policy`), looked up by name in `engine.registry`."""

from ..registry import BATCH_POLICIES, SCHEDULERS, register_batch_policy, register_scheduler
from .base import AdmissionPolicy, SchedulePolicy, SchedulerView

__all__ = [
    "AdmissionPolicy",
    "BATCH_POLICIES",
    "SCHEDULERS",
    "SchedulePolicy",
    "SchedulerView",
    "register_batch_policy",
    "register_scheduler",
]
