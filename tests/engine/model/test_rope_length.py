"""Length-dependent rotary embeddings (`engine/model/rope_length.py`): refused in every dtype, naming the rope type and
what to use instead; RoPE with fixed frequencies served token-identically past the scaling thresholds.

The refusal is needed: with the check bypassed, a dynamic-NTK Llama served by the engine gives a short prompt packed
beside a long one the long one's frequencies, and a long prompt prefilled in chunks other frequencies per chunk, so
greedy output differs from `model.generate` (whose own result depends on how it is called)."""

from __future__ import annotations

import pytest
import torch

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.model import support
from trl_infinite.engine.model.rope_length import length_dependent_rope
from trl_infinite.testing.model_matrix import reference
from trl_infinite.testing.tiny_configs import build_tiny_model, sizes

BF16 = torch.bfloat16
THRESHOLD = 32  # max_position_embeddings / original_max_position_embeddings of the models below
ROPE = {
    "dynamic": dict(rope_type="dynamic", factor=8.0),
    "longrope": dict(rope_type="longrope", short_factor=[1.0] * 16, long_factor=[4.0] * 16,
                     original_max_position_embeddings=THRESHOLD),
    "linear": dict(rope_type="linear", factor=8.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=THRESHOLD),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=THRESHOLD),
}


def _model(rope: str, seed: int = 0) -> torch.nn.Module:
    """A Llama (Phi-3 for `longrope`, whose class validates it) of head dim 32 whose q / k weights are scaled x4, so
    that a change of RoPE frequencies shows in greedy output; the rope's threshold is 32 positions."""
    model_type = "phi3" if rope == "longrope" else "llama"
    extra = dict(original_max_position_embeddings=THRESHOLD) if rope == "longrope" else {}
    model = build_tiny_model(model_type, seed=seed, size=sizes(32), max_position_embeddings=THRESHOLD if
                             rope == "dynamic" else 4 * THRESHOLD, rope_parameters=dict(rope_theta=1e4, **ROPE[rope]),
                             **extra)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
    return model


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 96, (n,), generator=gen).tolist() for n in (5, 9, 20, 100)]


def _greedy(engine: RolloutEngine, prompts: list[list[int]]) -> list[list[int]]:
    return engine.generate(prompts, 1, SamplingParams(max_new_tokens=5, temperature=0.0)).completion_ids


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
@pytest.mark.parametrize("dtype", ["float32", "bf16 weights", "bf16 autocast"])
def test_length_dependent_rope_is_refused_in_every_dtype(rope, dtype):
    model = _model(rope)
    if dtype == "bf16 weights":
        model = model.to(BF16)
    with torch.autocast("cpu", dtype=BF16, enabled=dtype == "bf16 autocast"), \
            pytest.raises(support.UnsupportedModelError) as info:
        RolloutEngine(model, EngineConfig(kv_cache_tokens=512, block_size=4))
    msg = str(info.value)
    assert f"rotary position embedding (`{rope}`" in msg and "`linear`, `yarn` or `llama3` scaling" in msg, msg
    assert "`use_vllm=True`" in msg


def test_served_dynamic_rope_would_differ_from_generate(monkeypatch):
    """Why it is refused: with the check bypassed, packed and chunked prefill give other tokens than `generate`."""
    monkeypatch.setattr(support, "length_dependent_rope", lambda *a: None)
    model, prompts = _model("dynamic"), _prompts()
    want = [reference(model, p, None)[:5] for p in prompts]
    packed = RolloutEngine(model, EngineConfig(kv_cache_tokens=1024, block_size=4))
    got = _greedy(packed, prompts)
    assert got[3] == want[3] and got[:3] != want[:3]  # the long prompt is fine, a short one beside it is not
    chunked = RolloutEngine(model, EngineConfig(kv_cache_tokens=1024, block_size=4, max_prefill_tokens=16))
    assert [_greedy(chunked, [p])[0] for p in prompts] != want


@pytest.mark.parametrize("rope", ["linear", "yarn", "llama3"])
def test_fixed_frequency_rope_is_served_token_identically_past_its_threshold(rope):
    """Scaled RoPE whose frequencies do not depend on the sequence: prompts of 5 to 100 tokens (threshold 32) packed
    in one call and prefilled in chunks of 16, greedy equal to `generate` of each prompt alone."""
    model, prompts = _model(rope), _prompts()
    assert length_dependent_rope(model, model.config) is None
    want = [reference(model, p, None)[:5] for p in prompts]
    for chunk in (4096, 16):
        engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=1024, block_size=4, max_prefill_tokens=chunk))
        assert _greedy(engine, prompts) == want, chunk


class _LengthScaledRotary(torch.nn.Module):
    """A rotary embedding whose config says nothing: it stretches its frequencies by the longest position seen."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("inv_freq", inner.inv_freq.clone(), persistent=False)

    def forward(self, x, position_ids):
        stretch = max(1.0, (int(position_ids.max()) + 1) / 64)
        self.inner.inv_freq.copy_(self.inv_freq / stretch)
        return self.inner(x, position_ids)


def test_a_length_dependent_rotary_module_is_found_by_behaviour():
    """Not by the config's rope type (default here): the probe calls the module with and without a far position."""
    model = _model("linear")
    model.model.rotary_emb = _LengthScaledRotary(model.model.rotary_emb)
    with pytest.raises(support.UnsupportedModelError, match=r"`_LengthScaledRotary`.* also holds position \d+"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=512, block_size=4))


def test_the_probe_leaves_the_models_rotary_state_alone():
    model = _model("dynamic")
    rotary = model.model.rotary_emb
    before = (rotary.inv_freq.clone(), rotary.max_seq_len_cached)
    assert length_dependent_rope(model, model.config) is not None
    assert torch.equal(rotary.inv_freq, before[0]) and rotary.max_seq_len_cached == before[1]
