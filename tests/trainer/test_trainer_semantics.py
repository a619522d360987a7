"""`GRPOTrainer`'s semantics where users notice them (issue 24): a resumed run equals the uninterrupted one, sampling
log-probs in TRL's convention (off-policy masking keeps on-policy sequences under top-k), generation keys the engine
does not honour are named, a model whose forward is NaN raises instead of silently switching paths."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_model
from datasets import Dataset
from trainer_helpers import PROMPTS, cpu_args, token_sum_reward
from transformers import TrainerCallback

from trl_infinite.engine import NonFiniteModelError
from trl_infinite.trainer import InfiniteGRPOTrainer


def _trainer(tmp_path, tokenizer, dataset, reward_funcs=token_sum_reward, model=None, **overrides):
    return InfiniteGRPOTrainer(model=model if model is not None else tiny_model("qwen3").train(),
                               reward_funcs=reward_funcs, args=cpu_args(tmp_path, **overrides),
                               train_dataset=dataset, processing_class=tokenizer)


class _Crash(TrainerCallback):
    """Stops the run at the start of optimizer step `at` (1-based), as a crash would."""

    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at:
            raise KeyboardInterrupt("crash")


def test_resumed_run_equals_the_uninterrupted_one(tmp_path, tokenizer, dataset):
    """4 steps, a checkpoint every step; a run that crashes at step 3 and resumes from its last checkpoint ends with
    the uninterrupted run's parameters, having sampled the same completions in steps 3 and 4 (the rollout seed
    comes from `state.global_step`, the micro step and the process, not from a call counter that restarts)."""
    seen: dict[str, dict[int, list]] = {"full": {}, "resumed": {}}
    run = ["full"]

    def recording_reward(completion_ids, trainer_state, **kwargs):
        seen[run[0]].setdefault(trainer_state.global_step, []).extend(tuple(c) for c in completion_ids)
        return token_sum_reward(completion_ids)

    kw = dict(max_steps=4, save_strategy="steps", save_steps=1, rollout_max_active_sequences=2)
    full = _trainer(tmp_path / "full", tokenizer, dataset, recording_reward, **kw)
    full.train()
    run[0] = "resumed"
    crashed = _trainer(tmp_path / "resumed", tokenizer, dataset, recording_reward, **kw)
    crashed.add_callback(_Crash(at=3))
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    assert crashed.state.global_step == 2
    seen["resumed"].clear()
    resumed = _trainer(tmp_path / "resumed", tokenizer, dataset, recording_reward, **kw)
    resumed.train(resume_from_checkpoint=True)
    assert sorted(seen["resumed"]) == [2, 3]
    for step in (2, 3):
        assert seen["resumed"][step] == seen["full"][step]
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_off_policy_mask_keeps_on_policy_sequences_under_top_k(tmp_path, tokenizer):
    """top_k=5, T=0.7: the sampling log-probs TRL stores are in its own convention (`log_softmax(logits / T)` of the
    sampled token, no truncation), so on-policy sequences have zero KL and `off_policy_mask_threshold` drops none
    (it dropped 25-50% when the engine handed over the truncated distribution's log-probs)."""
    dataset = Dataset.from_dict({"prompt": PROMPTS[:2]})
    trainer = _trainer(tmp_path, tokenizer, dataset, top_k=5, temperature=0.7, off_policy_mask_threshold=0.01,
                       per_device_train_batch_size=8, max_completion_length=10)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                 batch["completion_ids"].size(1))
    cmask = batch["completion_mask"].float()
    sampling = batch["sampling_per_token_logps"]
    assert ((sampling - logps).abs() * cmask).max() < 1e-4
    keep = trainer.get_off_policy_mask(-torch.ones(len(cmask), 1), logps, sampling, cmask, 0.01)
    assert keep.min().item() == 1.0  # every sequence kept, negative advantages included
    # the processed distribution's log-probs are still what the engine returns as `logprobs`
    engine = trainer._engine
    out = engine.generate([batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()], 2,
                          _sampling(trainer))
    assert all(r <= p + 1e-6 for rs, ps in zip(out.raw_logprobs, out.logprobs) for r, p in zip(rs, ps))


def _sampling(trainer):
    from trl_infinite.trainer.generation_config import effective_generation_config, engine_sampling_params

    config = effective_generation_config(trainer.model, trainer.generation_config)
    return engine_sampling_params(config, 6, trainer.eos_token_ids, 0, logprobs_temperature=trainer.temperature)


def test_generation_keys_the_engine_does_not_honour_are_named(tmp_path, tokenizer, dataset):
    """`cache_implementation="static"` was accepted and ignored without a word."""
    trainer = _trainer(tmp_path, tokenizer, dataset, cache_implementation="static")
    with pytest.warns(UserWarning, match=r"\['cache_implementation'\]"):
        trainer.train()


def test_a_model_whose_forward_is_nan_raises_instead_of_falling_back(tmp_path, tokenizer, dataset):
    model = tiny_model("qwen3").train()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    trainer = _trainer(tmp_path, tokenizer, dataset, model=model)
    with pytest.raises(NonFiniteModelError, match="model's own forward produced NaN/inf"):
        trainer.train()
    assert trainer.engine_fallback_reasons == [] and trainer.uses_engine
