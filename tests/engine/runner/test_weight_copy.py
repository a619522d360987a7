"""Rollout weights in the autocast dtype (`engine/runner/weight_copy.py`, `weight_copy`): float32 weights under 16-bit
autocast run each rollout on a 16-bit copy of the tensors autocast casts.

- Only what autocast casts is copied (Linear weights and biases, the `lm_head` tied to the embedding included);
  norms and embeddings stay the float32 Parameters, also during the call.
- Exact: greedy output, per-token log-probs and every forward's logits of the engine on the copy equal the engine on
  the float32 weights and `model.generate` under the same autocast (bf16 and fp16, tied and untied heads, Qwen2's
  biases, a LoRA model, sampled output).
- Freed: after `generate` every module holds its float32 Parameter again and no copy tensor is alive; with
  `keep_pool=True` the copy is kept (same storage, not re-made) until `release_pool()`, refreshed in place when the
  weights change.
- Budget: the copy's bytes are reserved in the KV budget while it is not held; `RolloutStats.weight_copy_bytes`.
- When it is off: 'off', no autocast, 16-bit weights; a model that reads a Linear weight outside
  autocast's casts fails the construction check and runs on its float32 weights, with a warning.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _models import requires_compile, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.runner.weight_copy import WeightCopy, build_weight_copy, copy_targets
from trl_infinite.testing.model_matrix import MAX_NEW, G, early_eos, prompts, reference
from trl_infinite.testing.tiny_configs import build_tiny_model, sizes

BF16 = torch.bfloat16


def _config(mode: str, **kw) -> EngineConfig:
    return EngineConfig(**{"kv_cache_tokens": 1024, "block_size": 4, "max_active_sequences": 2,
                           "weight_copy": mode, **kw})


class _Recorder:
    """Every forward's logits (the `lm_head` output) and weak references to the weights it ran on."""

    def __init__(self, model):
        self.logits: list[torch.Tensor] = []
        self.weights: list[weakref.ref] = []
        self.dtypes: set[torch.dtype] = set()
        model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self.logits.append(out.detach().clone())
        self.weights.append(weakref.ref(module.weight))
        self.dtypes.add(module.weight.dtype)


def _model(model_type: str, seed: int, head_dim: int = 16):
    """A tiny model whose norm weights are not all 1 (a 16-bit copy of ones would be exact by chance)."""
    model = build_tiny_model(model_type, seed=seed, size=sizes(head_dim))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _run(model, mode, ps, sampling, dtype=BF16, **kw):
    recorder = _Recorder(model)
    with torch.autocast("cpu", dtype=dtype):
        engine = RolloutEngine(model, _config(mode, **kw))
        recorder.logits, recorder.weights, recorder.dtypes = [], [], set()  # the construction's probe forwards
        result = engine.generate(ps, G, sampling)
    model.lm_head._forward_hooks.clear()
    return engine, result, recorder


def test_only_what_autocast_casts_is_copied():
    model = tiny_model("qwen2", tie_word_embeddings=True)  # Qwen2: q/k/v biases; tied head
    targets = copy_targets(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert {(id(m), n) for m, n, _ in targets} == {(id(m), n) for m in linears for n in ("weight", "bias")
                                                   if getattr(m, n) is not None}
    copy = WeightCopy(model, BF16)
    # the tied head and the embedding are one Parameter: copied once
    assert copy.nbytes == 2 * sum(p.numel() for p in {id(p): p for _, _, p in targets}.values())
    embed = model.model.embed_tokens.weight
    norm = model.model.norm.weight
    copy.refresh()
    with copy.swapped():
        assert model.lm_head.weight.dtype == BF16 and model.model.layers[0].self_attn.q_proj.bias.dtype == BF16
        assert model.model.embed_tokens.weight is embed and norm.dtype == torch.float32
        assert torch.equal(model.lm_head.weight, embed.to(BF16))
    assert model.lm_head.weight is embed and all(getattr(m, n) is p for m, n, p in targets)


CASES = [("llama", 16, 2, BF16, False), ("llama", 16, 1, BF16, True), ("qwen3", 16, 0, torch.float16, False),
         ("qwen2", 16, 2, BF16, True)]


@pytest.mark.parametrize("model_type, head_dim, seed, dtype, tied", CASES,
                         ids=[f"{t}-s{s}-{str(d)[6:]}-{'tied' if tie else 'untied'}" for t, _, s, d, tie in CASES])
def test_greedy_on_the_copy_is_identical(model_type, head_dim, seed, dtype, tied):
    """(Against `generate`: on models and prompts without a near-tie argmax, see tests/engine/runner/test_autocast.py.)"""
    model = _model(model_type, seed, head_dim)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    ps = prompts(seed)
    with torch.autocast("cpu", dtype=dtype):
        eos = early_eos(model, ps)
        refs = [reference(model, p, eos) for p in ps]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos])
    plain, base, base_rec = _run(model, "off", ps, sampling, dtype)
    engine, got, rec = _run(model, "auto", ps, sampling, dtype)
    assert plain.weight_copy is None and engine.weight_copy is not None
    assert got.completion_ids == base.completion_ids == [r for r in refs for _ in range(G)]
    assert got.logprobs == base.logprobs
    assert rec.dtypes == {dtype} and base_rec.dtypes == {torch.float32}
    assert len(rec.logits) == len(base_rec.logits) > MAX_NEW  # prefill and every decode step, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(rec.logits, base_rec.logits))
    assert got.stats.weight_copy_bytes == engine.weight_copy.nbytes > 0 and base.stats.weight_copy_bytes == 0


def test_sampled_output_on_the_copy_is_identical():
    model = _model("llama", 1)
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=20, seed=7)
    _, base, _ = _run(model, "off", prompts(1), sampling)
    _, got, _ = _run(model, "auto", prompts(1), sampling)
    assert got.completion_ids == base.completion_ids and got.logprobs == base.logprobs


def test_lora_model_on_the_copy_is_identical():
    peft = pytest.importorskip("peft")
    model = _model("llama", 1)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                      init_lora_weights=False))
    copied = {id(m) for m, _, _ in copy_targets(lora)}
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert {id(layer.base_layer), id(layer.lora_A["default"]), id(layer.lora_B["default"])} <= copied
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    _, base, _ = _run(lora, "off", prompts(1), sampling)
    engine, got, _ = _run(lora, "auto", prompts(1), sampling)
    assert engine.weight_copy is not None
    assert got.completion_ids == base.completion_ids and got.logprobs == base.logprobs


def test_the_copy_is_freed_after_the_call():
    model = _model("llama", 1)
    originals = {(id(m), n): p for m, n, p in copy_targets(model)}
    engine, _, rec = _run(model, "auto", prompts(1), SamplingParams(max_new_tokens=4, temperature=0.0))
    gc.collect()
    assert rec.dtypes == {BF16} and all(r() is None for r in rec.weights)  # every copy tensor is gone
    assert engine.weight_copy.tensors() == [] and engine.pool.reserve_bytes == engine.weight_copy.nbytes
    assert all(getattr(m, n) is originals[(id(m), n)] for m, n, _ in engine.weight_copy.targets)
    assert all(p.dtype == torch.float32 and isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_the_copy_is_kept_with_the_pool_and_refreshed_when_weights_change():
    model = _model("llama", 1)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    with torch.autocast("cpu", dtype=BF16):
        engine = RolloutEngine(model, _config("auto"))
        copy = engine.weight_copy
        engine.generate(prompts(1), 2, sampling, keep_pool=True)
        held = [t.data_ptr() for t in copy.tensors()]
        assert held and copy.refreshes == 2 and engine._reserve_bytes() == engine.graph_reserve  # (1: the check)
        engine.generate(prompts(1), 2, sampling, keep_pool=True)
        assert copy.refreshes == 2 and [t.data_ptr() for t in copy.tensors()] == held  # unchanged weights: reused
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)  # an optimizer step, in place
        changed = engine.generate(prompts(1), 2, sampling, keep_pool=True)
        assert copy.refreshes == 3 and [t.data_ptr() for t in copy.tensors()] == held  # refreshed in place
        assert torch.equal(copy._copies[id(model.lm_head.weight)], model.lm_head.weight.to(BF16))
        engine.release_pool()
        assert copy.tensors() == []
        fresh = RolloutEngine(model, _config("off")).generate(prompts(1), 2, sampling)
    assert changed.completion_ids == fresh.completion_ids and changed.logprobs == fresh.logprobs


@pytest.mark.parametrize("mode, weights, autocast", [("off", torch.float32, BF16), ("auto", torch.float32, None),
                                                     ("auto", BF16, BF16)])
def test_no_copy_where_it_cannot_help(mode, weights, autocast):
    model = tiny_model("llama").to(weights)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast is not None):
        engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4, weight_copy=mode))
        result = engine.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=2))
    assert engine.weight_copy is None and result.stats.weight_copy_bytes == 0
    assert engine.pool.reserve_bytes == engine.graph_reserve


def test_weight_copy_setting_is_validated():
    with pytest.raises(ValueError, match="`weight_copy`.*'auto', 'off'"):
        EngineConfig(weight_copy="always")


class _ReadsItsWeight(torch.nn.Module):
    """An MLP that also adds a row of its up-projection's weight: an element-wise read autocast does not cast."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states):
        return self.mlp(hidden_states) + self.mlp.up_proj.weight[0]


def test_a_model_computing_differently_on_the_copy_keeps_its_float32_weights():
    model = _model("llama", 1)
    model.model.layers[0].mlp = _ReadsItsWeight(model.model.layers[0].mlp)
    with torch.autocast("cpu", dtype=BF16), pytest.warns(UserWarning, match="it computes differently on a bfloat16"):
        engine = RolloutEngine(model, _config("auto"))
    assert engine.weight_copy is None
    assert all(p.dtype == torch.float32 and isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_a_module_replaced_after_construction_is_copied_as_it_is_now():
    """The targets are found again at every call: a Linear replaced since the engine was built (an adapter, a new
    head) runs on a copy of its own weight, and gets its own Parameter back afterwards."""
    model = _model("llama", 2)
    ps, sampling = prompts(2), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    with torch.autocast("cpu", dtype=BF16):
        engine = RolloutEngine(model, _config("auto"))
        torch.manual_seed(5)
        head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        model.lm_head = head
        ran_on = set()
        hook = head.register_forward_hook(lambda module, args, out: ran_on.add(module.weight.dtype))
        got = engine.generate(ps, 2, sampling)
        hook.remove()
        assert ran_on == {BF16}
        base = RolloutEngine(model, _config("off")).generate(ps, 2, sampling)
    assert model.lm_head is head and isinstance(head.weight, torch.nn.Parameter) and head.weight.dtype == torch.float32
    assert got.completion_ids == base.completion_ids and got.logprobs == base.logprobs


def test_captured_steps_on_the_copy():
    """CUDA graphs (the CPU emulator): the captured step reads the copy. With the pool kept between calls the copy is
    refreshed in place after a weight update: no graph is recaptured for it, and the replays follow the new weights;
    every call's output equals the same captured decoding on the float32 weights."""
    from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs

    model = _model("llama", 2)
    ps, sampling = prompts(2), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    with torch.autocast("cpu", dtype=BF16):
        with emulate_cuda_graphs() as emu:
            engine = RolloutEngine(model, _config("auto", kv_cache_release=False))
        with emulate_cuda_graphs():
            plain = RolloutEngine(model, _config("off", kv_cache_release=False))
        assert engine.decoder.use_graphs and plain.decoder.use_graphs and engine.weight_copy is not None
        outputs = []
        for _ in range(2):
            got, base = engine.generate(ps, 2, sampling), plain.generate(ps, 2, sampling)
            outputs.append((got, base, emu.counts["captures"], [t.data_ptr() for t in engine.weight_copy.tensors()]))
            with torch.no_grad():
                model.lm_head.weight.mul_(-1.0)  # an optimizer step, in place
    (first, base1, captures1, held1), (second, base2, captures2, held2) = outputs
    assert first.completion_ids == base1.completion_ids and second.completion_ids == base2.completion_ids
    assert first.logprobs == base1.logprobs and second.logprobs == base2.logprobs
    assert first.completion_ids != second.completion_ids  # the replays read the refreshed copy
    assert emu.counts["replays"] > 0 and captures1 > 0 and captures2 == captures1 and held2 == held1
    assert not emu.counts["moved_storage"] and engine.decoder.graphs.recaptures == 0


def test_captured_steps_on_a_copy_made_per_call():
    """The default `kv_cache_release=True`: each call backs its copy (and pool) anew and gives the memory back after
    it; both sit at reserved addresses, so the second call replays the first call's graphs on the refreshed copy
    (no capture) and equals the captured float32 decoding."""
    from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs

    model = _model("llama", 2)
    ps, sampling = prompts(2), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    with torch.autocast("cpu", dtype=BF16):
        with emulate_cuda_graphs() as emu:
            engine = RolloutEngine(model, _config("auto"))
        with emulate_cuda_graphs():
            plain = RolloutEngine(model, _config("off"))
        captures = []
        for _ in range(2):
            got, base = engine.generate(ps, 2, sampling), plain.generate(ps, 2, sampling)
            assert got.completion_ids == base.completion_ids and got.logprobs == base.logprobs
            assert engine.weight_copy.tensors() == [] and engine.weight_copy._range.mapped_bytes == 0
            captures.append(got.stats.graph_captures)
            with torch.no_grad():
                model.lm_head.weight.mul_(-1.0)
    assert emu.counts["replays"] > 0 and not emu.counts["moved_storage"]
    assert captures[0] > 0 and captures[1] == 0, captures


@requires_compile
def test_compiled_step_on_the_copy_follows_each_call():
    """`compile=True` (Dynamo, 'eager' backend): the compiled decode step runs on each call's copy, follows a weight
    update between calls, and keeps no copy alive after the call."""
    model = _model("llama", 2)
    ps, sampling = prompts(2), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    with torch.autocast("cpu", dtype=BF16):
        engine = RolloutEngine(model, _config("auto", compile=True, compile_backend="eager"))
        plain = RolloutEngine(model, _config("off"))
        outs = []
        for _ in range(2):
            held: list[weakref.ref] = []

            def step(batch, seconds, held=held):
                held.extend(weakref.ref(t) for t in engine.weight_copy.tensors())

            got = engine.generate(ps, 2, sampling, on_decode_step=step)
            base = plain.generate(ps, 2, sampling)
            assert got.completion_ids == base.completion_ids and got.logprobs == base.logprobs
            outs.append(got.completion_ids)
            gc.collect()
            assert held and all(r() is None for r in held)  # the compiled step holds no copy
            with torch.no_grad():
                model.lm_head.weight.mul_(-1.0)
    assert outs[0] != outs[1]


class _Noisy(torch.nn.Module):
    """An MLP with a nondeterministic output (as atomics can make a GPU forward): the check cannot judge it."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states):
        return self.mlp(hidden_states) + 1e-3 * torch.rand_like(hidden_states)


def test_a_nondeterministic_forward_keeps_its_float32_weights():
    model = _model("llama", 1)
    model.model.layers[0].mlp = _Noisy(model.model.layers[0].mlp)
    with torch.autocast("cpu", dtype=BF16), pytest.warns(UserWarning, match="nondeterministic forward"):
        copy = build_weight_copy(model, "auto", torch.device("cpu"), BF16, model.config.vocab_size)
    assert copy is None
