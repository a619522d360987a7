"""The C++ CPU decode-attention kernel of the CPU decode step (`engine/attention/cpu_decode.py`).

- It builds here (a C++ compiler is needed for inductor's CPU code anyway) and equals the torch reference's
  whole-context attention on rows with partial prompt and own blocks, shared prompts, a padding row, GQA, sliding
  windows, chunks and both together, at head dims of one and two vector widths and with Dv != Dk.
- The same on longer prompts (several whole vector-width tiles) shared by several rows, cut by windows and chunks,
  and on contexts of up to 309 tokens (odd and even lengths, Dv of one to three vector widths).
- Where it serves every layer (float32, head dims of the vector width, no soft-cap or sinks in the support probe),
  the static step carries no group slots (no cascade plan, no slot buckets); a soft-capped model keeps them.
- The model matrix's check (greedy vs `generate`, both sampling modes, block sizes 16 and 5) at head dim 16 passes
  through the kernel on models with sliding windows, chunked attention, MQA and mixture-of-experts layers.
- `supports` says no to what it does not cover (bf16, soft-capping, sinks, head dims off the vector width), which
  then keeps the torch path.
- Eager and compiled (inductor's C++ wrapper), the decode step calls it and greedy output stays token-identical to
  `model.generate`; `EngineConfig(cpu_decode_kernel=False)` keeps the torch path.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _models import frequent_token, reference_greedy, requires_compile, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.attention import LayerAttention, cpu_decode, decode_metadata, with_context
from trl_infinite.engine.attention.torch_backend import torch_paged_attention
from trl_infinite.testing.model_matrix import check_model, main
from trl_infinite.testing.routing import kwargs_reach_attention
from trl_infinite.testing.tiny_configs import SIZES, build_tiny_model, sizes

pytestmark = pytest.mark.skipif(shutil.which("ninja") is None, reason="building the kernel needs ninja on PATH "
                                "(without it the engine logs a warning and keeps the torch path)")

B, H, HKV, NUM_BLOCKS = 4, 4, 2, 24


def _pool(dk: int, dv: int, gen: torch.Generator):
    return (torch.randn(NUM_BLOCKS * B, HKV, dk, generator=gen), torch.randn(NUM_BLOCKS * B, HKV, dv, generator=gen))


@pytest.mark.parametrize("pattern", [(None, None), (3, None), (None, 8), (13, 8)],
                         ids=["causal", "window-inside-own", "chunk", "window+chunk"])
@pytest.mark.parametrize("dims", [(16, 16), (32, 32), (32, 16)], ids=["d16", "d32", "dk32-dv16"])
def test_kernel_equals_whole_context_attention(pattern, dims):
    assert cpu_decode.build(), "the CPU decode kernel did not build (see the warning logged above)"
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _pool(*dims, gen)
    # rows: (prompt_len, prompt blocks, own blocks, position of the input token); the last row is padding
    rows = [(10, [3, 7, 1], [9, 2], 15), (10, [3, 7, 1], [5], 10), (6, [4, 6], [11, 12, 13], 17), (6, [4, 6], [14], 8),
            (1, [8], [10, 15, 16], 12), (0, [0, 0, 0], [0, 0, 0], 0)]
    pt = torch.tensor([r[1] + [0] * (3 - len(r[1])) for r in rows])
    st = torch.tensor([r[2] + [0] * (3 - len(r[2])) for r in rows])
    positions, prompt_lens = torch.tensor([r[3] for r in rows]), torch.tensor([r[0] for r in rows])
    meta = decode_metadata(positions, prompt_lens, pt, st, torch.tensor([0, 0, 1, 1, 2, -1]), B)
    query = torch.randn(len(rows), H, dims[0], generator=gen)
    layer = LayerAttention(scale=dims[0] ** -0.5, sliding_window=pattern[0], chunk_size=pattern[1])
    assert cpu_decode.supports(query, k_cache, v_cache, layer)
    ref = torch_paged_attention(query, k_cache, v_cache, with_context(meta, (pattern,)), layer)
    got = cpu_decode.paged_decode_attention(query, k_cache, v_cache, pt, st, prompt_lens, positions, B, layer)
    assert got.shape == (len(rows), H, dims[1])
    assert (got[:-1] - ref[:-1]).abs().max().item() < 1e-5  # real rows (float32 throughout)
    assert torch.isfinite(got).all()  # the padding row too


@pytest.mark.parametrize("pattern", [(None, None), (30, None), (None, 32)], ids=["causal", "window", "chunk"])
def test_kernel_on_longer_prompts_shared_by_rows(pattern):
    # prompts of 37 and 21 tokens (blocks of 4): contexts of several whole vector-width tiles, rows of prompt A, then
    # B, then A again, rows whose prompt blocks differ only in some blocks, and windows / chunks that cut the prompt
    assert cpu_decode.build()
    gen = torch.Generator().manual_seed(11)
    num_blocks = 96
    k_cache, v_cache = (torch.randn(num_blocks * B, HKV, 16, generator=gen) for _ in range(2))
    a, b = list(range(1, 11)), list(range(11, 17))
    a_last = a[:-2] + [17, 18]  # prompt blocks that differ from a's in the last two
    a_mid = a[:3] + [19] + a[4:]  # ... in block 3
    rows = [(37, a, [20, 21], 42), (37, a, [22], 38), (21, b, [23, 24, 25], 30), (37, a, [26, 27], 44),
            (37, a_last, [28], 40), (37, a_mid, [33], 38), (37, a, [29, 30, 31], 46), (21, b, [32], 21)]
    width = max(len(r[1]) for r in rows)
    pt = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows])
    st = torch.tensor([r[2] + [0] * (3 - len(r[2])) for r in rows])
    positions, prompt_lens = torch.tensor([r[3] for r in rows]), torch.tensor([r[0] for r in rows])
    groups = torch.tensor([0, 0, 1, 0, 2, 3, 0, 1])
    meta = decode_metadata(positions, prompt_lens, pt, st, groups, B)
    query = torch.randn(len(rows), H, 16, generator=gen)
    layer = LayerAttention(scale=0.25, sliding_window=pattern[0], chunk_size=pattern[1])
    ref = torch_paged_attention(query, k_cache, v_cache, with_context(meta, (pattern,)), layer)
    got = cpu_decode.paged_decode_attention(query, k_cache, v_cache, pt, st, prompt_lens, positions, B, layer)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dims", [(16, 16), (32, 32), (16, 48)], ids=["d16", "d32", "dk16-dv48"])
@pytest.mark.parametrize("pattern", [(None, None), (150, None)], ids=["causal", "window"])
def test_kernel_on_long_contexts(dims, pattern):
    # contexts of 38 to 309 tokens (odd and even, many vector-width tiles, the last one partly filled), each row's own
    # blocks scattered through the pool after a shared 37-token prompt
    assert cpu_decode.build()
    gen = torch.Generator().manual_seed(3)
    block, prompt_blocks, own_blocks = 8, 5, 34
    positions = torch.tensor([37, 38, 63, 64, 100, 127, 128, 129, 192, 255, 308])
    num_rows = len(positions)
    perm = torch.randperm(prompt_blocks + num_rows * own_blocks, generator=gen)
    pt = perm[:prompt_blocks].expand(num_rows, prompt_blocks).contiguous()
    st = perm[prompt_blocks:].view(num_rows, own_blocks)
    prompt_lens = torch.full((num_rows,), 37)
    k_cache = torch.randn(len(perm) * block, HKV, dims[0], generator=gen)
    v_cache = torch.randn(len(perm) * block, HKV, dims[1], generator=gen)
    meta = decode_metadata(positions, prompt_lens, pt, st, torch.zeros(num_rows, dtype=torch.long), block)
    query = torch.randn(num_rows, H, dims[0], generator=gen)
    layer = LayerAttention(scale=dims[0] ** -0.5, sliding_window=pattern[0])
    assert cpu_decode.supports(query, k_cache, v_cache, layer)
    ref = torch_paged_attention(query, k_cache, v_cache, with_context(meta, (pattern,)), layer)
    got = cpu_decode.paged_decode_attention(query, k_cache, v_cache, pt, st, prompt_lens, positions, block, layer)
    assert (got - ref).abs().max().item() < 1e-5


def test_supports_only_what_it_computes():
    assert cpu_decode.build()
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = _pool(16, 16, gen)
    query = torch.randn(2, H, 16, generator=gen)
    plain = LayerAttention(scale=0.25)
    assert cpu_decode.supports(query, k_cache, v_cache, plain)
    assert not cpu_decode.supports(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), plain)
    assert not cpu_decode.supports(query, k_cache, v_cache, LayerAttention(scale=0.25, softcap=30.0))
    assert not cpu_decode.supports(query, k_cache, v_cache, LayerAttention(scale=0.25, sinks=torch.zeros(H)))
    narrow = torch.randn(2, H, 4, generator=gen)
    assert not cpu_decode.supports(narrow, k_cache[..., :4], v_cache[..., :4], plain)


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls = []
    original = cpu_decode.paged_decode_attention

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(cpu_decode, "paged_decode_attention", counted)  # (compiled: called while the step is traced)
    return calls


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=requires_compile), "off"])
def test_greedy_with_the_kernel_is_token_identical(monkeypatch, mode):
    # head dim 16 (hidden 64 over 4 heads): every layer's decode attention runs the kernel
    model = tiny_model("llama", hidden_size=64)
    assert cpu_decode.build()
    prompts = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70]]
    eos = frequent_token(model, prompts)
    refs = [reference_greedy(model, p, 12, [eos]) for p in prompts]
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=1, kv_cache_tokens=512, block_size=B,
                       compile=mode == "compiled", cpu_decode_kernel=mode != "off")
    calls = _count_kernel_calls(monkeypatch)
    engine = RolloutEngine(model, cfg)
    calls.clear()  # (the support probe's decode forwards run the same path)
    res = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_ids=[eos]))
    assert res.completion_ids == [r for r in refs for _ in range(2)]
    if mode == "off":
        assert not calls, "cpu_decode_kernel=False still called the kernel"
    else:
        assert calls, "the decode step did not call the kernel"


def test_the_step_carries_group_slots_only_where_a_layer_falls_back():
    model = tiny_model("llama", hidden_size=64)
    on = RolloutEngine(model, EngineConfig(kv_cache_tokens=512))
    assert on.runner.decode_kernel_everywhere and not on.decoder.cascade_slots
    off = RolloutEngine(model, EngineConfig(kv_cache_tokens=512, cpu_decode_kernel=False))
    assert not off.runner.decode_kernel_everywhere and off.decoder.cascade_slots
    # soft-capped layers (marked by the support probe) take the torch path, which keeps its group slots
    gemma = build_tiny_model("gemma2", attn_logit_softcapping=50.0, head_dim=16, query_pre_attn_scalar=16)
    capped = RolloutEngine(gemma, EngineConfig(kv_cache_tokens=512))
    assert all(spec.needs_scores for spec in capped.support.layers.values())
    assert not capped.runner.decode_kernel_everywhere and capped.decoder.cascade_slots
    plain = RolloutEngine(build_tiny_model("gemma2", attn_logit_softcapping=None, head_dim=16,
                                           query_pre_attn_scalar=16), EngineConfig(kv_cache_tokens=512))
    assert not any(spec.needs_scores for spec in plain.support.layers.values())
    assert plain.runner.decode_kernel_everywhere


def test_greedy_with_several_prompts_and_no_group_slots():
    # four prompts, two samples each, up to eight rows: the groups in a step change as samples finish and join
    model = tiny_model("llama", hidden_size=64)
    prompts = [[5, 17, 33, 8, 60, 2, 9], [11, 4, 70], [3] * 19, [8, 1, 44, 23, 9, 15, 61, 2, 7, 12, 30]]
    eos = frequent_token(model, prompts)
    refs = [reference_greedy(model, p, 14, [eos]) for p in prompts]
    engine = RolloutEngine(model, EngineConfig(max_active_sequences=5, kv_cache_tokens=1024, block_size=B))
    assert not engine.decoder.cascade_slots
    res = engine.generate(prompts, 2, SamplingParams(max_new_tokens=14, temperature=0.0, eos_token_ids=[eos]))
    assert res.completion_ids == [r for r in refs for _ in range(2)]


@pytest.mark.parametrize("model_type", ["qwen3", "mistral", "llama4_text", "gpt_bigcode", "qwen2_moe"])
def test_model_matrix_at_head_dim_16_runs_the_kernel(monkeypatch, model_type):
    # tiny configs: sliding window 6 where the type has one, attention chunk 5 (llama4), MQA (gpt_bigcode)
    assert sizes(8) == SIZES  # the default matrix is unchanged
    if not kwargs_reach_attention(build_tiny_model(model_type)):  # the engine's precondition (`testing/routing.py`)
        pytest.skip(f"the installed transformers does not route `{model_type}`'s attention kwargs")
    calls = _count_kernel_calls(monkeypatch)
    row = check_model(model_type, head_dim=16)
    assert row.verdict == "token-identical", row.detail
    assert calls, "the matrix check did not run the kernel"


@pytest.mark.parametrize("head_dim", [0, 7, 2.0])
def test_model_matrix_refuses_a_bad_head_dim(head_dim):
    with pytest.raises(ValueError, match="head_dim.*even integer"):
        sizes(head_dim)
    if isinstance(head_dim, int):
        with pytest.raises(SystemExit):  # argparse: "--head-dim: `head_dim` must be an even integer >= 2 ..."
            main(["--head-dim", str(head_dim), "--types", "llama"])
