"""The shape of the cached keys and values per attention layer (`KVLayout`), read by the KV pool, memory planning
and the model's support probe."""

from __future__ import annotations

from dataclasses import dataclass


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
        itself takes the layout the support probe measured on the model (`engine/model/support.py`)."""
        return cls.uniform(*kv_geometry(model_config))


def kv_geometry(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a standard Hugging Face causal-LM config."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, num_kv_heads, head_dim
