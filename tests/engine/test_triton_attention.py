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
from trl_infinite.engine.config import EngineConfig, SamplingParams  # noqa: E402

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


def test_large_group_spans_several_row_tiles(monkeypatch):
    monkeypatch.setattr(tb, "BLOCK_M_PREFIX", 16)  # 11 samples x 2 heads = 22 rows -> 2 tiles, split programs
    segs, n = _decode_segments([11, 2], [13, 6], seed=3)
    _compare(segs, n, 4, 2, 8, torch.float32)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_suffix(monkeypatch, splits):
    # own contexts of 1..41 tokens in 16-token tiles over 2 or 4 splits: some splits get several tiles, some none
    monkeypatch.setattr(tb, "suffix_splits", lambda *args: splits)
    monkeypatch.setattr(tb, "BLOCK_N", 16)
    segs, n = _decode_segments([3, 2], [9, 21], seed=7)
    _compare(segs, n, 4, 2, 8, torch.float32)
    _compare(segs, n, 4, 2, 8, torch.bfloat16)
    _compare(segs, n, 4, 2, 8, torch.float32, sliding_window=19, sinks=SINKS[:4].to(DEVICE))


def test_suffix_splits_heuristic():
    # shapes only (a CUDA graph replays the same grid whatever the context lengths): 2 segments x 2 KV heads
    assert tb.suffix_splits(2, 2, sms=132) == 16  # 4 programs on 132 SMs: capped at MAX_SUFFIX_SPLITS
    assert tb.suffix_splits(2, 2, sms=1) == 1  # the 4 programs already fill one SM twice
    assert tb.suffix_splits(2, 2, sms=10) == 4  # ceil(20 / 4) = 5 -> power of two below
    assert tb.suffix_splits(2, 132, sms=132) == 1  # 264 programs are two waves already


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
    from trl_infinite.utils.tiny_configs import build_tiny_model

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



def compile_for_hopper() -> None:
    """Build all three kernels for sm_90 (bfloat16, Qwen3 head geometry) down to a cubin with the wheel's own ptxas.
    Needs no GPU, but a process where TRITON_INTERPRET is off."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trl_infinite.engine.attention.triton_kernels import _merge_kernel, _prefix_kernel, _suffix_kernel

    # every feature on: MLA widths (K 192, V 128), soft-cap, sinks, sliding window, chunks
    common = dict(HEAD_DIM_K=192, BLOCK_DK=256, HEAD_DIM_V=128, BLOCK_DV=128, GQA=2, PAGE=16, BLOCK_N=32,
                  PRECISION="tf32", UPCAST=False, SOFTCAP=True, HAS_WINDOW=True, HAS_CHUNK=True)
    float_ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16"}
    for fn, constexprs in [
        (_prefix_kernel, {**common, "BLOCK_M": 64, "HAS_SINKS": True}),
        (_suffix_kernel, {**common, "BLOCK_M": 16, "SPLITS": 4}),
        (_merge_kernel, {"HEAD_DIM_V": 128, "BLOCK_DV": 128, "SPLITS": 4}),
    ]:
        sig = {}
        for name in inspect.signature(fn.fn).parameters:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in float_ptrs:
                sig[name] = float_ptrs[name]
            elif name.endswith("_ptr"):
                sig[name] = "*fp32" if name.startswith(("o_", "lse", "part", "sinks")) else "*i64"
            else:
                sig[name] = "fp32" if name in ("scale", "softcap") else "i64"
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], fn.fn.__name__
    print("compiled")


def test_kernels_compile_for_hopper():
    # the interpreter is more permissive than the compiler (dtype rules, masks): compile for real, in a subprocess
    # because this one runs with TRITON_INTERPRET=1
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; "
            "from test_triton_attention import compile_for_hopper; compile_for_hopper()")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
