"""Scheduling plug-ins: ordering policies (`EngineConfig.scheduler`) and admission policies
(`EngineConfig.batch_policy`), looked up by name in `engine.registry`."""

from trl_infinite.engine.config.registry import BATCH_POLICIES, SCHEDULERS, register_batch_policy, register_scheduler
from trl_infinite.engine.sched.policies.base import AdmissionPolicy, SchedulePolicy, SchedulerView

__all__ = ["AdmissionPolicy", "BATCH_POLICIES", "SCHEDULERS", "SchedulePolicy", "SchedulerView",
           "register_batch_policy", "register_scheduler"]
