"""The paged KV pool: K and V tensors for every attention layer, allocated once from the configured budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import BlockAllocator
from .config import EngineConfig

GB = 1e9


@dataclass(frozen=True)
class KVLayout:
    """Shape of the cached keys and values, per attention layer (pool layer i):
    `num_kv_heads[i]` heads, keys `k_dims[i]` wide, values `v_dims[i]` wide (they differ under MLA)."""

    num_kv_heads: tuple[int, ...]
    k_dims: tuple[int, ...]
    v_dims: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.num_kv_heads) == len(self.k_dims) == len(self.v_dims)) or not self.num_kv_heads:
            raise ValueError("KVLayout needs one KV-head count, key width and value width per layer (at least one).")

    @property
    def num_layers(self) -> int:
        return len(self.num_kv_heads)

    def elements_per_token(self) -> int:
        """Cached K and V elements of one token, all layers."""
        return sum(h * (dk + dv) for h, dk, dv in zip(self.num_kv_heads, self.k_dims, self.v_dims))

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls((num_kv_heads,) * num_layers, (head_dim,) * num_layers, (head_dim,) * num_layers)

    @classmethod
    def from_config(cls, model_config) -> KVLayout:
        """Uniform layout read from a standard config (no model needed: memory planning, benchmarks). The engine
        itself takes the layout the support probe measured on the model (`engine/support.py`)."""
        return cls.uniform(*kv_geometry(model_config))


def kv_geometry(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a standard Hugging Face causal-LM config."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, num_kv_heads, head_dim


class KVCachePool:
    """`num_blocks` usable blocks of `block_size` tokens per layer, plus one null block (id `num_blocks`) that padded
    decode rows of a static batch write to and read from: `k_caches[i]` is [(num_blocks + 1) * B, Hkv_i, Dk_i] and
    `v_caches[i]` is [(num_blocks + 1) * B, Hkv_i, Dv_i]. The null block is part of the budget. `layout` is a
    `KVLayout` (or a config, read by `from_config`)."""

    def __init__(self, layout, config: EngineConfig, dtype: torch.dtype, device: torch.device, reserve_bytes: int = 0):
        """`reserve_bytes`: taken out of a `kv_cache_fraction` budget first (the captured decode step's memory)."""
        self.reserve_bytes = reserve_bytes
        self.layout = layout if isinstance(layout, KVLayout) else KVLayout.from_config(layout)
        self.num_layers = self.layout.num_layers
        self.block_size = config.block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = self._num_blocks(config) - 1
        self.null_block = self.num_blocks
        slots = (self.num_blocks + 1) * self.block_size
        lay = self.layout
        self.k_caches = [torch.zeros(slots, h, d, dtype=dtype, device=device) for h, d in zip(lay.num_kv_heads, lay.k_dims)]
        self.v_caches = [torch.zeros(slots, h, d, dtype=dtype, device=device) for h, d in zip(lay.num_kv_heads, lay.v_dims)]
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * self.layout.elements_per_token() * elem

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.kv_cache_tokens is not None:
            n, field = config.kv_cache_tokens // self.block_size, "kv_cache_tokens"
        elif config.kv_cache_gb is not None:
            n, field = int(config.kv_cache_gb * GB // self.block_bytes), "kv_cache_gb"
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n = int((free * config.kv_cache_fraction - self.reserve_bytes) // self.block_bytes)
            field = "kv_cache_fraction"
        else:
            n, field = config.default_cpu_kv_tokens // self.block_size, "default_cpu_kv_tokens"
        if n < 2:
            raise ValueError(
                f"`{field}` gives a KV pool of less than two blocks ({self.block_size} tokens, {self.block_bytes} "
                "bytes each; one is the null block of padded decode rows); raise it."
            )
        return n

    def reset(self) -> None:
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)

    def zero(self) -> None:
        """Zero every cached key and value (after a call whose values were not finite)."""
        for t in (*self.k_caches, *self.v_caches):
            t.zero_()

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        ids = torch.tensor(blocks, device=self.device)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).reshape(-1)

    def copy_out(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of the K/V of `blocks`, per layer (divided rollout's host tier)."""
        slots = self._slots(blocks)
        return [(k[slots].cpu(), v[slots].cpu()) for k, v in zip(self.k_caches, self.v_caches)]

    def copy_in(self, blocks: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write host copies from `copy_out` back into (possibly other) `blocks`."""
        slots = self._slots(blocks)
        for (k, v), (hk, hv) in zip(zip(self.k_caches, self.v_caches), saved):
            k[slots] = hk.to(self.device)
            v[slots] = hv.to(self.device)
