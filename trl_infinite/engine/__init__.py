"""The rollout engine (never imports `trl`)."""

from .config import EngineConfig, SamplingParams
from .engine import RolloutEngine
from .kv_pool import KVCachePool
from .outputs import RolloutResult, RolloutStats
from .support import UnsupportedModelError

__all__ = ["EngineConfig", "KVCachePool", "RolloutEngine", "RolloutResult", "RolloutStats", "SamplingParams",
           "UnsupportedModelError"]
