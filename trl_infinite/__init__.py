"""trl-infinite: fast, memory-bounded GRPO rollouts for Hugging Face TRL."""

from .engine import EngineConfig, KVCachePool, RolloutEngine, RolloutResult, RolloutStats, SamplingParams

__version__ = "0.1.0.dev0"

_TRAINER_NAMES = ("InfiniteGRPOConfig", "InfiniteGRPOTrainer")


def __getattr__(name: str):
    # the trainer pulls in `trl`; the engine alone does not
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'trl_infinite' has no attribute {name!r}")


__all__ = [
    "EngineConfig",
    "InfiniteGRPOConfig",
    "InfiniteGRPOTrainer",
    "KVCachePool",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
    "SamplingParams",
    "__version__",
]
