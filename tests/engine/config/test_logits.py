"""Any `GenerationConfig` key through transformers' own logits processors (`engine/config/logits.py`).

Greedy outputs equal `model.generate` run on each prompt alone (prompts of different lengths decode side by side, so
a processor that saw padding or another row's context would differ); sampled log-probs are those of the processed
distribution `generate` samples from, recomputed with a full forward on each row's context; the fast path is kept
for the common keys; keys the engine cannot run are refused, naming them.
"""

from __future__ import annotations

import pytest
import torch
from _models import frequent_token, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.config.logits import GenerationProcessors, generation_config_of
from trl_infinite.engine.runner.sampler import Sampler

PROMPTS = [[5, 17, 33, 8, 60], [9, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 7, 7]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def engine_for(model, mode: str = "fixed_slot", **overrides) -> RolloutEngine:
    cfg = dict(sampling_mode=mode, max_active_sequences=3, kv_cache_tokens=1024, block_size=4, attention_backend="torch")
    return RolloutEngine(model, EngineConfig(**{**cfg, **overrides}))


def generate_alone(model, prompt: list[int], eos: list[int], **kwargs) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos or None, pad_token_id=0,
        **kwargs,
    )[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


def greedy_cases(model):
    eos = frequent_token(model, PROMPTS)
    plain = generate_alone(model, PROMPTS[1], [eos])  # bad words taken from an unconstrained output
    first = generate_alone(model, PROMPTS[0], [eos])[0]
    return eos, {
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[plain[0]], plain[1:3]]),
        "suppress_tokens": dict(suppress_tokens=[eos, 3, 4]),
        "min_new_tokens": dict(min_new_tokens=6),  # depends on each row's own prompt length
        "begin_suppress_tokens": dict(begin_suppress_tokens=[first]),
        "sequence_bias": dict(sequence_bias={(eos,): -5.0, (20, 21): 3.0}),
        "forced_eos_token_id": dict(forced_eos_token_id=eos),
        "mixed_with_repetition_penalty": dict(no_repeat_ngram_size=3, repetition_penalty=1.4),
    }


@pytest.mark.parametrize(
    "name",
    ["no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "min_new_tokens", "begin_suppress_tokens",
     "sequence_bias", "forced_eos_token_id", "mixed_with_repetition_penalty"],
)
@pytest.mark.parametrize("mode", ["fixed_slot", "full_group"])
def test_greedy_with_processors_matches_generate_on_each_prompt_alone(model, name, mode):
    eos, cases = greedy_cases(model)
    kwargs = dict(cases[name])
    penalty = kwargs.pop("repetition_penalty", 1.0)
    params = SamplingParams(max_new_tokens=MAX_NEW, do_sample=False, eos_token_ids=[eos], repetition_penalty=penalty,
                            generation_kwargs=kwargs)
    result = engine_for(model, mode).generate(PROMPTS, 2, params)
    expected = [generate_alone(model, p, [eos], repetition_penalty=penalty, **kwargs) for p in PROMPTS]
    baseline = [generate_alone(model, p, [eos]) for p in PROMPTS]
    assert expected != baseline  # the processor changes the output
    assert result.completion_ids == [e for e in expected for _ in range(2)]


def test_greedy_processors_with_speculative_decoding_match_generate(model):
    eos, _ = greedy_cases(model)
    kwargs = dict(no_repeat_ngram_size=2, suppress_tokens=[3])
    params = SamplingParams(max_new_tokens=MAX_NEW, do_sample=False, eos_token_ids=[eos], generation_kwargs=kwargs)
    engine = engine_for(model, speculative_method="ngram", speculative_adaptive=False, speculative_num_tokens=3)
    result = engine.generate(PROMPTS, 2, params)
    expected = [generate_alone(model, p, [eos], **kwargs) for p in PROMPTS]
    assert result.completion_ids == [e for e in expected for _ in range(2)]


@torch.no_grad()
def test_sampled_logprobs_are_those_of_the_processed_distribution(model):
    """Every sampled token has the log-probability `generate`'s processors give it on that row's full context
    (recomputed without the engine: a fresh forward over prompt + completion prefix). Tolerance 1e-4 (float32)."""
    kwargs = dict(typical_p=0.9, no_repeat_ngram_size=2, min_new_tokens=3, top_h=0.9, epsilon_cutoff=1e-3)
    eos = frequent_token(model, PROMPTS)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=30, eos_token_ids=[eos], seed=4,
                            generation_kwargs=kwargs)
    result = engine_for(model).generate(PROMPTS, 3, params)
    config = generation_config_of(params)
    checked = 0
    for k, (ids, lps) in enumerate(zip(result.completion_ids, result.logprobs)):
        prompt = PROMPTS[k // 3]
        cfg = GenerationProcessors(model, params, torch.device("cpu")).for_prompt(len(prompt))
        assert cfg  # the list is transformers' own, rebuilt here for this prompt length
        context = torch.tensor([prompt + ids])
        logits = model(context).logits[0].float()  # [L, V]
        for j, (tok, lp) in enumerate(zip(ids, lps)):
            pos = len(prompt) + j - 1  # the logits predicting completion token j
            scores = cfg(context[:, : pos + 1], logits[pos][None].clone())
            ref = torch.log_softmax(scores, dim=-1)[0]
            assert torch.isfinite(ref[tok]), (k, j)
            assert abs(float(ref[tok]) - lp) < 1e-4, (k, j)
            checked += 1
    assert checked > 30 and config.typical_p == 0.9


def test_fast_path_is_kept_for_common_keys(model):
    common = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, repetition_penalty=1.2)
    assert not Sampler(common).has_extra_processors
    with pytest.warns(UserWarning, match="output_scores"):  # named as a key the engine does not honour
        neutral = SamplingParams(generation_kwargs={"output_scores": True, "pad_token_id": 0, "typical_p": 1.0})
    assert not Sampler(neutral, GenerationProcessors(model, neutral, torch.device("cpu"))).has_extra_processors
    extra = SamplingParams(generation_kwargs={"no_repeat_ngram_size": 2})
    sampler = Sampler(extra, GenerationProcessors(model, extra, torch.device("cpu")))
    assert sampler.has_extra_processors and sampler.uses_context


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"num_beams": 2, "length_penalty": -0.1}, ["num_beams"]),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5}, ["num_beams"]),
        ({"prompt_lookup_num_tokens": 3}, ["prompt_lookup_num_tokens"]),
        ({"num_return_sequences": 2}, ["num_return_sequences"]),
        ({"stop_strings": ["x"]}, ["stop_strings"]),
        ({"guidance_scale": 1.5}, ["guidance_scale"]),
    ],
)
def test_keys_the_engine_cannot_run_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match="generation_kwargs") as info:
        SamplingParams(generation_kwargs=kwargs)
    assert str(named) in str(info.value)


def test_contrastive_search_is_refused_naming_penalty_alpha():
    with pytest.raises(ValueError, match=r"\['penalty_alpha'\]"):
        SamplingParams(do_sample=False, top_k=4, generation_kwargs={"penalty_alpha": 0.6})


@pytest.mark.parametrize("kwargs, match", [({"top_k": 5}, "top_k"), ({"eos_token_id": 2}, "eos_token_ids"),
                                           ({"no_such_key": 1}, "no_such_key")])
def test_fields_and_unknown_keys_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(generation_kwargs=kwargs)
