"""The torch paged-attention backend equals dense `scaled_dot_product_attention` (float32, atol 1e-5) on a packed
batch mixing decode, recompute, prefill and chunked-prefill segments, with GQA and prompt blocks shared by samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trl_infinite.engine.attention import (
    LayerSpec,
    PagedContext,
    Segment,
    build_metadata,
    torch_paged_attention,
    with_context,
)
from trl_infinite.engine.attention import paged_attention_forward as attention_fn
from trl_infinite.engine.attention.metadata import slots_for_positions

B, H, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 24
SCALE = D**-0.5


def _batch():
    """Segments over three prompts. Prompt A (10 tokens, 3 prefix blocks, the last one partial) is shared by three
    samples: A1 decodes at position 15, A2 its first completion token, A3 recomputes positions 10..15 (crossing an
    own block). Prompt B is prefilled whole; prompt C's second chunk (positions 5..8) is prefilled."""
    gen = torch.Generator().manual_seed(0)
    dense = lambda n: (torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen))  # noqa: E731
    a_k, a_v = dense(10)
    prefix_a = [3, 7, 1]
    seqs = []  # (segment, dense K [ctx, Hkv, D], dense V)
    for own_blocks, start, q_len in (([9, 2], 15, 1), ([5], 10, 1), ([11, 12], 10, 6)):
        own_k, own_v = dense(start + q_len - 10)
        seg = Segment(10, prefix_a, own_blocks, start, list(range(q_len)), group_index=0)
        seqs.append((seg, torch.cat([a_k, own_k]), torch.cat([a_v, own_v])))
    b_k, b_v = dense(7)
    seqs.append((Segment(7, [4, 6], [], 0, list(range(7)), group_index=1), b_k, b_v))
    c_k, c_v = dense(9)
    seqs.append((Segment(9, [0, 8, 10], [], 5, list(range(4)), group_index=2), c_k, c_v))
    return seqs


def _pool_with_cached_context(seqs, meta):
    """A garbage-filled pool holding every segment's already-cached positions (< start_pos)."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(NUM_BLOCKS * B, HKV, D, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS * B, HKV, D, generator=gen)
    for s, (seg, k, v) in enumerate(seqs):
        pos = torch.arange(seg.start_pos)[None]
        slots = slots_for_positions(pos, meta.prompt_lens[s : s + 1], meta.prefix_table[s : s + 1],
                                    meta.suffix_table[s : s + 1], B)[0]
        k_cache[slots], v_cache[slots] = k[: seg.start_pos], v[: seg.start_pos]
    return k_cache, v_cache


def _reference(query: torch.Tensor, seqs, window: int | None) -> torch.Tensor:
    """Dense SDPA per segment over its full context (keys repeated for GQA): [T, H, D]."""
    outs, t = [], 0
    for seg, k, v in seqs:
        q_len = len(seg.tokens)
        q = query[t : t + q_len].transpose(0, 1)  # [H, Q, D]
        kk = k.repeat_interleave(H // HKV, dim=1).transpose(0, 1)  # [H, C, D]
        vv = v.repeat_interleave(H // HKV, dim=1).transpose(0, 1)
        q_pos = torch.arange(seg.start_pos, seg.end_pos)[:, None]
        k_pos = torch.arange(seg.end_pos)[None]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=SCALE).transpose(0, 1))
        t += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_matches_sdpa(window):
    seqs = _batch()
    segments = [s for s, _, _ in seqs]
    _, positions, meta = build_metadata(segments, B, torch.device("cpu"))
    assert positions[0].tolist() == [p for s in segments for p in range(s.start_pos, s.end_pos)]
    k_cache, v_cache = _pool_with_cached_context(seqs, meta)
    new_k = torch.cat([k[s.start_pos :] for s, k, _ in seqs])  # [T, Hkv, D]
    new_v = torch.cat([v[s.start_pos :] for s, _, v in seqs])
    query = torch.randn(new_k.shape[0], H, D, generator=torch.Generator().manual_seed(2))

    # the registered attention function writes the new K/V at slot_mapping, then runs the backend, whose
    # per-forward plan (context slots and masks) is built once
    ctx = PagedContext([k_cache], [v_cache], with_context(meta, ((window, None),)), torch_paged_attention,
                       {0: LayerSpec(0, sliding_window=window)})
    out, _ = attention_fn(SimpleNamespace(layer_idx=0), query.transpose(0, 1)[None], new_k.transpose(0, 1)[None],
                          new_v.transpose(0, 1)[None], None, scaling=SCALE, sliding_window=window, paged_ctx=ctx)
    assert out.shape == (1, query.shape[0], H, D)
    torch.testing.assert_close(out[0], _reference(query, seqs, window), atol=1e-5, rtol=0)


def test_shared_prefix_blocks_are_read_not_copied():
    """The three samples of prompt A map positions < 10 to the same pool slots; own positions to distinct ones."""
    seqs = _batch()[:3]
    _, _, meta = build_metadata([s for s, _, _ in seqs], B, torch.device("cpu"))
    pos = torch.arange(16).expand(3, -1)
    slots = slots_for_positions(pos, meta.prompt_lens, meta.prefix_table, meta.suffix_table, B)
    assert (slots[:, :10] == slots[0, :10]).all()
    assert slots[0, :10].tolist() == [3 * B + i for i in range(4)] + [7 * B + i for i in range(4)] + [B, B + 1]
    assert slots[0, 10].item() == 9 * B and slots[0, 14].item() == 2 * B  # own blocks start at offset 0
    assert len(set(slots[0, 10:].tolist()) & set(slots[2, 10:].tolist())) == 0


@pytest.mark.parametrize("pattern", [(None, None), (3, None), (None, 8), (13, 8)],
                         ids=["causal", "window-inside-own", "chunk", "window+chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_equals_whole_context(pattern, dtype):
    # static-decode metadata with group slots (three prompts, the middle slot free, a padding row): the split
    # prompt / own passes merged by log-sum-exp equal one attention over the whole context, including rows whose
    # window no longer reaches their prompt (no prompt column visible)
    from trl_infinite.engine.attention import LayerAttention, decode_metadata

    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(NUM_BLOCKS * B, HKV, D, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS * B, HKV, D, generator=gen).to(dtype)
    # rows: (prompt_len, prompt blocks, own blocks, position of the input token, group slot)
    rows = [(10, [3, 7, 1], [9, 2], 15, 0), (10, [3, 7, 1], [5], 10, 0), (6, [4, 6], [11, 12, 13], 17, 2),
            (6, [4, 6], [14], 8, 2), (0, [0, 0, 0], [0, 0, 0], 0, 0)]  # the last row is padding (null block 0)
    pt = torch.tensor([r[1] + [0] * (3 - len(r[1])) for r in rows])
    st = torch.tensor([r[2] + [0] * (3 - len(r[2])) for r in rows])
    groups = torch.tensor([[3, 7, 1], [0, 0, 0], [4, 6, 0], [0, 0, 0]])  # 4 slots, slot 1 and 3 free
    meta = decode_metadata(torch.tensor([r[3] for r in rows]), torch.tensor([r[0] for r in rows]), pt, st,
                           torch.tensor([0, 0, 1, 1, -1]), B, torch.tensor([r[4] for r in rows]), groups)
    query = torch.randn(len(rows), H, D, generator=gen).to(dtype)
    layer = LayerAttention(scale=SCALE, sliding_window=pattern[0], chunk_size=pattern[1])
    split = with_context(meta, (pattern,))
    assert split.context.cascade is not None
    whole = with_context(meta.__class__(**{**meta.__dict__, "group_prefix_table": None}), (pattern,))
    got = torch_paged_attention(query, k_cache, v_cache, split, layer)
    ref = torch_paged_attention(query, k_cache, v_cache, whole, layer)
    assert whole.context.cascade is None and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got[:4].float() - ref[:4].float()).abs().max().item() < tol  # real rows
    assert torch.isfinite(got).all()  # the padding row too
    if pattern[0] == 3:
        assert not split.context.cascade.prefix_visible[pattern][0]  # row 0 sees no prompt column
    # a layer with soft-capping reads the whole-context masks of the same plan
    capped = LayerAttention(scale=SCALE, softcap=1.0, sliding_window=pattern[0], chunk_size=pattern[1])
    assert torch.equal(torch_paged_attention(query, k_cache, v_cache, split, capped),
                       torch_paged_attention(query, k_cache, v_cache, whole, capped))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_gets_its_mask_in_the_query_dtype(dtype, monkeypatch):
    # cuDNN's SDPA (CUDA's first choice on Hopper) reads a float32 mask given with 16-bit queries as 16-bit data,
    # silently (torch 2.11, pytorch/pytorch#191612): on an H100 the engine's bf16 prefill was 0.11 from the model
    # (relative logit error) and the support contract refused every bf16 model. The backend hands SDPA its mask in
    # the query's dtype, and the result is that of dense attention with a boolean mask.
    from trl_infinite.engine.attention import torch_backend

    exact = _batch()
    seqs = [(s, k.to(dtype), v.to(dtype)) for s, k, v in exact]
    segments = [s for s, _, _ in seqs]
    _, _, meta = build_metadata(segments, B, torch.device("cpu"))
    k_cache, v_cache = (c.to(dtype) for c in _pool_with_cached_context(exact, meta))
    new_k = torch.cat([k[s.start_pos :] for s, k, _ in seqs])
    new_v = torch.cat([v[s.start_pos :] for s, _, v in seqs])
    query = torch.randn(new_k.shape[0], H, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append((q.dtype, attn_mask.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    ctx = PagedContext([k_cache], [v_cache], with_context(meta, ((None, None),)), torch_paged_attention,
                       {0: LayerSpec(0)})
    out, _ = attention_fn(SimpleNamespace(layer_idx=0), query.transpose(0, 1)[None], new_k.transpose(0, 1)[None],
                          new_v.transpose(0, 1)[None], None, scaling=SCALE, paged_ctx=ctx)
    assert seen == [(dtype, dtype)]
    monkeypatch.undo()
    torch.testing.assert_close(out[0].float(), _reference(query, seqs, None).float(), atol=2e-2, rtol=0)
