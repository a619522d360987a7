"""The rollout engine (never imports `trl`), in rooms by role: `config/` (what a user gives), `sched/` (what runs
when; no torch), `attention/` (the attention interface and kernels), `runner/` (one forward over the KV pool),
`decode/` (the fast decode step), `model/` (adapting a Hugging Face model), `spec_decode/`, and at the top the drive
loop (`loop`, `call`, `executor`) and `RolloutEngine` (`engine`). Names are imported on first use, so that
`trl_infinite.engine.sched` and `trl_infinite.engine.config` can be imported without torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "trl_infinite.engine.config.engine_config",
    "SamplingParams": "trl_infinite.engine.config.sampling_params",
    "KVCachePool": "trl_infinite.engine.runner.kv_pool",
    "NonFiniteLogitsError": "trl_infinite.engine.sched.batch",
    "NonFiniteModelError": "trl_infinite.engine.model.exactness",
    "RolloutEngine": "trl_infinite.engine.engine",
    "RolloutResult": "trl_infinite.engine.outputs",
    "RolloutStats": "trl_infinite.engine.outputs",
    "UnsupportedModelError": "trl_infinite.engine.model.support",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_infinite.engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
