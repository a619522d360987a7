"""trl-infinite: fast, memory-bounded GRPO rollouts for Hugging Face TRL."""

from __future__ import annotations

import importlib

__version__ = "0.1.0.dev0"

# imported on first use: the trainer pulls in `trl`, the engine torch; `trl_infinite.engine.sched` needs neither
_EXPORTS = {
    **dict.fromkeys(("EngineConfig", "KVCachePool", "RolloutEngine", "RolloutResult", "RolloutStats",
                     "SamplingParams"), "trl_infinite.engine"),
    **dict.fromkeys(("InfiniteGRPOConfig", "InfiniteGRPOTrainer"), "trl_infinite.trainer"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_infinite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["__version__", *sorted(_EXPORTS)]
