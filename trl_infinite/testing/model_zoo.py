"""Named model configurations with random weights: real architectures and sizes, no Hub access.

Benchmarks of the engine's memory and speed depend on the architecture (layers, KV heads, head dim, vocabulary),
not on the weights, so a random model built from the published config stands in for the real one. Pair it with a
length trace (`generate(forced_lengths=...)`) so completions have realistic lengths.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)


# name -> config factory (values from the models' published config.json files)
MODEL_CONFIGS = {
    "tiny": lambda: LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                tie_word_embeddings=False),
    "smollm2-135m": lambda: LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                        tie_word_embeddings=True),
    "qwen2.5-0.5b": lambda: Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True),
    "qwen3-0.6b": lambda: _qwen3(1024, 3072, 28, 16, tie=True),
    "qwen3-1.7b": lambda: _qwen3(2048, 6144, 28, 16, tie=True),
    "qwen3-8b": lambda: _qwen3(4096, 12288, 36, 32, tie=False),
    # Qwen3-1.7B's depth (28 layers) with none of its width: a decode step's time is almost all host work (Python,
    # dispatch, per-layer bookkeeping), so it measures what CUDA graphs / compilation remove
    "qwen3-28l-h64": lambda: Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=4096, tie_word_embeddings=False),
    "llama-3.2-1b": lambda: LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE,
                                        rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def model_config(name: str) -> PretrainedConfig:
    """The transformers config registered under `name` (see `MODEL_CONFIGS`)."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"`config` must be one of {sorted(MODEL_CONFIGS)}, got {name!r}.")
    return MODEL_CONFIGS[name]()


def random_model(name: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0) -> torch.nn.Module:
    """A causal LM of the named architecture with random weights (the model's own init), built directly on
    `device` in `dtype` (no full-precision copy on the host), in eval mode."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config = model_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
