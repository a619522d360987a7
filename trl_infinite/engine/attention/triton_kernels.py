"""Triton kernels of shared-prefix (cascade / Hydragen) paged decode attention, split over KV positions.

Decode attention of a query at position `q` over context positions `0..q` is split at the prompt boundary `P`:

    prefix:  positions [0, min(P, q+1)) in the group's shared prompt blocks
    suffix:  positions [P, q]          in the sample's own blocks

and the partial softmaxes are merged exactly by log-sum-exp. All samples of a group read the same prompt blocks,
so `_prefix_kernel` loads each prompt KV tile ONCE per group and KV head and multiplies it against every query row of
the group (rows = samples x query heads of that KV head, GQA): the prompt's KV bytes are read once per group instead
of once per sample. Flash-decoding style, the prompt is also cut into KV_SPLITS equal spans, one program each (a
long prompt shared by one group would otherwise be walked by a handful of programs on a 100+ SM device); each span
writes a normalised partial output and its log2-sum-exp. `_suffix_kernel` runs per sample (and per tile of its GQA
heads) over its own blocks, split into SPLITS chunks; split 0 starts its online softmax from the merge of the
prefix partials:

    state after the prefix: m = max_z lse_z, l = sum_z 2^(lse_z - m), acc = sum_z o_z 2^(lse_z - m)
    (o = sum_j p_j v_j / l, lse = m + log2 l); with SPLITS > 1, `_merge_kernel` merges the suffix partials.

Scores are kept in log2 units so `exp2` can be used throughout: s = scale * <q, k> (natural units), soft-capped
as `softcap * tanh(s / softcap)` when SOFTCAP, then multiplied by log2(e). of any width: keys are multiplied in DK_CHUNKS chunks of BLOCK_DK columns (576 = 9 x 64 for MLA's latent + rope
keys, no padding to 1024), the query of one chunk reloaded per KV tile when there are several (it stays in L1); values
are accumulated whole (BLOCK_DV = the next power of two), so the row tiles shrink as Dv grows.

The dot products run in the dtype CAST selects: 0 the pool's (bf16 / fp16 use tensor cores; fp32 with PRECISION
'ieee' or 'tf32'), 1 bf16, 2 fp16 (the autocast dtype, for an fp32 pool under autocast: tensor cores, and the
rounding the model's own matmuls have), 3 fp32 'ieee' (Triton's CPU interpreter computes bf16 dots wrongly).
`row_class` (the batch's size class, `triton_tiles.row_class`) is not read by the kernels: it is part of the
autotuner's key, so a configuration timed at one row is not reused at 256.

Layer features (`LayerAttention`): keys and values may have different widths (HEAD_DIM_K, HEAD_DIM_V: MLA); a
sliding window / chunk gives each query a lowest visible position `lo` (`layer.allowed`), so keys below it are
masked and whole tiles below it skipped; attention sinks seed split 0 of the prefix with one extra logit per head and
no value (m = sink * log2(e), l = 1, acc = 0), which the log-sum-exp merges then carry through.
"""

from __future__ import annotations

import builtins

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh through exp2 (saturates to +-1 without overflow issues)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _lowest_visible(q_pos, window, chunk, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Lowest key position a query at `q_pos` sees (the interval [lo, q_pos] of `layer.allowed`)."""
    lo = q_pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, q_pos - window + 1)
    if HAS_CHUNK:
        lo = tl.maximum(lo, (q_pos // chunk) * chunk)
    return lo


@triton.jit
def _cast(x, CAST: tl.constexpr):
    if CAST == 1:
        x = x.to(tl.bfloat16)
    elif CAST == 2:
        x = x.to(tl.float16)
    elif CAST == 3:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_q(q_ptr, q_row, q_mask, c, HEAD_DIM_K: tl.constexpr, BLOCK_DK: tl.constexpr, CAST: tl.constexpr):
    """Chunk c of the query rows: [M, BLOCK_DK] at element offsets `q_row` [M]."""
    d = c * BLOCK_DK + tl.arange(0, BLOCK_DK)
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=q_mask[:, None] & (d < HEAD_DIM_K)[None, :], other=0.0)
    return _cast(q, CAST)


@triton.jit
def _tile_update(
    q, q_ptr, q_row, q_mask, k_ptr, v_ptr, k_slot, v_slot, kv_mask, valid, m_i, l_i, acc, scale, softcap,
    HEAD_DIM_K: tl.constexpr, BLOCK_DK: tl.constexpr, DK_CHUNKS: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, CAST: tl.constexpr,
):
    """One online-softmax step of the query rows against the KV tile whose K rows start at `k_ptr + k_slot` and V
    rows at `v_ptr + v_slot` ([N] element offsets). With one key chunk the rows' query is `q` [M, BLOCK_DK] (held
    in registers), with several it is reloaded chunk by chunk from `q_ptr + q_row`."""
    if DK_CHUNKS == 1:
        d = tl.arange(0, BLOCK_DK)
        k = tl.load(k_ptr + k_slot[:, None] + d[None, :], mask=kv_mask[:, None] & (d < HEAD_DIM_K)[None, :],
                    other=0.0)  # [N, Dk]
        s = tl.dot(q, tl.trans(_cast(k, CAST)), input_precision=PRECISION)  # [M, N]
    else:
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for c in tl.static_range(DK_CHUNKS):
            d = c * BLOCK_DK + tl.arange(0, BLOCK_DK)
            k = tl.load(k_ptr + k_slot[:, None] + d[None, :], mask=kv_mask[:, None] & (d < HEAD_DIM_K)[None, :],
                        other=0.0)
            qc = _load_q(q_ptr, q_row, q_mask, c, HEAD_DIM_K, BLOCK_DK, CAST)
            s = tl.dot(qc, tl.trans(_cast(k, CAST)), s, input_precision=PRECISION)
    s = s * scale  # natural units
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(valid, s * LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet stay at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    dv = tl.arange(0, BLOCK_DV)
    v = _cast(tl.load(v_ptr + v_slot[:, None] + dv[None, :], mask=kv_mask[:, None] & (dv < HEAD_DIM_V)[None, :],
                      other=0.0), CAST)  # [N, Dv]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _normalised(m_i, l_i, acc):
    """(o, lse) of an online-softmax state: o = acc / l, lse = m + log2(l) (-inf where nothing was seen)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr,
    order_ptr, run_len_ptr, q_start_ptr, q_pos_ptr, prompt_lens_ptr, prefix_table_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    scale, softcap, window, chunk, row_class,
    HEAD_DIM_K: tl.constexpr, BLOCK_DK: tl.constexpr, DK_CHUNKS: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, NUM_HEADS: tl.constexpr, GQA: tl.constexpr, PAGE: tl.constexpr,
    KV_SPLITS: tl.constexpr, PRECISION: tl.constexpr, CAST: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (S, Hkv, KV_SPLITS). Program (i, h, z) works iff sorted position i starts a run of segments sharing one
    prompt (`run_len[i] > 0`): over the z-th of KV_SPLITS equal spans of the prompt (BLOCK_N-aligned), it handles
    every row tile of the run for KV head h. Writes each row's normalised partial output to `o` [T, H, KV_SPLITS, Dv]
    and its log2-sum-exp to `lse` [T, H, KV_SPLITS] (fp32; -inf for a span the row does not see; the sink in
    split 0)."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    z = tl.program_id(2)
    n = tl.load(run_len_ptr + i)
    if n > 0:
        leader = tl.load(order_ptr + i)
        prompt_len = tl.load(prompt_lens_ptr + leader)
        span = tl.cdiv(tl.cdiv(prompt_len, KV_SPLITS), BLOCK_N) * BLOCK_N
        z_lo = z * span
        z_hi = tl.minimum(z_lo + span, prompt_len)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        dv = tl.arange(0, BLOCK_DV)
        rows_total = n * GQA
        for m0 in range(0, rows_total, BLOCK_M):
            r = m0 + tl.arange(0, BLOCK_M)  # row = sample * GQA + head-in-group
            r_mask = r < rows_total
            seg = tl.load(order_ptr + i + r // GQA, mask=r_mask, other=0)
            head = kvh * GQA + r % GQA
            qi = tl.load(q_start_ptr + seg, mask=r_mask, other=0)
            q_pos = tl.load(q_pos_ptr + qi, mask=r_mask, other=-1)
            q_row = qi * stride_qt + head * stride_qh
            q = _load_q(q_ptr, q_row, r_mask, 0, HEAD_DIM_K, BLOCK_DK, CAST)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            if HAS_SINKS:  # one extra logit per head in the denominator, no value (split 0 carries it)
                sink = tl.load(sinks_ptr + head, mask=r_mask, other=0.0).to(tl.float32) * LOG2E
                m_i = tl.where(r_mask & (z == 0), sink, m_i)
                l_i = tl.where(r_mask & (z == 0), 1.0, l_i)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            lo = _lowest_visible(q_pos, window, chunk, HAS_WINDOW, HAS_CHUNK)  # [M]
            end = tl.minimum(z_hi, tl.max(q_pos) + 1)
            start = tl.maximum(z_lo, (tl.min(tl.where(r_mask, lo, end)) // BLOCK_N) * BLOCK_N)
            for n0 in range(start, end, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                kv_mask = pos < end
                blk = tl.load(prefix_table_ptr + leader * stride_pt + pos // PAGE, mask=kv_mask, other=0)
                slot = blk * PAGE + pos % PAGE
                valid = kv_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= lo[:, None])
                m_i, l_i, acc = _tile_update(
                    q, q_ptr, q_row, r_mask, k_base, v_base, slot * stride_ks, slot * stride_vs, kv_mask, valid,
                    m_i, l_i, acc, scale, softcap, HEAD_DIM_K, BLOCK_DK, DK_CHUNKS, HEAD_DIM_V, BLOCK_DV, BLOCK_M,
                    BLOCK_N, SOFTCAP, PRECISION, CAST,
                )
            out, lse = _normalised(m_i, l_i, acc)
            part = (qi * NUM_HEADS + head) * KV_SPLITS + z  # [M] row of [T, H, KV_SPLITS]
            tl.store(o_ptr + part[:, None] * HEAD_DIM_V + dv[None, :], out,
                     mask=r_mask[:, None] & (dv < HEAD_DIM_V)[None, :])
            tl.store(lse_ptr + part, lse, mask=r_mask)


@triton.jit
def _suffix_kernel(
    q_ptr, k_ptr, v_ptr, pre_o_ptr, pre_lse_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    q_start_ptr, q_pos_ptr, prompt_lens_ptr, suffix_table_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_outt, stride_outh, stride_st,
    scale, softcap, window, chunk, row_class,
    HEAD_DIM_K: tl.constexpr, BLOCK_DK: tl.constexpr, DK_CHUNKS: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, NUM_HEADS: tl.constexpr, GQA: tl.constexpr, PAGE: tl.constexpr,
    HEAD_TILES: tl.constexpr, PREFIX_SPLITS: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    CAST: tl.constexpr, SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (S, Hkv * HEAD_TILES, SPLITS). Program (s, h * HEAD_TILES + t, z): query heads t * BLOCK_M .. of the GQA
    heads of KV head h, decode segment s, over the z-th of SPLITS equal chunks of the segment's visible own tokens
    (positions [max(P, lo), q]). Split 0 seeds its online softmax with the merged prefix partials. With SPLITS == 1
    it writes the output; otherwise the normalised partial output [T, H, SPLITS, Dv] and its log2-sum-exp
    [T, H, SPLITS] for `_merge_kernel`."""
    seg = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_TILES
    tile = tl.program_id(1) % HEAD_TILES
    split = tl.program_id(2)
    qi = tl.load(q_start_ptr + seg)
    q_pos = tl.load(q_pos_ptr + qi)
    prompt_len = tl.load(prompt_lens_ptr + seg)
    g = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    g_mask = g < GQA
    head = kvh * GQA + g
    q_row = qi * stride_qt + head * stride_qh
    q = _load_q(q_ptr, q_row, g_mask, 0, HEAD_DIM_K, BLOCK_DK, CAST)
    dv = tl.arange(0, BLOCK_DV)
    rv_mask = g_mask[:, None] & (dv < HEAD_DIM_V)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if split == 0:  # merge the prefix partials (only split 0 carries the prefix)
        pre = (qi * NUM_HEADS + head) * PREFIX_SPLITS  # [M]
        for z in range(PREFIX_SPLITS):
            lse_z = tl.load(pre_lse_ptr + pre + z, mask=g_mask, other=float("-inf"))
            m_new = tl.maximum(m_i, lse_z)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            w = tl.exp2(lse_z - m_safe)
            o_z = tl.load(pre_o_ptr + (pre + z)[:, None] * HEAD_DIM_V + dv[None, :], mask=rv_mask, other=0.0)
            acc = acc * alpha[:, None] + o_z * w[:, None]
            l_i = l_i * alpha + w
            m_i = m_new
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
            q, q_ptr, q_row, g_mask, k_base, v_base, slot * stride_ks, slot * stride_vs, kv_mask, valid,
            m_i, l_i, acc, scale, softcap, HEAD_DIM_K, BLOCK_DK, DK_CHUNKS, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N,
            SOFTCAP, PRECISION, CAST,
        )
    out, lse = _normalised(m_i, l_i, acc)
    if SPLITS == 1:
        tl.store(out_ptr + qi * stride_outt + head[:, None] * stride_outh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rv_mask)
    else:
        row = (qi * NUM_HEADS + head) * SPLITS + split  # [T, H, SPLITS] contiguous
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM_V + dv[None, :], out, mask=rv_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


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


def _interpreter_range(*bounds) -> builtins.range:
    """`range` of the kernels' loops under Triton's CPU interpreter, which holds a scalar as a one-element numpy
    array whose `__index__` (Triton 3.6: `int(array)`) fails since numpy 2.4: the bounds are converted here instead;
    compiled kernels keep the builtin `range`."""
    return builtins.range(*(int(b.handle.data.reshape(-1)[0]) if hasattr(b, "handle") else int(getattr(b, "value", b))
                            for b in bounds))


if isinstance(_prefix_kernel, InterpretedFunction):  # TRITON_INTERPRET=1 at import
    range = _interpreter_range  # noqa: A001 (the name the kernels' loops look up in this module's globals)
