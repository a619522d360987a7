"""Input validation at `generate` and in the configs (each bad input a `ValueError` naming the argument), and the
model's mode: the engine samples from the eval-mode model and gives the caller's mode back."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from _models import reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams

VOCAB = 96  # tests/_models.py
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(tiny_model("qwen3"), EngineConfig(kv_cache_tokens=256, block_size=4))


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[5, VOCAB]], rf"prompt_ids\[0\].*{VOCAB}.*vocabulary"),  # id == vocab (an embedding IndexError before)
        ([[5, 6], [7, -1]], r"prompt_ids\[1\].*-1.*vocabulary"),
        ([[1.5, 2.7]], r"prompt_ids\[0\]\[0\].*float"),  # silently truncated to [1, 2] before
        ([[1, 2.0]], r"prompt_ids\[0\]\[1\].*float"),
        ([[True, False]], r"prompt_ids\[0\]\[0\].*bool"),
        ("hello world", "prompt_ids.*string"),
        (["hello world"], r"prompt_ids\[0\].*str"),
        ([[[1, 2]]], r"prompt_ids\[0\]\[0\].*list"),
        (torch.tensor([[1.0, 2.0]]), "prompt_ids.*dtype"),
        (np.array([[1.0, 2.0]]), "prompt_ids.*dtype"),
        (torch.tensor([[True]]), "prompt_ids.*dtype"),
        (5, "prompt_ids.*int"),
    ],
)
def test_bad_prompts_name_the_argument(engine, prompts, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, 2, GREEDY)


def test_tensor_and_numpy_prompts_are_converted(engine):
    want = engine.generate([[5, 6, 7], [8, 9, 10]], 2, GREEDY).completion_ids
    assert engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), 2, GREEDY).completion_ids == want
    assert engine.generate(np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int32), 2, GREEDY).completion_ids == want
    assert engine.generate([torch.tensor([5, 6, 7]), np.array([8, 9, 10])], 2, GREEDY).completion_ids == want
    assert engine.generate([(5, 6, 7), [np.int64(8), 9, 10]], 2, GREEDY).completion_ids == want


@pytest.mark.parametrize(
    "eos, match",
    [("<eos>", "eos_token_ids.*str"), ([-1], "eos_token_ids.*>= 0"), ([2.5], "eos_token_ids.*float"),
     ([True], "eos_token_ids.*bool"), (["<eos>"], "eos_token_ids.*str"), (1.0, "eos_token_ids.*float")],
)
def test_bad_eos_ids_name_the_argument(eos, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(eos_token_ids=eos)


def test_eos_outside_the_vocabulary(engine):
    with pytest.raises(ValueError, match=rf"eos_token_ids.*{VOCAB}.*vocabulary"):
        engine.generate([[5, 6]], 1, SamplingParams(max_new_tokens=4, eos_token_ids=[VOCAB]))


def test_eos_int_and_tensor_are_accepted():
    assert SamplingParams(eos_token_ids=7).eos_token_ids == [7]
    assert SamplingParams(eos_token_ids=torch.tensor([7, 8])).eos_token_ids == [7, 8]
    assert SamplingParams(eos_token_ids=None, max_new_tokens=3).eos_token_ids == []


@pytest.mark.parametrize(
    "field",
    ["block_size", "max_active_sequences", "kv_cache_tokens", "kv_cache_cpu_tokens", "max_prefill_tokens",
     "prefix_predictor_k", "chunk_tokens", "speculative_num_tokens"],
)
@pytest.mark.parametrize("value", [2.5, 16.0, True])
def test_engine_config_integer_fields_reject_floats_and_bools(field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be an integer"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=4.0), dict(max_new_tokens=True), dict(top_k=2.0),
                                    dict(seed=True), dict(top_p="0.9"), dict(min_p=None)])
def test_sampling_params_integer_and_number_fields(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_num_generations_rejects_bool(engine):
    with pytest.raises(ValueError, match="num_generations"):
        engine.generate([[5, 6]], True, GREEDY)


def test_train_mode_dropout_is_off_and_the_mode_restored(monkeypatch):
    """OPT with dropout 0.3 (hidden states and attention) and layer drop 0.3 left in train mode: greedy equals
    `generate` of the eval-mode model, twice, and every module's mode is given back (one submodule deliberately kept
    in eval by the caller stays so). OPT, not GPT-2: transformers 5.0's GPT-2 drops the attention kwargs (refused)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2, ffn_dim=64,
                    num_attention_heads=4, max_position_embeddings=128, dropout=0.3, attention_dropout=0.3,
                    layerdrop=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = OPTForCausalLM(cfg).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    refs = [reference_greedy(model, p, 10, []) for p in prompts]
    model.train()
    model.model.decoder.layers[1].eval()  # a caller's own mixed state
    modes = {name: m.training for name, m in model.named_modules()}
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0)
    for _ in range(2):
        assert engine.generate(prompts, 2, sampling).completion_ids == [r for r in refs for _ in range(2)]
        assert {name: m.training for name, m in model.named_modules()} == modes
    with pytest.raises(ValueError):
        engine.generate([[5, VOCAB + 3]], 1, sampling)
    assert {name: m.training for name, m in model.named_modules()} == modes

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "forward", fail)  # an error inside the call: mode restored on the way out
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(prompts, 1, sampling)
    assert {name: m.training for name, m in model.named_modules()} == modes


# ---------------------------------------------------------------------------------------------------- issue 40, item 7
@pytest.mark.parametrize("value", ["false", "False", 0, 1, None, np.bool_(False)])
def test_do_sample_must_be_a_bool(value):
    """Regression: `do_sample="false"` (a truthy string) sampled."""
    with pytest.raises(ValueError, match="`do_sample` must be True or False"):
        SamplingParams(do_sample=value)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {}, GREEDY.__dict__, "greedy", 0.0])
def test_sampling_must_be_sampling_params(engine, sampling):
    """Regression: a dict was an `AttributeError` (and an empty one silently the defaults). As vLLM's `generate`,
    only `SamplingParams` (or None) is accepted."""
    with pytest.raises(ValueError, match="`sampling` must be a `SamplingParams`"):
        engine.generate([[5, 6]], 1, sampling)


def test_sampling_fields_set_after_construction_are_checked(engine):
    sp = SamplingParams(max_new_tokens=4)
    sp.do_sample = "false"
    with pytest.raises(ValueError, match="do_sample"):
        engine.generate([[5, 6]], 1, sp)
    sp.do_sample, sp.top_p = False, 1.5
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[5, 6]], 1, sp)


def _forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    return calls


ID_KWARGS = {
    "forced_eos_token_id": VOCAB, "forced_bos_token_id": VOCAB, "suppress_tokens": [3, VOCAB],
    "begin_suppress_tokens": [VOCAB, 7], "bad_words_ids": [[4], [5, VOCAB]], "sequence_bias": [[[VOCAB], 1.0]],
}


@pytest.mark.parametrize("key", sorted(ID_KWARGS))
def test_generation_kwarg_ids_beyond_the_vocabulary_are_refused_before_the_call(key):
    """Regression: `forced_eos_token_id` beyond the vocabulary was an `IndexError` at the last step (and an
    out-of-vocabulary `suppress_tokens` id silently ignored). Refused before any forward, naming the key."""
    model = tiny_model("qwen3")
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    calls = _forwards(model)
    sp = SamplingParams(max_new_tokens=4, eos_token_ids=[2], generation_kwargs={key: ID_KWARGS[key]})
    with pytest.raises(ValueError, match=rf"generation_kwargs\['{key}'\].*{VOCAB}.*vocabulary"):
        engine.generate([[5, 6, 7]], 2, sp)
    assert not calls


@pytest.mark.parametrize("kwargs, match", [
    ({"suppress_tokens": [1.5]}, r"\['suppress_tokens'\].*float"),
    ({"forced_eos_token_id": True}, r"\['forced_eos_token_id'\].*bool"),
    ({"bad_words_ids": [[-1]]}, r"\['bad_words_ids'\].*-1"),
    ({"bad_words_ids": [3]}, r"\['bad_words_ids'\].*list of token-id lists"),
    ({"begin_suppress_tokens": ["a"]}, r"\['begin_suppress_tokens'\].*str"),
    ({"exponential_decay_length_penalty": (2, 1.5)}, r"exponential_decay_length_penalty.*EOS"),
])
def test_generation_kwarg_types_and_companions_are_refused_naming_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(max_new_tokens=4, generation_kwargs=kwargs)


def test_processor_argument_errors_come_before_the_call():
    """`generate`'s own processor checks (an empty `bad_words_ids`) run when the call starts, before any forward."""
    model = tiny_model("qwen3")
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    calls = _forwards(model)
    with pytest.raises(ValueError, match="bad_words_ids"):
        engine.generate([[5, 6]], 1, SamplingParams(max_new_tokens=4, generation_kwargs={"bad_words_ids": []}))
    assert not calls


@pytest.mark.parametrize("kwargs", [
    {"forced_eos_token_id": VOCAB - 1}, {"forced_bos_token_id": 0}, {"suppress_tokens": [0, VOCAB - 1]},
    {"begin_suppress_tokens": [0, VOCAB - 1]}, {"bad_words_ids": [[0], [VOCAB - 1], [5, 6]]},
    {"sequence_bias": [[[0], 2.0], [[VOCAB - 1], 3.0]]}, {"min_new_tokens": 9},
    {"exponential_decay_length_penalty": (1, 1.5)},
])
def test_generation_kwargs_at_the_vocabulary_edges_give_generates_tokens(engine, kwargs):
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_ids=[VOCAB - 1, 0], generation_kwargs=kwargs)
    model = engine.model
    for prompt in ([7], [5, 6, 7]):
        ids = torch.tensor([prompt])
        try:
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                  eos_token_id=[VOCAB - 1, 0], pad_token_id=0, **kwargs)[0, len(prompt):].tolist()
        except ValueError as refused:  # an edge this transformers refuses (5.0: token 0 in `sequence_bias`)
            with pytest.raises(ValueError, match=re.escape(str(refused))):
                engine.generate([prompt], 1, sp)
            continue
        want = want[: next((i + 1 for i, t in enumerate(want) if t in (0, VOCAB - 1)), len(want))]
        assert engine.generate([prompt], 1, sp).completion_ids == [want]


def test_forced_eos_with_max_new_tokens_none_forces_it_at_the_models_limit():
    """`max_new_tokens=None` runs to `max_position_embeddings`: `forced_eos_token_id` is forced at that limit (not at
    `GenerationConfig`'s default `max_length` of 20)."""
    model = tiny_model("qwen3", max_position_embeddings=28)
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=256, block_size=4))
    sp = SamplingParams(max_new_tokens=None, temperature=0.0, eos_token_ids=[2],
                        generation_kwargs={"forced_eos_token_id": 2, "min_new_tokens": 24})
    (out,) = engine.generate([[5, 6, 7]], 1, sp).completion_ids
    assert len(out) == 25 and out[-1] == 2 and 2 not in out[:-1]


def test_text_config_of_a_model_a_config_and_a_multimodal_config():
    from transformers import LlavaConfig

    from trl_infinite.engine.config.inputs import text_config

    model = tiny_model("qwen3")
    assert text_config(model) is model.config and text_config(model.config) is model.config
    llava = LlavaConfig()
    assert text_config(llava) is llava.text_config is not llava  # the language model's part of a multimodal config
