"""The paged KV pool: K and V tensors for every layer, allocated once from the configured budget."""

from __future__ import annotations

import torch

from .block_manager import BlockAllocator
from .config import EngineConfig

GB = 1e9


def kv_geometry(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a Hugging Face causal-LM config."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, num_kv_heads, head_dim


class KVCachePool:
    """`num_blocks` blocks of `block_size` tokens per layer: `k_cache`/`v_cache` are [L, num_blocks * B, Hkv, D]."""

    def __init__(self, model_config, config: EngineConfig, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(model_config)
        self.block_size = config.block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = self._num_blocks(config)
        shape = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.kv_cache_tokens is not None:
            n, field = config.kv_cache_tokens // self.block_size, "kv_cache_tokens"
        elif config.kv_cache_gb is not None:
            n, field = int(config.kv_cache_gb * GB // self.block_bytes), "kv_cache_gb"
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n, field = int(free * config.kv_cache_fraction // self.block_bytes), "kv_cache_fraction"
        else:
            n, field = config.default_cpu_kv_tokens // self.block_size, "default_cpu_kv_tokens"
        if n < 1:
            raise ValueError(
                f"`{field}` gives a KV pool of less than one block ({self.block_size} tokens, {self.block_bytes} bytes); "
                "raise it."
            )
        return n

    def reset(self) -> None:
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)
