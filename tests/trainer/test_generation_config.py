"""`trainer/generation_config.py`: `generation_kwargs` keys the engine runs go through transformers' processors; keys it
cannot run (beam search) make the trainer generate with TRL's own path, with one warning naming them."""

import warnings

import pytest
import torch
from _models import tiny_model
from trainer_helpers import cpu_args, token_sum_reward

from trl_infinite.trainer import InfiniteGRPOTrainer


def build(tmp_path, tokenizer, dataset, **overrides):
    args = cpu_args(tmp_path, rollout_max_active_sequences=2, **overrides)
    return InfiniteGRPOTrainer(model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward, args=args,
                               train_dataset=dataset, processing_class=tokenizer)


def repeated_bigrams(ids: list[int]) -> bool:
    grams = list(zip(ids, ids[1:]))
    return len(grams) != len(set(grams))


def test_no_repeat_ngram_size_trains_through_the_engine(tmp_path, tokenizer, dataset, monkeypatch):
    rows = []
    original = InfiniteGRPOTrainer._generate_single_turn

    def recording(self, prompt_ids, *args, **kwargs):
        completions, logprobs = original(self, prompt_ids, *args, **kwargs)
        rows.extend(zip(prompt_ids, completions))
        return completions, logprobs

    monkeypatch.setattr(InfiniteGRPOTrainer, "_generate_single_turn", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning
        trainer = build(tmp_path, tokenizer, dataset, generation_kwargs={"no_repeat_ngram_size": 2},
                        max_completion_length=16, per_device_train_batch_size=8)
    assert trainer.uses_engine
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert "rollout/decode_steps" in trainer.state.log_history[0]
    assert len(rows) == 8 and sum(len(c) for _, c in rows) > 8
    assert not any(repeated_bigrams(list(p) + c) for p, c in rows)  # as `generate` on each row's context
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_beam_search_falls_back_to_trl_generation_with_one_warning(tmp_path, tokenizer, dataset):
    with pytest.warns(UserWarning, match=r"TRL's own path.*\['num_beams'\]") as record:
        trainer = build(tmp_path, tokenizer, dataset, generation_kwargs={"no_repeat_ngram_size": 2, "num_beams": 2})
    assert len([w for w in record if "TRL's own path" in str(w.message)]) == 1
    assert not trainer.uses_engine
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    log = trainer.state.log_history[0]
    assert "rollout/decode_steps" not in log and torch.isfinite(torch.tensor(log["loss"]))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_generation_config_reaches_the_engine(tmp_path, tokenizer, dataset):
    """TRL's settings, `generation_kwargs` and the model's own generation config, merged as `generate` merges them."""
    from trl_infinite.trainer.generation_config import effective_generation_config, engine_sampling_params

    trainer = build(tmp_path, tokenizer, dataset, temperature=0.7, top_k=5, repetition_penalty=1.2,
                    generation_kwargs={"typical_p": 0.9, "suppress_tokens": [3], "max_new_tokens": 5})
    trainer.model.generation_config.no_repeat_ngram_size = 3  # unset by TRL: `generate` takes the model's value
    config = effective_generation_config(trainer.model, trainer.generation_config)
    params = engine_sampling_params(config, trainer.max_completion_length, trainer.eos_token_ids, seed=0)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_new_tokens) == (0.7, 5, 1.2, 5)
    expected = {"typical_p": 0.9, "suppress_tokens": [3], "no_repeat_ngram_size": 3}
    assert {k: params.generation_kwargs.get(k) for k in expected} == expected  # (neutral keys such as pad too)
    assert params.eos_token_ids[: len(trainer.eos_token_ids)] == trainer.eos_token_ids


def test_only_zero3_without_gathering_falls_back_to_trl_generation():
    """FSDP (1 and 2) runs the engine on weights gathered for the rollout (`full_weights.py`); ZeRO-3 with
    `ds3_gather_for_generation=False` all-gathers inside every forward (ranks would need equal step counts): TRL's
    path, with a reason naming the setting that lets the engine run."""
    from types import SimpleNamespace

    from trl_infinite.trainer.generation_config import engine_fallback_reasons

    model = tiny_model("qwen3")
    plain = SimpleNamespace(is_fsdp=False, is_zero3=False)
    assert engine_fallback_reasons(model, None, plain) == []
    assert engine_fallback_reasons(model, None, SimpleNamespace(is_fsdp=False, is_zero3=True), ds3_gather=True) == []
    assert engine_fallback_reasons(model, None, SimpleNamespace(is_fsdp=True, is_zero3=False)) == []
    (zero3,) = engine_fallback_reasons(model, None, SimpleNamespace(is_fsdp=False, is_zero3=True), ds3_gather=False)
    assert "ds3_gather_for_generation=False" in zero3 and "ds3_gather_for_generation=True" in zero3
