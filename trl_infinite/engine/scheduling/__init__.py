"""Scheduling plug-ins: ordering policies (`EngineConfig.scheduler`) and admission policies
(`EngineConfig.batch_policy`), looked up by name."""

from .base import AdmissionPolicy, SchedulePolicy, SchedulerView
from .registry import BATCH_POLICIES, SCHEDULERS, register_batch_policy, register_scheduler

__all__ = [
    "AdmissionPolicy",
    "BATCH_POLICIES",
    "SCHEDULERS",
    "SchedulePolicy",
    "SchedulerView",
    "register_batch_policy",
    "register_scheduler",
]
