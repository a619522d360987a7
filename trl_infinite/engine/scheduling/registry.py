"""Name -> class registries for scheduling policies and admission (batch-size) policies."""

from __future__ import annotations

from ...utils.registry import Registry

SCHEDULERS: Registry[type] = Registry("scheduler")
BATCH_POLICIES: Registry[type] = Registry("batch_policy")

# Class decorators: make a `SchedulePolicy` / `AdmissionPolicy` selectable as `EngineConfig.scheduler=name` /
# `EngineConfig.batch_policy=name`.
register_scheduler = SCHEDULERS.register
register_batch_policy = BATCH_POLICIES.register


def _load_builtins() -> None:
    from . import admission, history_predictor, length_aware, policies  # noqa: F401  (registration side effect)


_load_builtins()
