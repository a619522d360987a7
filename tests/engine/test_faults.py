"""Faults a user runs into (issue 24), each reproduced: divided rollout after a prompt was evicted, two threads on one
engine, interrupted calls, non-finite logits, unbounded per-call tables, non-finite budgets, out-of-range seeds."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from _models import reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine import NonFiniteLogitsError, NonFiniteModelError

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _prompts(lengths, seed=1, low=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, 96, (n,), generator=gen).tolist() for n in lengths]


def _model_state(model):
    return model.training, [m.training for m in model.modules()], model.config._attn_implementation


# ---------------------------------------------------------------------------------------------------- divided rollout
@pytest.mark.parametrize("mode, slots", [("fixed_slot", 4), ("dynamic_slot", 8)])
def test_divided_rollout_with_evicted_prompts_is_greedy_identical(model, mode, slots):
    """Issue 24's case: 4 prompts of 5/37/16/64 tokens, G=8, 60 tokens, chunks of 8 in a 160-token pool under `seer`.
    A parked sample whose prompt is evicted, prefilled again into other blocks and re-admitted in one scheduling
    pass must decode against the new prompt blocks (its static decode row was kept with the old ones: rows of
    group 3 diverged from `generate` with `fixed_slot`)."""
    prompts = _prompts((5, 37, 16, 64))
    engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, scheduler="seer", chunk_tokens=8,
                                               kv_cache_tokens=160, max_active_sequences=slots))
    result = engine.generate(prompts, 8, SamplingParams(max_new_tokens=60, temperature=0.0))
    assert result.stats.prompt_evictions > 0  # the case happened
    assert result.completion_ids == [reference_greedy(model, p, 60, []) for p in prompts for _ in range(8)]


def test_reference_greedy_keeps_prompt_tokens_equal_to_the_pad_id(model):
    """The test helper passes the attention mask: `generate` would otherwise mask prompt tokens equal to
    `pad_token_id` (0) and the reference itself would be wrong."""
    prompt = [0, 5, 0, 7, 9]
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                              pad_token_id=1)[0, 5:].tolist()
    assert reference_greedy(model, prompt, 5, []) == expected


# ---------------------------------------------------------------------------------------------------- one caller
def test_two_threads_on_one_engine_are_serialised_and_exact(model):
    """Two threads call `generate` on one engine at once (each step sleeps, so the calls overlap): no crash, both
    results greedy-identical to `generate`, and the model keeps its own attention implementation and mode."""
    model.train()
    before = _model_state(model)
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=512, block_size=4, max_active_sequences=4))
    prompts = [_prompts((7, 12), seed=2), _prompts((9, 4, 5), seed=3)]
    results, errors = [None, None], []
    start = threading.Barrier(2)

    def run(i):
        try:
            start.wait()
            results[i] = engine.generate(prompts[i], 3, SamplingParams(max_new_tokens=10, temperature=0.0),
                                         on_decode_step=lambda batch, s: time.sleep(0.002))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert results[i].completion_ids == [reference_greedy(model, p, 10, []) for p in prompts[i] for _ in range(3)]
    assert _model_state(model) == before
    model.eval()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 5)  # the model's own path still works
    RolloutEngine(model, EngineConfig(kv_cache_tokens=64, block_size=4))  # and a new engine can be built


def test_a_call_from_inside_a_call_is_refused(model):
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    before = _model_state(model)

    def reenter(prompt_idx, sample_idx, ids):
        engine.generate([[5, 6]], 1, GREEDY)

    with pytest.raises(RuntimeError, match="one engine call per model at a time"):
        engine.generate([[5, 6, 7]], 2, GREEDY, on_sample_finished=reenter)
    assert _model_state(model) == before and engine.pool.allocator.num_used == 0
    assert engine.generate([[5, 6, 7]], 2, GREEDY).completion_ids == [reference_greedy(model, [5, 6, 7], 6, [])] * 2


# ---------------------------------------------------------------------------------------------------- interrupted calls
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_an_interrupted_call_frees_its_blocks_and_tables_at_once(model, exc):
    """An exception (or Ctrl-C) in a callback ends the call: its KV blocks and the predictor's per-call entries are
    released right away, not at the next call, and the model is as it was."""
    model.train()
    before = _model_state(model)
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=512, block_size=4, max_active_sequences=4,
                                               history_fallback="siblings+prefix", prefix_predictor_k=2))
    prompts = _prompts((6, 9, 4), seed=4)
    engine.generate(prompts, 4, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))  # history to predict from
    steps = []

    def stop(batch, seconds):
        steps.append(1)
        if len(steps) == 4:
            raise exc("stop")

    with pytest.raises(exc):
        engine.generate(prompts, 4, SamplingParams(max_new_tokens=8, temperature=1.0, seed=2), on_decode_step=stop)
    assert engine.pool.allocator.num_used == 0
    pred = engine.predictor
    assert pred.predictions == {} and pred._first == {} and pred.prefix.features == {}
    assert pred.scores.call == [] and all(s.call == [] for s in pred.source_scores.values())
    assert _model_state(model) == before
    model.eval()


def test_per_call_tables_stay_bounded_over_many_calls(model):
    """The predictor's scores are running sums: after many calls nothing per sample or per call is left over (the
    issue saw three error lists grow by one entry per finished sample)."""
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4, max_active_sequences=2,
                                               history_fallback="siblings"))
    for call in range(12):
        engine.generate([[5, 6, 7], [8, 9]], 2, SamplingParams(max_new_tokens=3, temperature=1.0, seed=call))
        pred = engine.predictor
        assert pred.predictions == {} and pred._first == {} and len(pred.scores.call) == 0
        assert all(len(s.call) == 0 for s in pred.source_scores.values()) and len(pred.baseline.call) == 0
    assert pred.scores.count == 12 * 4 and pred.mae is not None


# ---------------------------------------------------------------------------------------------------- non-finite logits
class _NanAfter:
    """Makes the LM head's output NaN from its `after`-th call on (the engine's support check has run by then)."""

    def __init__(self, model, after: int):
        self.calls, self.after = 0, after
        self.handle = model.lm_head.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        self.calls += 1
        return output * float("nan") if self.calls > self.after else output


@pytest.mark.parametrize("vocab", [96, 256])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("after", [0, 3])  # at the prompts' prefill (first tokens), or in a later decode step
def test_non_finite_logits_raise_naming_step_and_sample(vocab, temperature, after):
    """NaN logits raise `NonFiniteLogitsError` (a RuntimeError, as `generate`'s) naming the step and the sample,
    greedy or sampled, whatever the vocabulary size (a multiple of 256 gave NaN log-probs and no error; others an
    index error); the engine is usable again once the model is fixed."""
    model = tiny_model("qwen3", vocab_size=vocab)
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4, max_active_sequences=4))
    hook = _NanAfter(model, after)
    sampling = SamplingParams(max_new_tokens=8, temperature=temperature, seed=3)
    with pytest.raises(NonFiniteLogitsError, match=r"not finite .* engine step \d+ for prompt \d+, sample \d+") as info:
        engine.generate([[5, 6, 7], [8, 9, 10, 11]], 2, sampling)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.token_index == 0) == (after == 0)
    assert engine.pool.allocator.num_used == 0
    hook.handle.remove()
    out = engine.generate([[5, 6, 7]], 2, GREEDY)
    assert out.completion_ids == [reference_greedy(model, [5, 6, 7], 6, [])] * 2
    assert all(math.isfinite(lp) for lps in out.logprobs for lp in lps)


def test_non_finite_logits_raise_with_speculation(model):
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4, speculative_method="ngram",
                                               speculative_adaptive=False))
    hook = _NanAfter(model, 2)
    try:
        with pytest.raises(NonFiniteLogitsError, match="not finite"):
            engine.generate([[5, 6, 5, 6, 5, 6]], 2, SamplingParams(max_new_tokens=8, temperature=1.0))
    finally:
        hook.handle.remove()


def test_a_model_whose_own_forward_is_nan_is_named_as_such():
    """NaN weights: the support check says the model's own forward produced NaN/inf (not that some layer keeps
    state), with an error that is not an `UnsupportedModelError` (the trainer must not fall back for good)."""
    from trl_infinite.engine.model.support import UnsupportedModelError

    model = tiny_model("qwen3")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteModelError, match="model's own forward produced NaN/inf") as info:
        RolloutEngine(model, EngineConfig(kv_cache_tokens=64, block_size=4))
    assert not isinstance(info.value, UnsupportedModelError)


# ---------------------------------------------------------------------------------------------------- config values
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf")])
def test_non_finite_budgets_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="kv_cache_gb.*finite"):
        EngineConfig(kv_cache_gb=value)
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        EngineConfig(kv_cache_fraction=value)


@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, -1])
def test_seeds_outside_64_bits_are_refused(seed):
    """Seeds 0 and 2**64 gave the same samples silently (keys are 64 bits)."""
    with pytest.raises(ValueError, match=r"seed.*\[0, 2\*\*64\)"):
        SamplingParams(seed=seed)


def test_largest_seed_is_distinct_from_zero(model):
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    a = engine.generate([[5, 6, 7]], 4, SamplingParams(max_new_tokens=6, seed=0))
    b = engine.generate([[5, 6, 7]], 4, SamplingParams(max_new_tokens=6, seed=2**64 - 1))
    assert a.completion_ids != b.completion_ids


def test_generate_keys_the_engine_ignores_are_named_in_a_warning():
    with pytest.warns(UserWarning, match=r"\['cache_implementation'\].*ignores them"):
        SamplingParams(generation_kwargs={"cache_implementation": "static"})
