"""Reference paged attention in pure torch (any device): gather each segment's context, masked SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import PagedAttentionMetadata, slots_for_positions


def torch_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D] (one layer)
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    meta: PagedAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of every query token over its segment's context in the pool (new tokens already written)."""
    num_seg = meta.prompt_lens.shape[0]
    device = query.device
    pos = torch.arange(meta.max_ctx_len, device=device).expand(num_seg, -1)  # [S, C]
    valid = pos < meta.ctx_lens[:, None]
    slots = slots_for_positions(pos, meta.prompt_lens, meta.prefix_table, meta.suffix_table, meta.block_size)
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    keys = k_cache[slots].transpose(1, 2)  # [S, Hkv, C, D]
    values = v_cache[slots].transpose(1, 2)

    q_idx = torch.arange(query.shape[0], device=device) - meta.q_start[meta.q_seg]  # index inside its segment
    padded_q = query.new_zeros(num_seg, meta.max_q_len, *query.shape[1:])  # [S, Q, H, D]
    padded_q[meta.q_seg, q_idx] = query
    q_pos = torch.full((num_seg, meta.max_q_len), -1, dtype=torch.long, device=device)
    q_pos[meta.q_seg, q_idx] = meta.q_pos
    mask = (pos[:, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [S, Q, C]
    if sliding_window:
        mask &= pos[:, None, :] > q_pos[:, :, None] - sliding_window
    mask |= (q_pos < 0)[:, :, None] & (pos[:, None, :] == 0)  # padding queries attend to one slot (no NaN)

    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale,
        enable_gqa=keys.shape[1] != padded_q.shape[2],
    )  # [S, H, Q, D]
    return out.transpose(1, 2)[meta.q_seg, q_idx]
