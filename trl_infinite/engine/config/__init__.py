"""What a user gives the engine: `EngineConfig` and its sections, `SamplingParams`, the plug-in registries, and the
checks of user input. Importing it does not import torch."""

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams"]
