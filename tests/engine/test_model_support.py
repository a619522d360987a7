"""The support contract on real `transformers` architectures (tiny random weights, float32): the named models are
token-identical to `model.generate` (greedy, fixed_slot and full_group, block sizes 16 and 5, an early EOS), each
with the feature it needs shown to change the output; unsupported ones are refused up front naming the feature."""

from __future__ import annotations

import pytest
import torch

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.model_matrix import MAX_NEW, G, early_eos, prompts, reference
from trl_infinite.testing.tiny_configs import build_tiny_model


def _sharpen(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Scale the query / key projections so attention scores reach the soft-cap."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(factor)
    return model


def _gemma2(cap: float | None) -> torch.nn.Module:
    """Gemma2's own cap (50) with q / k weights x40: attention scores reach |s| ~ 90 on these prompts."""
    return _sharpen(build_tiny_model("gemma2", attn_logit_softcapping=cap, query_pre_attn_scalar=8), 40.0)


def _gpt_oss(sinks: float | None) -> torch.nn.Module:
    model = build_tiny_model("gpt_oss")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 if sinks is None else torch.full_like(p, sinks))
    return model


# name -> (model, the same weights without the feature (None: no such variant), check of the engine's pool layout)
CASES = {
    "gemma2_softcap": (lambda: _gemma2(50.0), lambda: _gemma2(None), None),
    "llama4_chunked": (lambda: build_tiny_model("llama4_text", attention_chunk_size=4),
                       lambda: build_tiny_model("llama4_text", attention_chunk_size=4,
                                                layer_types=["full_attention", "full_attention"]), None),
    "gpt_oss_sinks": (lambda: _gpt_oss(None), lambda: _gpt_oss(-1e4), None),
    "deepseek_v3_mla": (lambda: build_tiny_model("deepseek_v3"), None,
                        lambda kv: kv.k_dims == (12, 12) and kv.v_dims == (8, 8)),
    "gpt_bigcode_mqa": (lambda: build_tiny_model("gpt_bigcode"), None, lambda kv: kv.num_kv_heads == (1, 1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_named_models_are_token_identical(name):
    make, make_without, layout_ok = CASES[name]
    model = make()
    ps = prompts()
    eos = early_eos(model, ps)
    refs = [reference(model, p, eos) for p in ps]
    assert any(len(r) < MAX_NEW for r in refs), "the EOS must end some sample early"
    if make_without is not None:  # the feature matters on these prompts: ignoring it would be caught
        plain = make_without()
        assert [reference(plain, p, eos) for p in ps] != refs
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos])
    for block in (16, 5):
        for mode in ("fixed_slot", "full_group"):
            engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, max_active_sequences=2, block_size=block,
                                                       kv_cache_tokens=1024, max_prefill_tokens=12))
            if layout_ok is not None:
                assert layout_ok(engine.pool.layout), engine.pool.layout
            got = engine.generate(ps, G, sampling).completion_ids
            assert got == [r for r in refs for _ in range(G)], (mode, block)


@pytest.mark.parametrize(
    "model_type, overrides, match",
    [
        ("qwen3_next", {}, "layer types 'linear_attention'"),  # hybrid: gated delta-net + attention
        ("mamba", {}, "layer types 'linear_attention'"),  # pure SSM (an AttributeError before)
        ("rwkv", {}, "stateful non-attention mixers \\(RwkvFeedForward, RwkvSelfAttention\\)"),
        ("bloom", {}, "instead of calling transformers' `AttentionInterface`"),  # ALiBi in its own attention
        ("gptj", {}, "instead of calling transformers' `AttentionInterface`"),
        ("stablelm", {}, "receives no `paged_ctx`"),  # decoder layer drops **kwargs
        ("diffllama", {}, "calls the attention function 2 times"),
        ("roberta", {}, "does not number positions 0, 1, 2"),  # positions start after the padding index
        ("bart", {}, "ignores `position_ids`"),  # positions from the cache length
        ("hy_v4", {}, "'indexed_attention'"),
        ("doge", {}, "carries an additive bias"),  # learned dynamic mask
    ],
)
def test_unsupported_models_are_refused_up_front(model_type, overrides, match):
    model = build_tiny_model(model_type, **overrides)
    with pytest.raises(ValueError, match=match) as info:
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    assert f"`{model.config.model_type}`" in str(info.value) and "use_vllm=True" in str(info.value)


class _RunningSum(torch.nn.Module):
    """A token mixer with state outside any KV cache: position t sees the sum of inputs 0..t."""

    def __init__(self, inner: torch.nn.Module | None = None, hidden: int = 32):
        super().__init__()
        self.inner = inner
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, hidden_states, *args, **kwargs):
        mixed = self.proj(hidden_states.cumsum(dim=1))
        if self.inner is None:  # stands in for self-attention: (output, weights)
            return mixed, None
        return self.inner(hidden_states) + mixed


def test_a_layer_without_attention_is_refused():
    """Layer 1's attention replaced by a recurrent mixer the class-name and layer-type checks do not know."""
    from _models import tiny_model

    model = tiny_model("llama")
    model.model.layers[1].self_attn = _RunningSum()
    with pytest.raises(ValueError, match=r"decoder layers \[1\] run no attention .* holds .*_RunningSum"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))


def test_state_hidden_inside_a_layer_fails_the_exactness_check():
    """Attention routes cleanly, but layer 0's MLP also mixes tokens: only prefill + decode against the model's own
    forward can see it."""
    from _models import tiny_model

    model = tiny_model("llama")
    model.model.layers[0].mlp = _RunningSum(model.model.layers[0].mlp)
    with pytest.raises(ValueError, match="does not reproduce the model's own forward .* keeps state"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
