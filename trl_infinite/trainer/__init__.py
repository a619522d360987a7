"""TRL integration: `InfiniteGRPOConfig` and `InfiniteGRPOTrainer` (importing this pulls in `trl`).

Importing checks that the installed TRL's `GRPOTrainer` hooks have the signatures this package overrides
(`compat.SUPPORTED_TRL`), and raises `ImportError` naming the supported range otherwise.
"""

from trl_infinite.trainer.compat import SUPPORTED_TRL, check_trl_hooks

check_trl_hooks()

from trl_infinite.trainer.config import InfiniteGRPOConfig, engine_config_from_args  # noqa: E402
from trl_infinite.trainer.trainer import InfiniteGRPOTrainer  # noqa: E402

__all__ = ["SUPPORTED_TRL", "InfiniteGRPOConfig", "InfiniteGRPOTrainer", "engine_config_from_args"]
