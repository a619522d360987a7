"""Reference paged attention in pure torch (any device): gather each segment's context, masked attention.

Implements every `LayerAttention` feature: GQA / MQA (any query-head multiple of the KV heads), K and V of different
widths (MLA), sliding windows, chunked attention, logit soft-capping and attention sinks. Without soft-cap and sinks
it runs `scaled_dot_product_attention`; with either, the explicit score matrix (softmax in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layer import LayerAttention, allowed
from .metadata import PagedAttentionMetadata, slots_for_positions


def torch_paged_attention(
    query: torch.Tensor,  # [T, H, Dk]
    k_cache: torch.Tensor,  # [num_slots, Hkv, Dk] (one layer)
    v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]
    meta: PagedAttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:  # [T, H, Dv]
    """Attention of every query token over its segment's context in the pool (new tokens already written)."""
    num_seg = meta.prompt_lens.shape[0]
    device = query.device
    pos = torch.arange(meta.max_ctx_len, device=device).expand(num_seg, -1)  # [S, C]
    valid = pos < meta.ctx_lens[:, None]
    slots = slots_for_positions(pos, meta.prompt_lens, meta.prefix_table, meta.suffix_table, meta.block_size)
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    keys = k_cache[slots].transpose(1, 2)  # [S, Hkv, C, Dk]
    values = v_cache[slots].transpose(1, 2)  # [S, Hkv, C, Dv]

    q_idx = torch.arange(query.shape[0], device=device) - meta.q_start[meta.q_seg]  # index inside its segment
    padded_q = query.new_zeros(num_seg, meta.max_q_len, *query.shape[1:])  # [S, Q, H, Dk]
    padded_q[meta.q_seg, q_idx] = query
    q_pos = torch.full((num_seg, meta.max_q_len), -1, dtype=torch.long, device=device)
    q_pos[meta.q_seg, q_idx] = meta.q_pos
    mask = allowed(q_pos[:, :, None], pos[:, None, :], layer.sliding_window, layer.chunk_size)  # [S, Q, C]
    mask &= valid[:, None, :]
    mask |= (q_pos < 0)[:, :, None] & (pos[:, None, :] == 0)  # padding queries attend to one slot (no NaN)

    q = padded_q.transpose(1, 2)  # [S, H, Q, Dk]
    if layer.needs_scores:
        out = _explicit_attention(q, keys, values, mask, layer)
    else:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], scale=layer.scale, enable_gqa=keys.shape[1] != q.shape[1]
        )  # [S, H, Q, Dv]
    return out.transpose(1, 2)[meta.q_seg, q_idx]


def _explicit_attention(q, keys, values, mask, layer: LayerAttention) -> torch.Tensor:
    """Soft-capped and/or sink-augmented softmax attention: [S, H, Q, Dk] x [S, Hkv, C, *] -> [S, H, Q, Dv]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [S, H, C, Dk]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2).to(q.dtype)) * layer.scale  # [S, H, Q, C]
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    scores = scores.float().masked_fill(~mask[:, None], float("-inf"))
    num_ctx = scores.shape[-1]
    if layer.sinks is not None:
        sink = layer.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [S, H, Q, 1]
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :num_ctx]
    return torch.matmul(probs.to(values.dtype), values)
