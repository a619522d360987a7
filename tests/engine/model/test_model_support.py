"""The support contract on real `transformers` architectures (tiny random weights, float32): the named models are
token-identical to `model.generate` (greedy, fixed_slot and full_group, block sizes 16 and 5, an early EOS), each
with the feature it needs shown to change the output; models the engine has refused are judged by the contract
whatever the transformers release (refused up front with the clear error, or served token-identically under the same
checks); the refusal reasons that are the engine's own (mixers and hidden state we inject) are checked by name."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from _models import reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.testing.model_matrix import (
    MAX_NEW,
    G,
    causal_lm_types,
    early_eos,
    prompts,
    reference,
    refusal_pattern,
)
from trl_infinite.testing.routing import kwargs_reach_attention
from trl_infinite.testing.tiny_configs import build_tiny_model


def _sharpen(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Scale the query / key projections so attention scores reach the soft-cap."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(factor)
    return model


def _gemma2(cap: float | None) -> torch.nn.Module:
    """Gemma2's own cap (50) with q / k weights x40: attention scores reach |s| ~ 90 on these prompts. Eager
    attention, so that `model.generate` applies the cap on every release (transformers 5.17 runs Gemma2 with SDPA,
    which drops `softcap`; 5.24 no longer allows SDPA for it)."""
    model = build_tiny_model("gemma2", attn_logit_softcapping=cap, query_pre_attn_scalar=8)
    model.set_attn_implementation("eager")
    return _sharpen(model, 40.0)


def _gpt_oss(sinks: float | None) -> torch.nn.Module:
    model = build_tiny_model("gpt_oss")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0 if sinks is None else torch.full_like(p, sinks))
    return model


def _llama4_tuned(tuning: bool) -> torch.nn.Module:
    """Llama 4 with a NoPE layer (layer 0) whose temperature tuning scales queries from index 3 on (floor_scale 4;
    real configs: 8192), strongly (attn_scale 2): the scale is taken from each token's position, where transformers
    takes it from the index in the forward plus the model's own cache length (the engine passes no cache)."""
    model = build_tiny_model("llama4_text", no_rope_layers=[0, 1], attn_temperature_tuning=tuning, floor_scale=4,
                             attn_scale=2.0)
    assert [m.use_rope for m in model.modules() if hasattr(m, "use_rope")] == [False, True]
    return _sharpen(model, 8.0)


# name -> (model, the same weights without the feature (None: no such variant), check of the engine's pool layout)
CASES = {
    "gemma2_softcap": (lambda: _gemma2(50.0), lambda: _gemma2(None), None),
    "llama4_chunked": (lambda: build_tiny_model("llama4_text", attention_chunk_size=4),
                       lambda: build_tiny_model("llama4_text", attention_chunk_size=4,
                                                layer_types=["full_attention", "full_attention"]), None),
    "gpt_oss_sinks": (lambda: _gpt_oss(None), lambda: _gpt_oss(-1e4), None),
    "llama4_temperature_tuning": (lambda: _llama4_tuned(True), lambda: _llama4_tuned(False), None),
    "deepseek_v3_mla": (lambda: build_tiny_model("deepseek_v3"), None,
                        lambda kv: kv.k_dims == (12, 12) and kv.v_dims == (8, 8)),
    "gpt_bigcode_mqa": (lambda: build_tiny_model("gpt_bigcode"), None, lambda kv: kv.num_kv_heads == (1, 1)),
}


def _assert_token_identical(model: torch.nn.Module, layout_ok=None) -> None:
    """The matrix's served checks: greedy, fixed_slot and full_group, block sizes 16 and 5, G samples of every prompt
    with an EOS that ends some early, equal to `model.generate`."""
    ps = prompts()
    eos = early_eos(model, ps)
    refs = [reference(model, p, eos) for p in ps]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[] if eos is None else [eos])
    for block in (16, 5):
        for mode in ("fixed_slot", "full_group"):
            engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, max_active_sequences=2, block_size=block,
                                                       kv_cache_tokens=1024, max_prefill_tokens=12))
            if layout_ok is not None:
                assert layout_ok(engine.pool.layout), engine.pool.layout
            got = engine.generate(ps, G, sampling).completion_ids
            assert got == [r for r in refs for _ in range(G)], (mode, block)


@pytest.mark.parametrize("name", list(CASES))
def test_named_models_are_token_identical(name):
    make, make_without, layout_ok = CASES[name]
    model = make()
    if not kwargs_reach_attention(model):  # the engine's precondition (`testing/routing.py`)
        pytest.skip(f"transformers {transformers.__version__} does not route `{name}`'s attention kwargs")
    ps = prompts()
    eos = early_eos(model, ps)
    refs = [reference(model, p, eos) for p in ps]
    assert any(len(r) < MAX_NEW for r in refs), "the EOS must end some sample early"
    if make_without is not None:  # the feature matters on these prompts: ignoring it would be caught
        plain = make_without()
        assert [reference(plain, p, eos) for p in ps] != refs
    _assert_token_identical(model, layout_ok)


# Model types the engine refuses on the transformers release `docs/models.md` was made with, one per kind of
# refusal then (hybrid, pure SSM, RWKV, attention in its own modules, kwargs dropped, two attention calls, padding
# offset positions, positions from the cache length, sparse indexed attention, a learned additive mask). Whether
# each is refused, and for which reason, depends on how the installed transformers implements it (GPT-J moved onto
# the `AttentionInterface` in 5.24 and is served since), so each is judged by the contract, not by the reason.
ONCE_REFUSED = ("qwen3_next", "mamba", "rwkv", "bloom", "gptj", "stablelm", "diffllama", "roberta", "bart", "hy_v4",
                "doge")


@pytest.mark.parametrize("model_type", ONCE_REFUSED)
def test_once_refused_models_meet_the_contract(model_type):
    """Refused when the engine is built, with the error naming the model type, a reason and `use_vllm=True`; or,
    where the installed transformers lets the engine serve it, token-identical under the named models' checks;
    skipped, named, where the release does not have the type."""
    if model_type not in causal_lm_types():
        pytest.skip(f"`{model_type}` is not a causal-LM type of transformers {transformers.__version__}")
    model = build_tiny_model(model_type)
    try:
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    except ValueError as exc:
        assert re.search(refusal_pattern(model.config.model_type), str(exc)), str(exc)
        return
    _assert_token_identical(model)


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


# Refusal reasons that are the engine's own, each caused by a change we make to a tiny Llama (which the engine serves),
# so that they hold whatever transformers does with the models that once showed them.
class _Twice(torch.nn.Module):
    """Runs the wrapped attention twice per forward (as differential attention does) and averages."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        a, b = self.inner(*args, **kwargs), self.inner(*args, **kwargs)
        return (a[0] + b[0]) / 2, None


class _DropKwargs(torch.nn.Module):
    """Passes the wrapped attention only what it names, dropping the rest of the kwargs (as StableLM's layers did)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return self.inner(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask)


def _llama_with(change) -> torch.nn.Module:
    from _models import tiny_model

    model = tiny_model("llama")
    change(model)
    return model


def _refusal(model) -> str:
    with pytest.raises(ValueError) as info:
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    assert re.search(refusal_pattern("llama"), str(info.value)), str(info.value)
    return str(info.value)


def test_unchanged_llama_is_served():
    """The model the changes below start from is served: each refusal below is caused by its change."""
    RolloutEngine(_llama_with(lambda m: None), EngineConfig(kv_cache_tokens=256, block_size=4))


def test_a_linear_attention_layer_type_is_refused():
    def change(m):
        m.config.layer_types = ["linear_attention", "full_attention"]
    assert "layer types 'linear_attention' (layers [0])" in _refusal(_llama_with(change))


def test_a_stateful_mixer_module_is_refused():
    class MambaMixer(_RunningSum):  # a name the structural check knows as a recurrent mixer
        pass

    def change(m):
        m.model.layers[0].self_attn = MambaMixer()
    assert "stateful non-attention mixers (MambaMixer)" in _refusal(_llama_with(change))


def test_attention_computed_in_its_own_modules_is_refused():
    def change(m):
        for layer in m.model.layers:
            layer.self_attn = _RunningSum()
    assert "computes attention inside its own modules" in _refusal(_llama_with(change))


def test_attention_called_twice_per_forward_is_refused():
    def change(m):
        m.model.layers[1].self_attn = _Twice(m.model.layers[1].self_attn)
    assert "LlamaAttention calls the attention function 2 times per forward" in _refusal(_llama_with(change))


def test_attention_kwargs_dropped_by_a_layer_are_refused():
    def change(m):
        m.model.layers[0].self_attn = _DropKwargs(m.model.layers[0].self_attn)
    assert "LlamaAttention receives no `paged_ctx`" in _refusal(_llama_with(change))


def _on_position_ids(m, edit) -> None:
    """Have the decoder stack see `edit(position_ids)` in place of the `position_ids` it is called with."""
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = edit(kwargs["position_ids"])
        return args, kwargs
    m.model.register_forward_pre_hook(hook, with_kwargs=True)


def test_ignored_position_ids_are_refused():
    """`position_ids` dropped (the model counts positions itself, as BART-style decoders do)."""
    assert "ignores `position_ids`" in _refusal(_llama_with(lambda m: _on_position_ids(m, lambda p: None)))


def test_temperature_tuning_is_handed_back_after_nested_and_failed_forwards():
    """While the engine runs, Llama 4's NoPE layers leave their temperature tuning to the paged attention function
    (scaled by position); a nested block (a draft model that is the target) keeps the outer block's state, and the
    model gets its own scaling back after the block, also when it raises."""
    from trl_infinite.engine.attention import paged_attention, temperature_tuned

    model = _llama4_tuned(True)
    tuned = temperature_tuned(model)
    assert len(tuned) == 1 and temperature_tuned(_llama4_tuned(False)) == []
    state = lambda: [(m.attn_temperature_tuning, getattr(m, "paged_temperature_tuning", False)) for m in tuned]  # noqa: E731
    with paged_attention(model, tuned=tuned):
        with paged_attention(model, tuned=tuned):
            assert state() == [(False, True)]
        assert state() == [(False, True)]
    assert state() == [(True, False)]
    with pytest.raises(RuntimeError), paged_attention(model, tuned=tuned):
        raise RuntimeError
    assert state() == [(True, False)]


def test_auto_backend_falls_back_to_torch_where_triton_is_not_exact(monkeypatch, caplog):
    """"auto" means the fastest exact backend: where the Triton kernels fail the exactness check (seen on an H100
    for bf16 models) and the torch reference passes, the engine runs the torch backend, with a warning; an explicit
    "triton" stays refused."""
    import logging

    from trl_infinite.engine.attention.torch_backend import torch_paged_attention
    from trl_infinite.engine.model import support as support_mod

    real = support_mod.exactness_problem

    def triton_inexact(model, support, backend, ids, **kw):
        return "relative logit error 1e-1 (planted)" if backend in ("auto", "triton") else real(
            model, support, backend, ids, **kw)

    monkeypatch.setattr(support_mod, "exactness_problem", triton_inexact)
    monkeypatch.setattr(support_mod, "_auto_is_triton", lambda backend, device: backend == "auto")
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="trl_infinite.engine.model.support"):
        engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4, attention_backend="auto"))
    assert engine.support.attention_backend == "torch" and engine.runner.backend.attend is torch_paged_attention
    assert "planted" in caplog.text and "torch backend" in caplog.text
    out = engine.generate([[3, 4, 5]], 2, SamplingParams(max_new_tokens=4, temperature=0.0)).completion_ids
    assert out == [reference_greedy(model, [3, 4, 5], 4, [])] * 2
    with pytest.raises(ValueError, match="planted"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4, attention_backend="triton"))
