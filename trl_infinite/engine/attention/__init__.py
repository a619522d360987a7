"""Attention over the paged KV pool for any Hugging Face causal LM.

`PAGED_ATTENTION_NAME` is registered with `transformers.AttentionInterface`; while the engine runs a forward, the
model's `config._attn_implementation` points at it and the forward kwargs carry a `PagedContext` (`paged_ctx=`).
The function writes the new keys/values into the pool at `slot_mapping`, then calls the selected backend, which
only reads the pool. A backend is a pair of functions:
- `prepare(meta, mask_keys) -> meta`, run once per forward, adds what every layer will reuse (context slots and
  masks, the cascade plan);
- `attend(query [T, H, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, Dv], meta, layer: LayerAttention)
  -> [T, H, Dv]`, per layer.
The layer's pool index and mask pattern come from `PagedContext.layers` (one `LayerSpec` per `layer_idx`, found by
the support probe); scale, soft-cap and sinks from the call's kwargs.

Llama 4's attention temperature tuning (NoPE layers: queries scaled by `log1p(floor((p + 1) / floor_scale)) *
attn_scale + 1`) takes `p` from the token's index in the forward plus the length of its own KV cache, not from
`position_ids`: in the engine's packed forward (no cache, several sequences flattened) that index is not the token's
position. While the engine runs, `paged_attention` turns the module's tuning off and this function applies the same
scale from each query's position (`meta.q_pos`) with the same ops, so the queries are bit-identical to the model's
own forward with its cache (what `generate` runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from trl_infinite.engine.attention.backends import (
    AttentionBackend,
    register_attention_backend,
    resolve_backend,
)
from trl_infinite.engine.attention.layer import LayerAttention, LayerSpec, allowed
from trl_infinite.engine.attention.metadata import (
    MaskKey,
    PagedAttentionMetadata,
    Segment,
    build_metadata,
    decode_metadata,
    with_context,
)
from trl_infinite.engine.attention.torch_backend import torch_paged_attention

PAGED_ATTENTION_NAME = "trl_infinite_paged"


@dataclass
class PagedContext:
    """Everything the attention function needs for one forward (`meta` already prepared by the backend)."""

    k_caches: list[torch.Tensor]  # per pool layer: [num_slots, Hkv, Dk]
    v_caches: list[torch.Tensor]  # per pool layer: [num_slots, Hkv, Dv]
    meta: PagedAttentionMetadata
    attend: Callable
    layers: dict[int, LayerSpec]  # module.layer_idx -> its spec


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, Dk]
    key: torch.Tensor,  # [1, Hkv, T, Dk]
    value: torch.Tensor,  # [1, Hkv, T, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    paged_ctx: PagedContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as `PAGED_ATTENTION_NAME` (the model passes `sliding_window`; the spec
    holds the same value, checked by the support probe). Returns ([1, T, H, Dv], None)."""
    if paged_ctx is None:
        raise RuntimeError(f"attention {PAGED_ATTENTION_NAME!r} called without `paged_ctx`: only the engine uses it.")
    spec = paged_ctx.layers.get(getattr(module, "layer_idx", None))
    if spec is None:
        raise RuntimeError(f"attention module {type(module).__name__} (layer_idx "
                           f"{getattr(module, 'layer_idx', None)}) was not seen when the engine checked the model.")
    meta = paged_ctx.meta
    k_cache, v_cache = paged_ctx.k_caches[spec.pool_index], paged_ctx.v_caches[spec.pool_index]
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    # The pool holds the dtype the model's attention computes in (`ModelSupport.kv_dtype`); every backend gets query,
    # keys and values in it. Under autocast that is the autocast dtype: Q and K may arrive in float32 (promoted by a
    # float32 norm weight or RoPE table) and V in bf16, and the model's own SDPA / matmul would cast all three to
    # bf16, so the same casts here give the same inputs (and keep the C++ float32 kernel and the cascade's flash
    # call, which autocast does not cast, off float32 / mixed inputs). Without autocast these are no-ops.
    if getattr(module, "paged_temperature_tuning", False):  # (the module's own scaling is off: see the docstring)
        query = temperature_scaled(module, query, meta.q_pos)
    query = query.to(k_cache.dtype)
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.index_copy_(0, meta.slot_mapping, key)
    v_cache.index_copy_(0, meta.slot_mapping, value)
    if meta.copy_slots is not None:  # the batch's `PrefillCopy` orders: after the write (the source may be new)
        src, dst = meta.copy_slots
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
    layer = LayerAttention(scale=scaling if scaling is not None else query.shape[-1] ** -0.5, softcap=softcap,
                           sliding_window=spec.sliding_window, chunk_size=spec.chunk_size, sinks=s_aux)
    out = paged_ctx.attend(query[0].transpose(0, 1), k_cache, v_cache, meta, layer)  # [T, H, Dv]
    return out.unsqueeze(0), None


AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention_forward)


def temperature_scaled(module: torch.nn.Module, query: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Llama 4's temperature tuning of `query` [1, H, T, D] at the query positions `q_pos` [T]: the expression and
    dtypes of `Llama4TextAttention.forward`, elementwise, so the result is the model's bit for bit."""
    scales = torch.log1p(torch.floor((q_pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)


def temperature_tuned(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules that scale queries by the token's index in the forward (Llama 4's temperature tuning
    on its NoPE layers), whose scaling the engine applies from positions instead (module docstring)."""
    return [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False) is True
            and not getattr(m, "use_rope", True) and isinstance(getattr(m, "floor_scale", None), (int, float))
            and isinstance(getattr(m, "attn_scale", None), (int, float))]


@contextmanager
def positional_temperature(modules: list[torch.nn.Module]) -> Iterator[None]:
    """For the duration of the block, `modules` (from `temperature_tuned`) leave their temperature tuning to
    `paged_attention_forward`, which scales by position."""
    saved = [(m.attn_temperature_tuning, getattr(m, "paged_temperature_tuning", False)) for m in modules]
    try:  # (nested, as by a draft model that is the target, the inner block leaves the outer's state)
        for m in modules:
            m.attn_temperature_tuning, m.paged_temperature_tuning = False, True
        yield
    finally:
        for m, (own, paged) in zip(modules, saved):
            m.attn_temperature_tuning, m.paged_temperature_tuning = own, paged


def attention_configs(model: torch.nn.Module) -> list:
    """The distinct configs whose `_attn_implementation` the model's attention layers read (usually one)."""
    found = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    return list(found.values())


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str, configs: list | None = None) -> Iterator[None]:
    """Run the model's attention layers with the registered attention function `name` for the duration of the
    block, then restore each config's own. Pass `configs` (from `attention_configs`) to skip walking the module
    tree."""
    configs = attention_configs(model) if configs is None else configs
    saved = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = name
        yield
    finally:
        for c, impl in zip(configs, saved):
            c._attn_implementation_internal = impl


@contextmanager
def paged_attention(model: torch.nn.Module, configs: list | None = None, tuned: list | None = None) -> Iterator[None]:
    """Route the model's attention through the pool for the duration of the block (a context manager). `tuned`:
    `temperature_tuned(model)`, computed once by the caller (walked here if None)."""
    with attention_implementation(model, PAGED_ATTENTION_NAME, configs), \
            positional_temperature(temperature_tuned(model) if tuned is None else tuned):
        yield


__all__ = [
    "AttentionBackend", "LayerAttention", "LayerSpec", "MaskKey", "PAGED_ATTENTION_NAME", "PagedAttentionMetadata",
    "PagedContext", "Segment", "allowed", "attention_configs", "attention_implementation", "build_metadata",
    "decode_metadata", "paged_attention", "positional_temperature", "register_attention_backend", "resolve_backend",
    "temperature_scaled", "temperature_tuned", "torch_paged_attention", "with_context",
]
