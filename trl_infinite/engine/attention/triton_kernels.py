"""Triton kernels of shared-prefix (cascade / Hydragen) paged decode attention.

Decode attention of a query at position `q` over context positions `0..q` is split at the prompt boundary `P`:

    prefix:  positions [0, min(P, q+1)) in the group's shared prompt blocks
    suffix:  positions [P, q]          in the sample's own blocks

and the two partial softmaxes are merged exactly by log-sum-exp. All samples of a group read the same prompt blocks,
so `_prefix_kernel` loads each prompt KV tile ONCE per group and KV head and multiplies it against every query row of
the group at once (rows = samples x query heads of that KV head, GQA): the prompt's KV bytes are read once per group
instead of once per sample. `_suffix_kernel` then runs per sample over its own blocks, starting its online softmax
from the prefix result, which is the log-sum-exp merge:

    state after prefix: m = lse_prefix, l = 1, acc = o_prefix     (o = sum_j p_j v_j / l, lse = m + log2 l)

For long own contexts with few (segment, KV head) programs, `_suffix_kernel` splits the own tokens into SPLITS
chunks (flash-decoding split-K; split 0 carries the prefix) and `_merge_kernel` merges the partials by log-sum-exp.

Scores are kept in log2 units so `exp2` can be used throughout: s = scale * <q, k> (natural units), soft-capped
as `softcap * tanh(s / softcap)` when SOFTCAP, then multiplied by log2(e).

Layer features (`LayerAttention`): keys and values may have different widths (HEAD_DIM_K, HEAD_DIM_V: MLA); a
sliding window / chunk gives each query a lowest visible position `lo` (`layer.first_visible`), so keys below it are
masked and whole tiles below it skipped; attention sinks seed the prefix kernel's online softmax with one extra
logit per head and no value (m = sink * log2(e), l = 1, acc = 0), which the log-sum-exp merge then carries through.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh through exp2 (saturates to +-1 without overflow issues)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _lowest_visible(q_pos, window, chunk, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Lowest key position a query at `q_pos` sees (`layer.first_visible`)."""
    lo = q_pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, q_pos - window + 1)
    if HAS_CHUNK:
        lo = tl.maximum(lo, (q_pos // chunk) * chunk)
    return lo


@triton.jit
def _tile_update(
    q, k_ptr, v_ptr, k_slot, v_slot, kv_mask, dk, dk_mask, dv, dv_mask, valid, m_i, l_i, acc, scale, softcap,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step of query rows `q` [M, Dk] against the KV tile whose K rows start at `k_ptr + k_slot`
    and V rows at `v_ptr + v_slot` ([N] element offsets). `UPCAST` runs the two matmuls in fp32 (Triton's CPU
    interpreter computes bfloat16 `tl.dot` wrongly)."""
    k = tl.load(k_ptr + k_slot[:, None] + dk[None, :], mask=kv_mask[:, None] & dk_mask[None, :], other=0.0)  # [N, Dk]
    v = tl.load(v_ptr + v_slot[:, None] + dv[None, :], mask=kv_mask[:, None] & dv_mask[None, :], other=0.0)  # [N, Dv]
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N], natural units
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(valid, s * LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet stay at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr,
    order_ptr, run_len_ptr, q_start_ptr, q_pos_ptr, prompt_lens_ptr, prefix_table_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_lt, stride_pt,
    scale, softcap, window, chunk,
    HEAD_DIM_K: tl.constexpr, BLOCK_DK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    GQA: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
):
    """Grid (S, Hkv, splits). Program (i, h, z) works iff sorted position i starts a run of segments sharing one
    prompt (`run_len[i] > 0`); it handles query-row tiles z, z + splits, ... of that run for KV head h.
    Writes the normalised prefix output `o` [T, H, Dv] (fp32) and its log2-sum-exp `lse` [T, H] (sink included)."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.load(run_len_ptr + i)
    if n > 0:
        leader = tl.load(order_ptr + i)
        prompt_len = tl.load(prompt_lens_ptr + leader)
        dk = tl.arange(0, BLOCK_DK)
        dk_mask = dk < HEAD_DIM_K
        dv = tl.arange(0, BLOCK_DV)
        dv_mask = dv < HEAD_DIM_V
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        rows_total = n * GQA
        for m0 in range(tl.program_id(2) * BLOCK_M, rows_total, tl.num_programs(2) * BLOCK_M):
            r = m0 + tl.arange(0, BLOCK_M)  # row = sample * GQA + head-in-group
            r_mask = r < rows_total
            seg = tl.load(order_ptr + i + r // GQA, mask=r_mask, other=0)
            head = kvh * GQA + r % GQA
            qi = tl.load(q_start_ptr + seg, mask=r_mask, other=0)
            q_pos = tl.load(q_pos_ptr + qi, mask=r_mask, other=-1)
            q = tl.load(
                q_ptr + qi[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :],
                mask=r_mask[:, None] & dk_mask[None, :], other=0.0,
            )
            if HAS_SINKS:  # one extra logit per head in the denominator, no value
                m_i = tl.where(r_mask, tl.load(sinks_ptr + head, mask=r_mask, other=0.0).to(tl.float32) * LOG2E,
                               float("-inf"))
                l_i = tl.where(r_mask, 1.0, 0.0)
            else:
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            lo = _lowest_visible(q_pos, window, chunk, HAS_WINDOW, HAS_CHUNK)  # [M]
            end = tl.minimum(prompt_len, tl.max(q_pos) + 1)
            start = (tl.min(tl.where(r_mask, lo, end)) // BLOCK_N) * BLOCK_N
            for n0 in range(start, end, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                kv_mask = pos < end
                blk = tl.load(prefix_table_ptr + leader * stride_pt + pos // PAGE, mask=kv_mask, other=0)
                slot = blk * PAGE + pos % PAGE
                valid = kv_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= lo[:, None])
                m_i, l_i, acc = _tile_update(
                    q, k_base, v_base, slot * stride_ks, slot * stride_vs, kv_mask, dk, dk_mask, dv, dv_mask, valid,
                    m_i, l_i, acc, scale, softcap, SOFTCAP, PRECISION, UPCAST,
                )
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            out = acc / l_safe[:, None]
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(
                o_ptr + qi[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :], out,
                mask=r_mask[:, None] & dv_mask[None, :],
            )
            tl.store(lse_ptr + qi * stride_lt + head, lse, mask=r_mask)


@triton.jit
def _suffix_kernel(
    q_ptr, k_ptr, v_ptr, o_pre_ptr, lse_pre_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    q_start_ptr, q_pos_ptr, prompt_lens_ptr, suffix_table_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_ph, stride_lt,
    stride_outt, stride_outh, stride_st,
    scale, softcap, window, chunk,
    HEAD_DIM_K: tl.constexpr, BLOCK_DK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    GQA: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr, SPLITS: tl.constexpr,
):
    """Grid (S, Hkv, SPLITS). Program (s, h, z): the GQA query heads of KV head h of decode segment s over the z-th
    of SPLITS equal chunks of the segment's visible own tokens (positions [max(P, lo), q]). Split 0 seeds its online
    softmax with the prefix result (the log-sum-exp merge). With SPLITS == 1 it writes the output; otherwise the
    normalised partial output [T, H, SPLITS, Dv] and its log2-sum-exp [T, H, SPLITS] for `_merge_kernel`."""
    seg = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    qi = tl.load(q_start_ptr + seg)
    q_pos = tl.load(q_pos_ptr + qi)
    prompt_len = tl.load(prompt_lens_ptr + seg)
    dk = tl.arange(0, BLOCK_DK)
    dk_mask = dk < HEAD_DIM_K
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < HEAD_DIM_V
    g = tl.arange(0, BLOCK_M)
    g_mask = g < GQA
    head = kvh * GQA + g
    q = tl.load(q_ptr + qi * stride_qt + head[:, None] * stride_qh + dk[None, :],
                mask=g_mask[:, None] & dk_mask[None, :], other=0.0)
    rv_mask = g_mask[:, None] & dv_mask[None, :]
    acc = tl.load(o_pre_ptr + qi * stride_pt + head[:, None] * stride_ph + dv[None, :], mask=rv_mask, other=0.0)
    m_i = tl.load(lse_pre_ptr + qi * stride_lt + head, mask=g_mask, other=float("-inf"))
    first = split == 0  # only split 0 carries the prefix
    acc = tl.where(first, acc, 0.0)
    m_i = tl.where(first, m_i, float("-inf"))
    l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    n_own = q_pos + 1 - prompt_len  # own tokens up to the query (<= 0 for a prompt token)
    own_lo = tl.maximum(_lowest_visible(q_pos, window, chunk, HAS_WINDOW, HAS_CHUNK) - prompt_len, 0)
    span = tl.cdiv(tl.cdiv(tl.maximum(n_own - own_lo, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo = own_lo + split * span
    hi = tl.minimum(lo + span, n_own)
    for n0 in range(lo, hi, BLOCK_N):
        own = n0 + tl.arange(0, BLOCK_N)
        kv_mask = own < hi
        blk = tl.load(suffix_table_ptr + seg * stride_st + own // PAGE, mask=kv_mask, other=0)
        slot = blk * PAGE + own % PAGE
        valid = g_mask[:, None] & kv_mask[None, :]
        m_i, l_i, acc = _tile_update(
            q, k_base, v_base, slot * stride_ks, slot * stride_vs, kv_mask, dk, dk_mask, dv, dv_mask, valid,
            m_i, l_i, acc, scale, softcap, SOFTCAP, PRECISION, UPCAST,
        )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + qi * stride_outt + head[:, None] * stride_outh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rv_mask)
    else:
        row = (qi * GQA * tl.num_programs(1) + head) * SPLITS + split  # [T, H, SPLITS] contiguous
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM_V + dv[None, :], out, mask=rv_mask)
        tl.store(part_lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_outt, stride_outh,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr,
):
    """Grid (T, H): log-sum-exp merge of the SPLITS partial outputs of one query head."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = (t * tl.num_programs(1) + h) * SPLITS + tl.arange(0, SPLITS)  # [SPLITS]
    d = tl.arange(0, BLOCK_DV)
    d_mask = d < HEAD_DIM_V
    lse = tl.load(part_lse_ptr + row)
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM_V + d[None, :], mask=d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_outt + h * stride_outh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
