"""The rollout engine (never imports `trl`)."""

from .batch import NonFiniteLogitsError
from .config import EngineConfig, SamplingParams
from .engine import RolloutEngine
from .exactness import NonFiniteModelError
from .kv_pool import KVCachePool
from .outputs import RolloutResult, RolloutStats
from .support import UnsupportedModelError

__all__ = ["EngineConfig", "KVCachePool", "NonFiniteLogitsError", "NonFiniteModelError", "RolloutEngine",
           "RolloutResult", "RolloutStats", "SamplingParams", "UnsupportedModelError"]
