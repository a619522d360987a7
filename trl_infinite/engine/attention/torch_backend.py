"""Reference paged attention in pure torch (any device): one gather of each segment's context, one attention call.

Everything that does not depend on the layer (context slots, masks, query padding) is in `meta.context`, built once
per forward by `metadata.with_context`; a layer only gathers its own K/V and calls attention (a decode forward in a
handful of ops: this runs 28+ times per step on the host-bound path).

Implements every `LayerAttention` feature: GQA / MQA (any query-head multiple of the KV heads), K and V of different
widths (MLA), sliding windows, chunked attention (the masks), logit soft-capping and attention sinks. Without
soft-cap and sinks it runs `scaled_dot_product_attention`; with either, the explicit score matrix (softmax in
float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layer import LayerAttention
from .metadata import PagedAttentionMetadata, with_context


def torch_paged_attention(
    query: torch.Tensor,  # [T, H, Dk]
    k_cache: torch.Tensor,  # [num_slots, Hkv, Dk] (one layer)
    v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]
    meta: PagedAttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:  # [T, H, Dv]
    """Attention of every query token over its segment's context in the pool (new tokens already written)."""
    plan = meta.context
    num_seg = meta.prompt_lens.shape[0]
    keys = k_cache.index_select(0, plan.slots).view(num_seg, -1, *k_cache.shape[1:]).transpose(1, 2)  # [S,Hkv,C,Dk]
    values = v_cache.index_select(0, plan.slots).view(num_seg, -1, *v_cache.shape[1:]).transpose(1, 2)
    key = (layer.sliding_window, layer.chunk_size)
    bias = plan.masks.get(key)
    if bias is None:  # a pattern the engine was not told about: build it here (correct, not cached)
        bias = with_context(meta, (key,)).context.masks[key]
    if plan.query_index is None:  # decode: one query per segment
        q = query[:, :, None]  # [S, H, 1, Dk]
    else:
        seg, idx = plan.query_index
        q = query.new_zeros(num_seg, meta.max_q_len, *query.shape[1:])  # [S, Q, H, Dk]
        q[seg, idx] = query
        q = q.transpose(1, 2)
    if layer.needs_scores:
        out = _explicit_attention(q, keys, values, bias, layer)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=layer.scale,
                                             enable_gqa=keys.shape[1] != q.shape[1])  # [S, H, Q, Dv]
    if plan.query_index is None:
        return out.squeeze(2)
    return out.transpose(1, 2)[plan.query_index]


def _explicit_attention(q, keys, values, bias, layer: LayerAttention) -> torch.Tensor:
    """Soft-capped and/or sink-augmented softmax attention: [S, H, Q, Dk] x [S, Hkv, C, *] -> [S, H, Q, Dv]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [S, H, C, Dk]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2).to(q.dtype)) * layer.scale  # [S, H, Q, C]
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    scores = scores.float() + bias
    num_ctx = scores.shape[-1]
    if layer.sinks is not None:
        sink = layer.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [S, H, Q, 1]
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :num_ctx]
    return torch.matmul(probs.to(values.dtype), values)
