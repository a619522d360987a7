"""Every plug-in registry of the engine, by the `EngineConfig` field that names the plug-in, and the `Registry`
they are made of.

A leaf module: it imports no plug-in. Built-in plug-ins are *lazy*: each registry lists its built-in names with the
module that defines them and imports that module the first time one of its names is built (mini-sglang's style), so
`EngineConfig` validates names here without importing schedulers, drafters or kernels, and no plug-in module imports
the code that uses it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Plug-ins keyed by the name a user writes in a config field (`field`).

    `lazy` maps each built-in name to the module (absolute dotted path) whose import registers it.
    `@REG.register("name")` adds a class or function (and sets `cls.name` on classes); a name already taken raises
    `ValueError` unless `replace=True`. `REG.get_or_raise(name)` imports a lazy name's module and returns the
    plug-in, or raises a `ValueError` that names the config field and the choices; `REG.build(name, ...)` builds it.
    """

    def __init__(self, field: str, lazy: dict[str, str] | None = None):
        self.field = field
        self._lazy: dict[str, str] = dict(lazy or {})
        self._loaded: dict[str, T] = {}

    def register(self, name: str, replace: bool = False) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            module = self._lazy.get(name)
            if module is not None and name not in self._loaded:
                # a built-in name: load the built-in first (a no-op while that module is the one registering it)
                importlib.import_module(module)
            if name in self._loaded and not replace:
                raise ValueError(f"`{self.field}` {name!r} is already registered "
                                 f"({self._loaded[name]!r}); pass `replace=True` to replace it.")
            if isinstance(obj, type):
                obj.name = name
            self._loaded[name] = obj
            return obj

        return wrap

    def build(self, name: str, *args, **kwargs):
        """The one way to build a plug-in: the registered class called with its registry's arguments (listed where
        the registry is defined). Unknown arguments are refused by the class's own signature (`TypeError`)."""
        return self.get_or_raise(name)(*args, **kwargs)

    def get_or_raise(self, name: str) -> T:
        if name not in self:
            raise ValueError(f"`{self.field}` must be one of {self.names()}, got {name!r}.")
        if name not in self._loaded:
            importlib.import_module(self._lazy[name])
        return self._loaded[name]

    def names(self) -> list[str]:
        """The built-in names in the order they are listed, then the registered ones in registration order."""
        return list(dict.fromkeys([*self._lazy, *self._loaded]))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._loaded or name in self._lazy)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


_ENGINE = "trl_infinite.engine"
_POLICIES = f"{_ENGINE}.sched.policies"
_PREDICTORS = f"{_ENGINE}.sched.predictors"
_SPEC = f"{_ENGINE}.spec_decode"

# Each registry: the `EngineConfig` flag that names its plug-in, and how `build` calls the class.

# `SamplingMode` classes, `cls(config: SchedulingConfig)`: how samples share the decode batch
SAMPLING_MODES: Registry[type] = Registry("sampling_mode", {
    name: f"{_ENGINE}.sched.slot_modes" for name in ("full_group", "micro_group", "fixed_slot", "dynamic_slot")
})
# `SchedulePolicy` classes, `cls(config: SchedulingConfig, predictor: LengthPredictor, slot_limit: int | None)`:
# which pending sample takes a free slot
SCHEDULERS: Registry[type] = Registry("scheduler", {"fifo": f"{_POLICIES}.ordering", **{
    name: f"{_POLICIES}.length_aware" for name in ("sjf", "lfs", "fptas", "infinite", "seer", "lrf", "lfs_max")}})
# `AdmissionPolicy` classes, `cls(config: SchedulingConfig)`: how many samples run at once
BATCH_POLICIES: Registry[type] = Registry("batch_policy",
                                          {name: f"{_POLICIES}.admission" for name in ("static", "memory", "sla")})
# `LengthPredictor` classes, `cls(config: SchedulingConfig, history: PromptHistory | None)`: the length-aware
# schedulers' predictor (one per engine: it learns across calls)
PREDICTORS: Registry[type] = Registry("length_predictor", {
    **{name: f"{_PREDICTORS}.base" for name in ("none", "oracle", "group", "prefix")},
    "history": f"{_PREDICTORS}.history"})
# `Drafter` classes, `cls(config: SpeculativeConfig, context: DraftContext)` (one per `generate` call)
DRAFTERS: Registry[type] = Registry("speculative_method", {
    name: f"{_SPEC}.{name}" for name in ("suffix", "ngram", "draft_model", "best_of_n")})
# `attention.backends.AttentionBackend` values (a pair of stateless functions, no options: looked up, not built)
ATTENTION_BACKENDS: Registry = Registry("attention_backend", {
    "torch": f"{_ENGINE}.attention.backends", "triton": f"{_ENGINE}.attention.triton_backend"})

register_sampling_mode = SAMPLING_MODES.register
register_scheduler = SCHEDULERS.register
register_batch_policy = BATCH_POLICIES.register
register_predictor = PREDICTORS.register
register_drafter = DRAFTERS.register
