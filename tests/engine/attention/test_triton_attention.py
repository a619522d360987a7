"""Triton cascade decode attention against the torch reference.

Without a GPU the kernels run under Triton's CPU interpreter (`TRITON_INTERPRET=1`, set below before triton is
imported) at tiny sizes; on a CUDA machine the same tests run the compiled kernels. Skipped, with the reason shown,
only when `triton` is not installed.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (`pip install triton`); the Triton backend is untested")

from _models import tiny_model  # noqa: E402

from trl_infinite.engine import RolloutEngine  # noqa: E402
from trl_infinite.engine.attention import (  # noqa: E402
    LayerAttention,
    Segment,
    build_metadata,
    torch_paged_attention,
    with_context,
)
from trl_infinite.engine.attention import triton_backend as tb  # noqa: E402
from trl_infinite.engine.attention import triton_tiles as tiles  # noqa: E402
from trl_infinite.engine.config.engine_config import EngineConfig, SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max abs error vs reference (|v| ~ 1)
PAGE = 4


def _pool(num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0, v_dim: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * PAGE, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    return k, torch.randn(num_blocks * PAGE, num_kv_heads, v_dim or head_dim, generator=g).to(DEVICE, dtype)


def _decode_segments(group_sizes: list[int], prompt_lens: list[int], seed: int = 0, shared: bool = True):
    """One decode segment per sample (1..41 own tokens, the query included), the groups' samples shuffled together.
    `shared=False` labels every segment group 0 although the groups keep their distinct prompt blocks."""
    rng = random.Random(seed)
    next_block = 1
    segs = []
    for gi, (n, plen) in enumerate(zip(group_sizes, prompt_lens)):
        prompt_blocks = list(range(next_block, next_block + -(-plen // PAGE)))
        next_block += len(prompt_blocks)
        for _ in range(n):
            own = rng.randint(1, 41)  # tokens of the sample in its own blocks, the query included
            blocks = list(range(next_block, next_block + -(-own // PAGE)))
            next_block += len(blocks)
            segs.append(Segment(plen, prompt_blocks, blocks, plen + own - 1, [7], gi if shared else 0))
    rng.shuffle(segs)
    return segs, next_block


def _triton(q, k, v, meta, layer):
    """The Triton backend as the engine runs it: its per-forward plan first, then the layer call."""
    return tb.triton_paged_attention(q, k, v, tb.prepare_cascade(meta, ((layer.sliding_window, layer.chunk_size),)),
                                     layer)


def _reference(q, k, v, meta, layer):
    return torch_paged_attention(q, k, v, with_context(meta, ((layer.sliding_window, layer.chunk_size),)), layer)


def _compare(segs, num_blocks, heads, kv_heads, head_dim, dtype, v_dim=0, **features):
    k, v = _pool(num_blocks, kv_heads, head_dim, dtype, v_dim=v_dim)
    _, _, meta = build_metadata(segs, PAGE, DEVICE)
    q = torch.randn(1, heads, len(segs), head_dim).to(DEVICE, dtype)[0].transpose(0, 1)  # strided, like the model's
    features = {name: f.to(DEVICE) if isinstance(f, torch.Tensor) else f for name, f in features.items()}
    layer = LayerAttention(scale=head_dim**-0.5, **features)
    got = _triton(q, k, v, meta, layer)
    ref = _reference(q.float(), k.float(), v.float(), meta, layer)
    assert got.dtype == dtype and got.shape == ref.shape
    err = (got.float() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err} >= {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (4, 1, 16), (2, 2, 12)])
def test_cascade_decode_matches_reference(dtype, heads, kv_heads, head_dim):
    # prompts of 1, 9 and 37 tokens (37 > one KV tile of 32), groups of 1, 3 and 4 samples, suffixes of 1..41
    segs, n = _decode_segments([3, 1, 4], [9, 1, 37], seed=heads + head_dim)
    _compare(segs, n, heads, kv_heads, head_dim, dtype)


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0, 1.0])  # [H] for up to 8 query heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "features",
    [dict(sliding_window=5), dict(chunk_size=8), dict(sliding_window=40, chunk_size=16), dict(softcap=2.0),
     dict(sinks=SINKS[:4]), dict(softcap=1.5, sinks=SINKS[:4], sliding_window=7)],
    ids=["window", "chunk", "window+chunk", "softcap", "sinks", "all"],
)
def test_cascade_decode_layer_features(dtype, features):
    # windows / chunks that end inside the prompt, inside the own tokens, and inside one tile; sharp scores so the
    # soft-cap (2.0 < |scale * <q, k>|) changes the result
    segs, n = _decode_segments([3, 1, 4], [9, 1, 37], seed=11)
    if "sinks" in features:
        features = {**features, "sinks": features["sinks"].to(DEVICE)}
    _compare(segs, n, 4, 2, 8, dtype, **features)


@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim", [(8, 1, 8, 8), (4, 4, 12, 8), (4, 1, 24, 16)],
                         ids=["mqa", "mla", "mqa+mla"])
def test_cascade_decode_head_layouts(heads, kv_heads, head_dim, v_dim):
    # MQA (GPTBigCode: one KV head for all query heads) and MLA (DeepSeek: keys wider than values)
    segs, n = _decode_segments([2, 3], [6, 33], seed=13)
    _compare(segs, n, heads, kv_heads, head_dim, torch.float32, v_dim=v_dim, sinks=SINKS[:heads].to(DEVICE))
    _compare(segs, n, heads, kv_heads, head_dim, torch.float32, v_dim=v_dim, sliding_window=6)


def test_soft_cap_changes_the_output():
    # guard for the test above: with these scores, dropping the cap would be caught
    segs, n = _decode_segments([3, 1, 4], [9, 1, 37], seed=11)
    k, v = _pool(n, 2, 8, torch.float32)
    _, _, meta = build_metadata(segs, PAGE, DEVICE)
    q = torch.randn(len(segs), 4, 8, device=DEVICE)
    capped = _triton(q, k, v, meta, LayerAttention(scale=8**-0.5, softcap=2.0))
    plain = _triton(q, k, v, meta, LayerAttention(scale=8**-0.5))
    assert (capped - plain).abs().max().item() > 1e-2


def _small_tiles(monkeypatch, block_m: int = 16, block_n: int = 16) -> None:
    """Tiles smaller than the defaults, so that the tiny test shapes span several row and KV tiles."""
    monkeypatch.setattr(tiles, "prefix_tiles", lambda *a: [tiles.Tiles(block_m, block_n, 4, 2)])
    monkeypatch.setattr(tiles, "suffix_tiles", lambda gqa, *a: [tiles.Tiles(tiles.suffix_rows(gqa, a[-1])[0],
                                                                            block_n, 4, 2)])


def test_large_group_spans_several_row_tiles(monkeypatch):
    _small_tiles(monkeypatch)  # 11 samples x 2 heads = 22 rows -> 2 row tiles
    segs, n = _decode_segments([11, 2], [13, 6], seed=3)
    _compare(segs, n, 4, 2, 8, torch.float32)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_suffix(monkeypatch, splits):
    # own contexts of 1..41 tokens in 16-token tiles over 2 or 4 splits: some splits get several tiles, some none
    monkeypatch.setattr(tb, "suffix_splits", lambda *args: splits)
    _small_tiles(monkeypatch)
    segs, n = _decode_segments([3, 2], [9, 21], seed=7)
    _compare(segs, n, 4, 2, 8, torch.float32)
    _compare(segs, n, 4, 2, 8, torch.bfloat16)
    _compare(segs, n, 4, 2, 8, torch.float32, sliding_window=19, sinks=SINKS[:4].to(DEVICE))


@pytest.mark.parametrize("kv_splits", [2, 4, 8])
def test_split_kv_prefix(monkeypatch, kv_splits):
    """Flash-decoding over the shared prompt: prompts of 1, 9, 37 and 70 tokens cut into 2, 4 or 8 spans of
    16-token tiles (some spans empty), merged by log-sum-exp with the sink in span 0, under windows that end inside
    the prompt; combined with split-K over the own tokens."""
    monkeypatch.setattr(tb, "prefix_splits", lambda *args: kv_splits)
    monkeypatch.setattr(tb, "suffix_splits", lambda *args: 2)
    _small_tiles(monkeypatch)
    segs, n = _decode_segments([3, 1, 4, 2], [9, 1, 37, 70], seed=kv_splits)
    _compare(segs, n, 4, 2, 8, torch.float32)
    _compare(segs, n, 4, 2, 8, torch.bfloat16, sinks=SINKS[:4].to(DEVICE))
    _compare(segs, n, 4, 2, 8, torch.float32, sliding_window=23, softcap=1.5, sinks=SINKS[:4].to(DEVICE))


@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim", [(4, 2, 64, 64), (8, 2, 128, 128), (4, 1, 256, 256),
                                                           (32, 1, 576, 512)], ids=["64", "128", "256", "mla"])
def test_production_head_dims(monkeypatch, heads, kv_heads, head_dim, v_dim):
    """The head widths of real models (and MLA's latent + rope keys, 576 = 9 chunks of 64, values 512, 32 query
    heads on one KV head: 2 head tiles of 16) with prompt and own splits, against the torch reference."""
    monkeypatch.setattr(tb, "prefix_splits", lambda *args: 2)
    monkeypatch.setattr(tb, "suffix_splits", lambda *args: 2)
    segs, n = _decode_segments([2, 1], [21, 5], seed=head_dim)
    _compare(segs, n, heads, kv_heads, head_dim, torch.float32, v_dim=v_dim)
    _compare(segs, n, heads, kv_heads, head_dim, torch.bfloat16, v_dim=v_dim, sinks=torch.linspace(-1, 1, heads))


def test_split_heuristics():
    # shapes only (a CUDA graph replays the same grid whatever the context lengths): 2 segments x 2 KV heads
    assert tb.suffix_splits(2, 2, sms=132) == 16  # 4 programs on 132 SMs: capped at MAX_SUFFIX_SPLITS
    assert tb.suffix_splits(2, 2, sms=1) == 1  # the 4 programs already fill one SM twice
    assert tb.suffix_splits(2, 2, sms=10) == 4  # ceil(20 / 4) = 5 -> power of two below
    assert tb.suffix_splits(2, 132, sms=132) == 1  # 264 programs are two waves already
    assert tb.suffix_splits(2, 1, sms=132, head_tiles=8) == 16  # MLA: head tiles count as programs
    # one group of 32 samples, 8 KV heads, a 4096-token prompt table on 132 SMs: ceil(264 / 16) = 17 -> 16 splits
    assert tb.prefix_splits(32, 8, 32, 128, 4096, sms=132) == 16
    assert tb.prefix_splits(32, 8, 32, 128, 512, sms=132) == 2  # at least 256 table positions per split
    assert tb.prefix_splits(256, 8, 32, 128, 4096, sms=132) == 2  # 16 groups x 8 heads: ceil(264 / 128) = 3 -> 2
    assert tb.prefix_splits(256, 1, 128, 512, 8192, sms=132) == 1  # MLA at 256 rows: 64 MiB of partials per split


def test_unlabelled_groups_are_not_merged():
    # every Segment left at group_index=0 although the 3 groups have distinct prompt blocks: the plan must not
    # share prefixes across different prompt tables
    segs, n = _decode_segments([2, 2, 1], [5, 8, 5], seed=5, shared=False)
    _compare(segs, n, 4, 2, 8, torch.float32)


def test_single_token_prompt_piece():
    # a prefill chunk cut into 1-token pieces is a q_len==1 forward whose queries sit inside the prompt
    segs = [
        Segment(10, [1, 2, 3], [], 6, [5], 0), Segment(10, [1, 2, 3], [], 9, [5], 0), Segment(3, [4], [], 0, [2], 1)
    ]
    _compare(segs, 8, 4, 2, 8, torch.float32)


def test_cascade_plan_runs():
    segs = [Segment(4, [1], [5], 4, [0], 2), Segment(4, [1], [6], 5, [0], 0), Segment(4, [1], [7], 6, [0], 2),
            Segment(4, [2], [8], 4, [0], 0), Segment(4, [1], [9], 4, [0], 2)]
    _, _, meta = build_metadata(segs, PAGE, DEVICE)
    order, run_len = tb.prepare_cascade(meta, (None,)).cascade  # built once per forward, read by every layer
    assert order.tolist() == [1, 3, 0, 2, 4]  # stable sort by group
    assert run_len.tolist() == [1, 1, 3, 0, 0]  # group 0 splits (different prompt blocks), group 2 is one run


def test_multi_token_forwards_use_reference(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the decode kernel must not run here")

    monkeypatch.setattr(tb, "cascade_decode_attention", boom)
    k, v = _pool(8, 2, 8, torch.float32)
    prefill = [Segment(6, [1, 2], [], 0, [1, 2, 3, 4, 5, 6], 0), Segment(2, [3], [4], 2, [1], 1)]
    _, _, meta = build_metadata(prefill, PAGE, DEVICE)
    q = torch.randn(7, 4, 8, device=DEVICE)
    layer = LayerAttention(scale=0.3, sliding_window=2, softcap=1.0)
    assert torch.equal(_triton(q, k, v, meta, layer), _reference(q, k, v, meta, layer))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.setattr(tb, "_interpreting", lambda: False)
    segs, n = _decode_segments([1], [3])
    k, v = _pool(n, 2, 8, torch.float32)
    _, _, meta = build_metadata(segs, PAGE, DEVICE)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _triton(torch.randn(1, 4, 8), k, v, meta, LayerAttention(scale=0.3))


def _tiny(name: str):
    if name == "qwen3":
        return tiny_model("qwen3")
    from trl_infinite.testing.tiny_configs import build_tiny_model

    return build_tiny_model(name)  # gpt_oss: sinks + sliding window 6; deepseek_v3: MLA (K 12 wide, V 8)


@pytest.mark.parametrize("name", ["qwen3", "gpt_oss", "deepseek_v3"])
def test_engine_greedy_triton_equals_torch(name):
    model = _tiny(name).to(DEVICE)
    prompts = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [8, 9, 7]]
    sampling = SamplingParams(max_new_tokens=6, do_sample=False)
    outs = {}
    for backend in ("torch", "triton"):
        cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=3, kv_cache_tokens=256, block_size=4,
                           attention_backend=backend)
        outs[backend] = RolloutEngine(model, cfg).generate(prompts, 2, sampling).completion_ids
    assert outs["triton"] == outs["torch"]
    assert all(len(c) == 6 for c in outs["torch"])


def test_dot_mode_follows_pool_dtype_autocast_and_matmul_precision():
    """Tensor cores for 16-bit pools and for an fp32 pool under bf16 / fp16 autocast (the rounding of the model's
    own matmuls there); fp32 otherwise, at torch's float32 matmul precision; fp32 'ieee' under the interpreter."""
    assert tiles.dot_mode(torch.bfloat16, "cuda", False)[0] == 0 and tiles.dot_mode(torch.float16, "cuda", False)[0] == 0
    assert tiles.dot_mode(torch.float32, "cpu", False) == (0, "ieee")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tiles.dot_mode(torch.float32, "cpu", False) == (1, "tf32")
        assert tiles.dot_mode(torch.float32, "cpu", True) == (0, "ieee")  # the interpreter: no casts
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert tiles.dot_mode(torch.float32, "cpu", False) == (0, "tf32")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert tiles.dot_mode(torch.bfloat16, "cpu", True) == (3, "ieee")


def test_tiles_cover_every_head_dim():
    # keys in power-of-two chunks with no padding beyond 128 wide (MLA: 9 x 64); values whole
    assert tiles.key_chunks(8) == (16, 1) and tiles.key_chunks(128) == (128, 1) and tiles.key_chunks(96) == (128, 1)
    assert tiles.key_chunks(256) == (128, 2) and tiles.key_chunks(192) == (64, 3) and tiles.key_chunks(576) == (64, 9)
    assert tiles.suffix_rows(4, 128) == (16, 1) and tiles.suffix_rows(128, 512) == (16, 8)
    for dk, dv in [(64, 64), (128, 128), (256, 256), (576, 512)]:
        for t in tiles.prefix_tiles(dk, dv) + tiles.suffix_tiles(8, dk, dv):  # accumulator under 64 regs / thread
            assert t.block_m * tiles.value_block(dv) <= 64 * 32 * t.num_warps
