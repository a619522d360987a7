"""The engine under autocast (TRL's `bf16=True` / `fp16=True` on float32 weights; `engine/runner/autocast.py`).

- The KV pool is allocated in the autocast dtype (half the bytes of a float32 pool under bf16), found by the support
  probe inside the model's forward: from an enclosing `torch.autocast` or from an autocast wrapper on `forward`
  (accelerate's mixed precision); every attention backend gets query, keys and values in it.
- Models the engine refused or crashed on under bf16 autocast before run: a Qwen3 at head dim 16 (its q / k norms
  promote Q and K to float32; the C++ float32 kernel then computed a decode attention the model computes in bf16),
  a Cohere2 (its RoPE returns bf16 queries; the static step's cascade handed them to a float32 pool).
- Greedy output under bf16 / fp16 autocast equals `model.generate` under the same autocast on these tiny models,
  up to the first near-tie on a sample's path. The forward is deterministic, but 16-bit rounding depends on the order
  of the sums: the engine attends over a paged context padded to whole blocks (in CPU decode steps split at the
  prompt and merged, the cascade), `generate` over its exact-length cache (and `generate` of a left-padded batch over
  a third layout), so a choice between logits within rounding of each other (`testing/rounding.py`; exact bf16 ties
  are common) can flip between them, and which way depends on the torch release: `llama-d16-s1` has such a step
  (two logits one bf16 ulp apart under torch 2.6, equal under 2.13). The test compares each sample token for token
  up to its first near-tie and requires a tied token there. With a 96-token vocabulary about one greedy step in ten
  is such a near-tie (two logits within 2 bf16 ulps of the largest); each case must compare one sample whole and a
  third of the tokens; the rate on more models is measured by `benchmarks/autocast_exactness.py`
  (benchmarks/RESULTS.md).
- `generate` under another autocast state than the constructor's is a `ValueError`.
- A refusal names its cause: a model inconsistent only under autocast (and the setting that avoids it), one whose
  forward forces autocast, one that keeps state outside the KV cache either way.
- The C++ decode kernel is built only after the support checks passed, and only for a model and pool it serves.
"""

from __future__ import annotations

import pytest
import torch
from _models import tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.attention import cpu_decode
from trl_infinite.engine.model import support
from trl_infinite.testing.model_matrix import MAX_NEW, G, early_eos, prompts, reference
from trl_infinite.testing.rounding import autocast_logit_bound, first_near_tie
from trl_infinite.testing.tiny_configs import build_tiny_model, sizes

BF16 = torch.bfloat16


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype)


def _wrap_forward(model, dtype=BF16):
    """What accelerate's `prepare_model` does under mixed precision: `forward` runs in autocast, outputs in fp32."""
    from accelerate.utils import convert_outputs_to_fp32

    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(model.forward))
    return model


@pytest.mark.parametrize("weights, autocast, pool", [
    (torch.float32, None, torch.float32), (torch.float32, BF16, BF16), (torch.float32, torch.float16, torch.float16),
    (BF16, None, BF16), (BF16, BF16, BF16)])
def test_pool_dtype_is_the_dtype_attention_computes_in(weights, autocast, pool):
    model = tiny_model("qwen3").to(weights)
    cfg = EngineConfig(kv_cache_tokens=256, block_size=4)
    with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
        engine = RolloutEngine(model, cfg)
    assert engine.pool.dtype == pool and engine.support.autocast == autocast
    assert all(k.dtype == pool for k in engine.pool.k_caches + engine.pool.v_caches)
    assert engine.pool.block_bytes == (2 if pool != torch.float32 else 4) * 4 * 2 * 2 * 2 * 8  # B*layers*(K+V)*Hkv*D


def _references(model, ps, dtype=BF16):
    """Under `dtype` autocast: an early EOS, `model.generate`'s greedy samples cut at it, and each sample's first
    near-tie (`first_near_tie`) at the bound of `testing/rounding.py` (for a forward wrapped in autocast, whose
    float32 logits cannot be had, the bound's floor of ulps of the largest logit)."""
    with _autocast(dtype):
        eos = early_eos(model, ps)
        refs = [reference(model, p, eos) for p in ps]
        assert any(len(r) < MAX_NEW for r in refs), "the EOS must end some sample early"
        bound = autocast_logit_bound(model, [p + r for p, r in zip(ps, refs)])
        ties = [first_near_tie(model, p, r, bound) for p, r in zip(ps, refs)]
    compared = sum(len(r) if t is None else t[0] for r, t in zip(refs, ties))
    assert None in ties and compared >= sum(map(len, refs)) / 3, f"too many near-ties to test: {ties}"
    return eos, refs, ties


def _assert_greedy_matches(got, refs, ties, where):
    """Each of the G samples of prompt i equals `refs[i]`, or up to its first near-tie with a tied token there."""
    for row, ids in enumerate(got):
        ref, tie = refs[row // G], ties[row // G]
        if tie is None:
            assert ids == ref, (where, row)
        else:
            step, tied = tie
            assert ids[:step] == ref[:step] and ids[step] in tied, (where, row, tie)


def test_autocast_wrapper_on_forward_is_detected():
    """accelerate's wrapper: no enclosing autocast, yet the forward (the engine's too) runs in bf16 autocast."""
    model = _wrap_forward(build_tiny_model("llama", seed=1, size=sizes(16)))
    ps = prompts(1)
    eos, refs, ties = _references(model, ps)
    engine = RolloutEngine(model, EngineConfig(max_active_sequences=2, kv_cache_tokens=1024, block_size=5))
    assert engine.autocast is None and engine.support.autocast == BF16 and engine.pool.dtype == BF16
    assert not engine.support.decode_kernel
    got = engine.generate(ps, G, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos]))
    _assert_greedy_matches(got.completion_ids, refs, ties, "wrapped forward")


# (model type, head dim, seed, autocast dtype): qwen3 at 16 was refused before (float32 kernel under bf16 autocast),
# cohere2 crashed (bf16 queries on a float32 pool in the static step's cascade)
GREEDY = [("qwen3", 16, 0, BF16), ("llama", 16, 1, BF16), ("cohere2", 8, 0, BF16), ("cohere2", 16, 2, BF16),
          ("qwen3", 16, 0, torch.float16)]


@pytest.mark.parametrize("model_type, head_dim, seed, dtype", GREEDY, ids=[f"{t}-d{h}-s{s}-{str(d)[6:]}"
                                                                           for t, h, s, d in GREEDY])
def test_greedy_under_autocast_equals_generate(model_type, head_dim, seed, dtype):
    model = build_tiny_model(model_type, seed=seed, size=sizes(head_dim))
    ps = prompts(seed)
    eos, refs, ties = _references(model, ps, dtype)
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos])
    for mode, block in (("fixed_slot", 16), ("full_group", 5)):
        with _autocast(dtype):
            engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, max_active_sequences=2, block_size=block,
                                                       kv_cache_tokens=1024, max_prefill_tokens=12))
            assert engine.pool.dtype == dtype and not engine.support.decode_kernel
            got = engine.generate(ps, G, sampling).completion_ids
        _assert_greedy_matches(got, refs, ties, (mode, block))


def test_attention_backends_get_the_autocast_dtype():
    """Q and K arrive in float32 (Qwen3's norms), V in bf16; the backend sees all three in bf16, as the model's own
    SDPA would after autocast's cast (the cascade's flash call, which autocast does not cast, included)."""
    model = build_tiny_model("qwen3", size=sizes(16))
    with _autocast(BF16):
        engine = RolloutEngine(model, EngineConfig(max_active_sequences=2, kv_cache_tokens=512, block_size=4))
    seen = []
    attend = engine.runner.attend

    def recording(query, k_cache, v_cache, meta, layer):
        seen.append((query.dtype, k_cache.dtype, v_cache.dtype, meta.is_decode))
        return attend(query, k_cache, v_cache, meta, layer)

    engine.runner.attend = recording
    assert engine.decoder.cascade_slots
    with _autocast(BF16):
        engine.generate(prompts(0), 2, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert set(seen) == {(BF16, BF16, BF16, False), (BF16, BF16, BF16, True)}  # prefill and decode


def test_generate_under_another_autocast_state_is_refused():
    model = tiny_model("qwen3")
    with _autocast(BF16):
        engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    with pytest.raises(ValueError, match=r"called without autocast, but the engine was built under bfloat16 "
                                         r"autocast .*KV pool allocated in bfloat16"):
        engine.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=2))
    with _autocast(torch.float16), pytest.raises(ValueError, match="called under float16 autocast"):
        engine.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=2))
    with _autocast(BF16):
        assert len(engine.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=2)).completion_ids[0]) == 2


class _MixesTokens(torch.nn.Module):
    """An MLP that also adds a running sum over the sequence (state outside any KV cache), always or only under
    autocast."""

    def __init__(self, mlp: torch.nn.Module, only_under_autocast: bool):
        super().__init__()
        self.mlp, self.only_under_autocast = mlp, only_under_autocast

    def forward(self, hidden_states):
        out = self.mlp(hidden_states)
        if self.only_under_autocast and not torch.is_autocast_enabled("cpu"):
            return out
        return out + 0.5 * hidden_states.cumsum(dim=1)


def _mixing_model(only_under_autocast: bool):
    model = tiny_model("llama")
    model.model.layers[0].mlp = _MixesTokens(model.model.layers[0].mlp, only_under_autocast)
    return model


def test_model_inconsistent_only_under_autocast_is_refused_naming_the_setting():
    model = _mixing_model(only_under_autocast=True)
    RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))  # consistent without autocast
    with _autocast(BF16), pytest.raises(support.UnsupportedModelError) as info:
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    msg = str(info.value)
    assert "under bfloat16 autocast" in msg and "own forward is inconsistent under bfloat16 autocast" in msg
    assert "consistent without autocast" in msg and "`bf16=False` and `fp16=False`" in msg


def test_model_forcing_autocast_is_refused_saying_so():
    model = _wrap_forward(_mixing_model(only_under_autocast=True))
    with pytest.raises(support.UnsupportedModelError, match="turns autocast on by itself .*`bf16=False`"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))


def test_model_with_state_outside_the_cache_is_refused_under_autocast_too():
    """Refused by the float32 decision, which runs first under autocast too, with its float32 reason."""
    model = _mixing_model(only_under_autocast=False)
    with _autocast(BF16), pytest.raises(support.UnsupportedModelError,
                                        match=r"in float32 \(checked on its own float32 weights\): .*so some layer "
                                              "keeps state between forwards outside the KV cache"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))


# ---------------------------------------------------------------------------------------------------- kernel builds
@pytest.fixture
def events(monkeypatch):
    """Records the exactness checks (with / without the kernel) and the kernel builds, in order."""
    log = []
    build, check = cpu_decode.build, support.exactness_problem

    def counted_build():
        log.append("build")
        return build()

    def counted_check(*args, **kwargs):
        log.append("check+kernel" if kwargs.get("cpu_decode_kernel") else "check")
        return check(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "build", counted_build)
    monkeypatch.setattr(support, "exactness_problem", counted_check)
    return log


def _kernel_width_model(**overrides):
    return tiny_model("llama", hidden_size=4 * cpu_decode.vector_floats(), **overrides)  # head dim = vector width


def test_kernel_built_after_the_checks_pass(events):
    engine = RolloutEngine(_kernel_width_model(), EngineConfig(kv_cache_tokens=256, block_size=4))
    assert engine.support.decode_kernel == cpu_decode.build()  # (True where it can be built: ninja, a compiler)
    assert events[:3] == ["check", "build", "check+kernel"]


@pytest.mark.parametrize("case", ["refused", "bf16 autocast", "bf16 weights", "head dim off the vector width",
                                  "switched off"])
def test_kernel_not_built_where_it_will_not_run(events, case):
    cfg = EngineConfig(kv_cache_tokens=256, block_size=4, cpu_decode_kernel=case != "switched off")
    model = _kernel_width_model()
    if case == "refused":
        model.model.layers[0].mlp = _MixesTokens(model.model.layers[0].mlp, only_under_autocast=False)
        with pytest.raises(support.UnsupportedModelError):
            RolloutEngine(model, cfg)
    elif case == "bf16 autocast":
        with _autocast(BF16):
            assert RolloutEngine(model, cfg).pool.dtype == BF16
    elif case == "bf16 weights":
        RolloutEngine(model.to(BF16), cfg)
    elif case == "head dim off the vector width":
        RolloutEngine(tiny_model("llama", hidden_size=24), cfg)  # head dim 6
    else:
        RolloutEngine(model, cfg)
    assert "build" not in events and "check+kernel" not in events
