"""Reference paged attention in pure torch (any device): one gather of each segment's context, one masked SDPA.

Everything that does not depend on the layer (context slots, masks, query padding) is in `meta.context`, built once
per forward by `metadata.with_context`; a layer only gathers its own K/V and calls attention (a decode forward in a
handful of ops: this runs 28+ times per step on the host-bound path).
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
    num_seg = meta.prompt_lens.shape[0]
    keys = k_cache.index_select(0, plan.slots).view(num_seg, -1, *k_cache.shape[1:]).transpose(1, 2)  # [S,Hkv,C,D]
    values = v_cache.index_select(0, plan.slots).view(num_seg, -1, *v_cache.shape[1:]).transpose(1, 2)
    bias = plan.masks.get(sliding_window)
    if bias is None:  # a window the model did not announce: build it here (correct, not cached)
        from .metadata import with_context

        bias = with_context(meta, (sliding_window,)).context.masks[sliding_window]
    gqa = keys.shape[1] != query.shape[1]
    if plan.query_index is None:  # decode: one query per segment
        out = F.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=bias, scale=scale,
                                             enable_gqa=gqa)  # [S, H, 1, D]
        return out.squeeze(2)
    seg, idx = plan.query_index
    padded_q = query.new_zeros(num_seg, meta.max_q_len, *query.shape[1:])  # [S, Q, H, D]
    padded_q[seg, idx] = query
    out = F.scaled_dot_product_attention(padded_q.transpose(1, 2), keys, values, attn_mask=bias, scale=scale,
                                         enable_gqa=gqa)  # [S, H, Q, D]
    return out.transpose(1, 2)[seg, idx]
