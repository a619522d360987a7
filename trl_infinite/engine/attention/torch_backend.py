"""Reference paged attention in pure torch (any device): one gather of each segment's context, one attention call.

Everything that does not depend on the layer (context slots, masks, query padding) is in `meta.context`, built once
per forward by `metadata.with_context`; a layer only gathers its own K/V and calls attention (a decode forward in a
handful of ops: this runs 28+ times per step on the host-bound path).

Implements every `LayerAttention` feature: GQA / MQA (any query-head multiple of the KV heads), K and V of different
widths (MLA), sliding windows, chunked attention (the masks), logit soft-capping and attention sinks. Without
soft-cap and sinks it runs `scaled_dot_product_attention`; with either, the explicit score matrix (softmax in
float32).

Static decode steps on CPU carry the batch's group slots (`decode_metadata`), and there the context is split at the
prompt (`_cascade_decode`, the torch counterpart of the Triton cascade kernel): each group's prompt is gathered once
and attended by all its rows in one call, the rows' own tokens in a second call, merged by log-sum-exp. On the
host-bound 28-layer benchmark this takes about a fifth off the compiled decode step (`benchmarks/RESULTS-history.md`).
Layers with soft-cap or sinks, and MLA layers, keep the whole-context path.

On CPU the engine puts the C++ kernel of `cpu_decode` in front of this backend for float32 decode forwards
(`EngineConfig.cpu_decode_kernel`: one call per layer that reads the pool through the tables); this module stays the
reference it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trl_infinite.engine.attention.layer import LayerAttention
from trl_infinite.engine.attention.metadata import PagedAttentionMetadata, with_context


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
    if plan.cascade is not None and not layer.needs_scores and k_cache.shape[2] == v_cache.shape[2]:
        # (the CPU kernel that returns the log-sum-exp wants keys and values of one width: not MLA)
        return _cascade_decode(query, k_cache, v_cache, meta, layer)
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
    else:  # the mask in the query's dtype: cuDNN's SDPA (CUDA's first choice on Hopper) reads a float32 mask
        # given with 16-bit queries as 16-bit data, silently (torch 2.11; pytorch/pytorch#191612); 0 / -inf are exact
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias.to(q.dtype), scale=layer.scale,
                                             enable_gqa=keys.shape[1] != q.shape[1])  # [S, H, Q, Dv]
    if plan.query_index is None:
        return out.squeeze(2)
    return out.transpose(1, 2)[plan.query_index]


_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out, logsumexp)


def _cascade_decode(
    query: torch.Tensor,  # [S, H, Dk] one query per row
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:  # [S, H, Dv]
    """Decode attention with the prompt part shared (`metadata.CascadePlan`, CPU).

    With g = H / Hkv query heads per KV head, the prompt pass puts the g heads in the batch dimension and every row
    in the query dimension: [g, Hkv, S, Dk] queries against the [Hkv, Gb * Cp, Dk] prompt columns of all group
    slots, a few large blocks instead of S * H small ones, and each prompt gathered once instead of once per row.
    The own pass is [S, Hkv, g, Dk] against each row's own columns. The two are merged exactly:

        out = (o_p * exp(lse_p - m) + o_s * exp(lse_s - m)) / (exp(lse_p - m) + exp(lse_s - m)),  m = max(lse_p, lse_s)

    where a row that sees no prompt column (a sliding window past the prompt) gets lse_p = -inf.
    """
    plan = meta.context.cascade
    key = (layer.sliding_window, layer.chunk_size)
    if key not in plan.own_masks:  # a pattern the engine was not told about: build it here (correct, not cached)
        plan = with_context(meta, (key,)).context.cascade
    rows, heads, dk = query.shape
    kv_heads, dv = k_cache.shape[1], v_cache.shape[2]
    group = heads // kv_heads
    q = query.reshape(rows, kv_heads, group, dk)  # [S, Hkv, g, Dk]
    pk = k_cache.index_select(0, plan.prefix_slots).view(1, -1, kv_heads, dk).transpose(1, 2)  # [1, Hkv, Gb*Cp, Dk]
    pv = v_cache.index_select(0, plan.prefix_slots).view(1, -1, kv_heads, dv).transpose(1, 2)
    o_p, lse_p = _flash_with_lse(q.permute(2, 1, 0, 3), pk.expand(group, -1, -1, -1), pv.expand(group, -1, -1, -1),
                                 attn_mask=plan.prefix_masks[key].to(query.dtype), scale=layer.scale)
    o_p, lse_p = o_p.permute(2, 1, 0, 3), lse_p.permute(2, 1, 0)  # [S, Hkv, g, Dv], [S, Hkv, g]
    lse_p = lse_p.masked_fill(~plan.prefix_visible[key][:, None, None], float("-inf"))
    sk = k_cache.index_select(0, plan.own_slots).view(rows, -1, kv_heads, dk).transpose(1, 2)  # [S, Hkv, Cs, Dk]
    sv = v_cache.index_select(0, plan.own_slots).view(rows, -1, kv_heads, dv).transpose(1, 2)
    o_s, lse_s = _flash_with_lse(q, sk, sv, attn_mask=plan.own_masks[key].to(query.dtype), scale=layer.scale)
    m = torch.maximum(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - m)[..., None], torch.exp(lse_s - m)[..., None]
    out = (o_p.float() * w_p + o_s.float() * w_s) / (w_p + w_s)
    return out.to(query.dtype).reshape(rows, heads, dv)


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
