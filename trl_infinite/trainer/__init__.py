"""TRL integration: `InfiniteGRPOConfig` and `InfiniteGRPOTrainer` (importing this pulls in `trl`)."""

from .config import InfiniteGRPOConfig, engine_config_from_args
from .streaming import RewardFunctionError
from .trainer import InfiniteGRPOTrainer

__all__ = ["InfiniteGRPOConfig", "InfiniteGRPOTrainer", "RewardFunctionError", "engine_config_from_args"]
