"""Reference paged attention in pure torch (any device): one gather of each segment's context, one masked SDPA.

Everything that does not depend on the layer (context slots, masks, query padding) is in `meta.context`, built once
per forward by `metadata.with_context`; a layer only gathers its own K/V and calls attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import PagedAttentionMetadata


def torch_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D] (one layer)
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    meta: PagedAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of every query token over its segment's context in the pool (new tokens already written)."""
    plan = meta.context
    num_seg, cols = plan.slots.shape
    flat = plan.slots.reshape(-1)
    keys = k_cache.index_select(0, flat).view(num_seg, cols, *k_cache.shape[1:]).transpose(1, 2)  # [S, Hkv, C, D]
    values = v_cache.index_select(0, flat).view(num_seg, cols, *v_cache.shape[1:]).transpose(1, 2)
    mask = plan.masks.get(sliding_window)
    if mask is None:  # a window the model did not announce: build it here (correct, not cached)
        mask = _window_mask(meta, sliding_window)
    if plan.query_index is None:  # decode: one query per segment
        padded_q = query[:, :, None]  # [S, H, 1, D]
    else:
        seg, idx = plan.query_index
        padded_q = query.new_zeros(num_seg, meta.max_q_len, *query.shape[1:])  # [S, Q, H, D]
        padded_q[seg, idx] = query
        padded_q = padded_q.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        padded_q, keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != padded_q.shape[1]
    )  # [S, H, Q, D]
    if plan.query_index is None:
        return out[:, :, 0]
    return out.transpose(1, 2)[plan.query_index]


def _window_mask(meta: PagedAttentionMetadata, window: int | None) -> torch.Tensor:
    from .metadata import with_context

    return with_context(meta, (window,)).context.masks[window]
