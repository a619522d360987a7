"""End-to-end training with the engine on CPU: parameters move, large G, streamed rewards, errors."""

import pytest
import torch
from _models import reference_greedy, tiny_model
from datasets import Dataset
from trainer_helpers import PROMPTS, cpu_args, token_sum_reward

from trl_infinite.trainer import InfiniteGRPOTrainer


def make_trainer(tmp_path, tokenizer, dataset, reward_funcs=token_sum_reward, model=None, **overrides):
    args = cpu_args(tmp_path, **overrides)
    return InfiniteGRPOTrainer(
        model=model if model is not None else tiny_model("qwen3").train(),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def test_two_steps_change_every_trainable_parameter(tmp_path, tokenizer, dataset):
    trainer = make_trainer(tmp_path, tokenizer, dataset, max_steps=2, rollout_max_active_sequences=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    for name, param in trainer.model.named_parameters():
        assert not torch.equal(before[name], param), f"{name} did not change"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for key in ("rollout/tokens_per_second", "rollout/decode_steps", "rollout/peak_kv_gb",
                "rollout/peak_active_sequences", "rollout/prefill_tokens"):
        assert all(key in h for h in logs), key
    assert logs[0]["rollout/peak_active_sequences"] <= 2
    # 2 slots: a step adds at most 2 tokens per slot (a fresh sample's first token plus its decode token)
    assert 4 * logs[0]["rollout/decode_steps"] >= logs[0]["rollout/generated_tokens"] > 0


def test_scheduler_speculation_and_divided_rollout_train(tmp_path, tokenizer, dataset):
    """The length-aware scheduler, sibling-suffix speculation (always on) and divided rollout, through the trainer."""
    trainer = make_trainer(
        tmp_path, tokenizer, dataset, rollout_max_active_sequences=2, rollout_scheduler="infinite",
        rollout_length_predictor="group", rollout_speculative_method="suffix", rollout_speculative_adaptive=False,
        rollout_speculative_num_tokens=2, rollout_chunk_tokens=3,
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert torch.isfinite(torch.tensor(log["loss"]))
    assert log["rollout/verify_steps"] > 0 and log["rollout/mean_acceptance_length"] >= 1.0
    assert log["rollout/peak_active_sequences"] <= 2


def test_group_larger_than_one_micro_batch_trains(tmp_path, tokenizer, dataset):
    """G=16 samples of one prompt, per-device batch 4 (4 micro batches), 4 decode slots."""
    trainer = make_trainer(
        tmp_path, tokenizer, dataset, num_generations=16, per_device_train_batch_size=4,
        gradient_accumulation_steps=4, rollout_max_active_sequences=4, max_completion_length=6,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    log = trainer.state.log_history[0]
    assert torch.isfinite(torch.tensor(log["loss"]))
    assert log["rollout/peak_active_sequences"] == 4
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_streamed_rewards_feed_trl_normalisation(tmp_path, tokenizer, dataset, scale_rewards):
    """The cached rewards are exactly what the reward function gives on the final completions, and TRL's
    advantages follow from them for every `scale_rewards` mode."""
    trainer = make_trainer(tmp_path, tokenizer, dataset, scale_rewards=scale_rewards, rollout_max_active_sequences=2,
                           per_device_train_batch_size=8, num_generations=4)
    trainer.train()
    rewards = torch.tensor(trainer._logs["rewards"]["token_sum_reward"])
    advantages = torch.tensor(trainer._logs["advantages"])
    grouped = rewards.view(-1, 4)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()
    if scale_rewards == "group":
        expected = centred / (grouped.std(1).repeat_interleave(4) + 1e-4)
    elif scale_rewards == "batch":
        expected = centred / (rewards.std() + 1e-4)
    else:
        expected = centred
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-5)


def test_reward_error_is_the_functions_own_raised_once(tmp_path, tokenizer, dataset):
    """As in `GRPOTrainer`: the function's own exception (here `ValueError`) reaches the caller, and the function is
    called once (it was re-run prompt by prompt and wrapped in a `RewardFunctionError`). Where it happened is added
    as a note."""
    calls = []

    def fragile_reward(prompts, completion_ids, **kwargs):
        calls.append(len(prompts))
        for p in prompts:
            if "knave" in p:
                raise ValueError("cannot score knaves")
        return token_sum_reward(completion_ids)

    two_prompts = Dataset.from_dict({"prompt": [PROMPTS[0], PROMPTS[1]]})  # the first batch holds the knave
    trainer = make_trainer(tmp_path, tokenizer, two_prompts, reward_funcs=fragile_reward,
                           per_device_train_batch_size=8, rollout_max_active_sequences=8)
    with pytest.raises(ValueError, match="cannot score knaves") as info:
        trainer.train()
    assert type(info.value) is ValueError
    assert len(calls) == 1
    notes = getattr(info.value, "__notes__", [])
    assert any("fragile_reward" in n and "rows" in n for n in notes)


def test_rows_keep_trl_order_and_eos_cut(tmp_path, tokenizer, dataset):
    """Greedy rollouts through the trainer hook equal `model.generate` for every row (repeated prompts
    de-duplicated, completions returned in TRL's row order, cut after EOS)."""
    trainer = make_trainer(tmp_path, tokenizer, dataset, generation_kwargs={"do_sample": False},
                           max_completion_length=10)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    rows = [p for p in prompts for _ in range(3)] + [prompts[0]]  # runs of 3, 3, 3 and 1
    completions, logprobs = trainer._generate_single_turn(rows, None, {}, 3)
    model = trainer.model.eval()
    for row, ids in zip(rows, completions):
        assert ids == reference_greedy(model, row, 10, trainer.eos_token_ids)
    assert [len(lp) for lp in logprobs] == [len(c) for c in completions]
    assert all(lp <= 0 for lps in logprobs for lp in lps)


def test_bf16_autocast_trains_through_the_engine(tmp_path, tokenizer, dataset):
    """TRL's default `bf16=True`: accelerate runs every forward (the engine's too) under bf16 autocast, where K and V
    can come in different dtypes than the float32 pool."""
    trainer = make_trainer(tmp_path, tokenizer, dataset, bf16=True, rollout_max_active_sequences=2)
    trainer.train()
    log = trainer.state.log_history[0]
    assert "rollout/decode_steps" in log and torch.isfinite(torch.tensor(log["loss"]))
    assert trainer.uses_engine and trainer._engine.pool.dtype == torch.bfloat16


def test_decode_graphs_are_captured_once_over_a_training_run(tmp_path, tokenizer, dataset):
    """CUDA graphs (through the CPU capture emulation) over four training steps, the KV pool released after each
    rollout (the default): graphs outlive the release, so only the first rollouts capture
    (`rollout/graph_captures`), and the trained parameters keep their storage (no recapture after a step)."""
    from trl_infinite.engine.decode.cpu_graphs import emulate_cuda_graphs

    with emulate_cuda_graphs() as emu:
        trainer = make_trainer(tmp_path, tokenizer, dataset, max_steps=4, rollout_cuda_graphs=True,
                               rollout_sampling_mode="fixed_slot", rollout_max_active_sequences=4)
        trainer.train()
    captures = [h["rollout/graph_captures"] for h in trainer.state.log_history if "loss" in h]
    assert len(captures) == 4 and captures[0] > 0 and captures[2:] == [0, 0], captures
    assert emu.counts["replays"] > 0 and not emu.counts["moved_storage"]
