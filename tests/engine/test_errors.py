"""Bad user input raises `ValueError` naming the field (never an assert, an OOM or a silent clamp)."""

from __future__ import annotations

import pytest
from _models import tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def engine(model):
    return RolloutEngine(model, EngineConfig(kv_cache_tokens=64, block_size=4))  # 16 blocks


GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def test_prompt_longer_than_the_pool(engine):
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine.generate([[5] * 3, [5] * 80], 2, GREEDY)


def test_prompt_plus_one_completion_must_fit(engine):
    """A prompt that fits alone but not with one full completion is rejected up front, naming the knobs."""
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[5] * 60], 1, SamplingParams(max_new_tokens=8, temperature=0.0))


def test_budget_smaller_than_one_block(model):
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        RolloutEngine(model, EngineConfig(kv_cache_tokens=3, block_size=4))
    with pytest.raises(ValueError, match="kv_cache_gb"):
        RolloutEngine(model, EngineConfig(kv_cache_gb=1e-9, block_size=4))


def test_both_budgets_given():
    with pytest.raises(ValueError, match="kv_cache_tokens.*kv_cache_gb"):
        EngineConfig(kv_cache_tokens=64, kv_cache_gb=1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(sampling_mode="best_of_g"), "sampling_mode"),
        (dict(sampling_mode="fixed_slot", max_active_sequences=None), "max_active_sequences"),
        (dict(max_active_sequences=0), "max_active_sequences"),
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_tokens=-5), "kv_cache_tokens"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
        (dict(attention_backend="flash9"), "attention_backend"),
        (dict(kv_cache_fraction=1.5), "kv_cache_fraction"),
        (dict(scheduler="no-such-policy"), "scheduler"),
        (dict(batch_policy="no-such-policy"), "batch_policy"),
        (dict(cpu_decode_kernel="yes"), "cpu_decode_kernel.*True or False"),
    ],
)
def test_engine_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_unknown_sampling_mode_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="full_group.*micro_group.*fixed_slot.*dynamic_slot"):
        EngineConfig(sampling_mode="first_g_finishers")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(temperature=-0.1), "temperature"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=None, eos_token_ids=[]), "eos_token_ids"),
        (dict(seed="7"), "seed"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("group_size", [0, -1, 2.0])
def test_group_size_must_be_a_positive_integer(engine, group_size):
    with pytest.raises(ValueError, match="num_generations"):
        engine.generate([[5, 6]], group_size, GREEDY)


def test_empty_prompt_and_empty_prompt_list(engine):
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        engine.generate([[5, 6], []], 2, GREEDY)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([], 2, GREEDY)


def test_bad_forced_lengths(engine):
    with pytest.raises(ValueError, match="forced_lengths"):
        engine.generate([[5, 6]], 2, GREEDY, forced_lengths=[[1]])
    with pytest.raises(ValueError, match="forced_lengths"):
        engine.generate([[5, 6]], 2, GREEDY, forced_lengths=[[1, 0]])


def test_no_block_is_leaked_by_a_rejected_call(engine):
    with pytest.raises(ValueError):
        engine.generate([[5] * 80], 1, GREEDY)
    result = engine.generate([[5, 6, 7]], 2, GREEDY)
    assert [len(c) for c in result.completion_ids] == [4, 4]
    assert engine.pool.allocator.num_used == 0
