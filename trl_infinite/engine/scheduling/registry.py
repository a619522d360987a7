"""Name -> class registries for scheduling policies and admission (batch-size) policies."""

from __future__ import annotations

from collections.abc import Callable

SCHEDULERS: dict[str, type] = {}
BATCH_POLICIES: dict[str, type] = {}


def register_scheduler(name: str) -> Callable[[type], type]:
    """Class decorator: make a `SchedulePolicy` selectable as `EngineConfig.scheduler=name`."""

    def wrap(cls: type) -> type:
        cls.name = name
        SCHEDULERS[name] = cls
        return cls

    return wrap


def register_batch_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make an `AdmissionPolicy` selectable as `EngineConfig.batch_policy=name`."""

    def wrap(cls: type) -> type:
        cls.name = name
        BATCH_POLICIES[name] = cls
        return cls

    return wrap


def _load_builtins() -> None:
    from . import admission, length_aware, policies  # noqa: F401  (registration side effect)


_load_builtins()
