"""Failures the trainer fuzzer (`test_trainer_fuzz.py`) found, shrunk, kept as ordinary tests (each failed before its
fix). Each trains `InfiniteGRPOTrainer` and `GRPOTrainer` on the same completions and compares log-probs, every
gradient, the weights and every logged metric (`_fuzz_trainer_run.run_case`).

1. A micro batch trimmed to one completion column (`mask_truncated_completions=True`, the only unmasked completion
   one token long, TRL's batch 4 columns wide): TRL's metrics read a [B, 1] tensor as one value per sequence
   (`importance_sampling_level="sequence"`), so `entropy` (and `kl`, the clip ratios) were divided by the number of
   rows instead of the number of tokens: 0.568 vs `GRPOTrainer`'s 4.547 (8 rows).
2. The metrics of a micro batch without unmasked tokens, cut into slices by `backward_token_budget`, merged to NaN
   (logged None) where `GRPOTrainer` logs 0.0.
3. One-column completions cut into slices: the slices' masked means merged by tokens where TRL's value is a row mean.
4. Several micro batches per generation (`steps_per_generation=2`): TRL's per-micro-batch metrics (`entropy`, `kl`,
   the clip ratios) were computed over our micro batches (rows grouped by prompt or length), not TRL's random split.
5. Several optimizer steps per generation (`gradient_accumulation_steps < steps_per_generation`): each step trained
   on our micro batch (rows grouped by prompt or length) instead of TRL's rows of that step: other gradients.
6. Dropout in the training forward (TRL's default `disable_dropout=False`; OPT's functional `dropout`, GPT-2's
   `*_pdrop` modules): our micro batches (rows in another order, trimmed padding) drew other dropout masks than
   `GRPOTrainer`'s split, so log-probs differed by the dropout itself (0.0325 nats on OPT, 0.04 on GPT-2); the
   trainer now runs TRL's micro batches and forward for a random training forward (`trainer/stochastic.py`).
7. The harness, not the trainer: with dropout on, it compared the engine's sampling log-probs (eval mode, as
   `generate`) with the loss forward's, which draws dropout masks (0.019 nats off on GPT-2).
8. The harness again: on GPT-2 (learned positions) with prompts of two lengths, it compared the rollout's log-probs
   of the left-padded row (numbered from its first token) with TRL's forward (numbered from column 0): 0.116 nats.
9. `loss_type="cispo"` with `top_entropy_quantile=0.5`, `num_iterations=2` and `use_adaptive_entropy=True` on
   GPT-NeoX (found by the long profile): the second optimizer step's gradient differed from `GRPOTrainer`'s
   (`embed_in`: 0.018 against a tolerance of 1.2e-5). The micro batch trimmed to 5 completion columns (TRL's: 8)
   computed one entropy 4.8e-7 lower; two entropies tied at the batch's median, and the top-entropy mask (a hard
   threshold: `>=` the quantile) kept 4 tokens where TRL kept 2. With `top_entropy_quantile < 1` the training
   forward is now TRL's own, bit for bit (`InfiniteGRPOTrainer.trl_forward`): TRL's micro batches at TRL's widths,
   TRL's padded forward, no slices.
10. The harness: a reference gradient that is exactly 0 (rewards of zero spread, `beta=0.5` at the reference
   weights) against ours from the shared-prefix forward, whose log-probs differ from the reference model's padded
   forward by a float32 rounding: the KL term's gradient of that rounding (4.3e-7) exceeded the floor of the
   comparison (3e-4 x 1e-3), now 3e-4 x 1e-2 (`_close`).
11. The harness (long profile): with two micro batches per rollout and every completion of the first truncated
   under `mask_truncated_completions`, it found no row to check the sampling log-probs against: the second micro
   batch's rows are first forwarded for the loss after an optimizer step. It now also records TRL's
   `old_per_token_logps` forward (right after the rollout, without gradients) and checks those rows against it.
12. The harness (long profile, once 11 checked more rows): like 8, on GPT-2 with one prompt of one token and
   `pad_to_multiple_of=4`: TRL left-pads every prompt to 4 columns, so the row is left-padded in TRL's forward
   though no prompt is longer; the check's prompt width now counts TRL's padding to the multiple.
"""

from __future__ import annotations

import pytest
from _fuzz_trainer import EOS, Case
from _fuzz_trainer_run import build_model, engine_refuses, run_case
from _models import tiny_tokenizer

ARGS = dict(
    loss_type="grpo", num_generations=2, per_device_train_batch_size=4, steps_per_generation=1,
    gradient_accumulation_steps=1, num_iterations=1, max_completion_length=4, importance_sampling_level="token",
    epsilon=0.2, temperature=1.0, beta=0.0, mask_truncated_completions=False, scale_rewards="group",
    gradient_checkpointing=False, max_grad_norm=0.0, learning_rate=0.05, max_steps=1,
)


def test_a_micro_batch_is_never_trimmed_to_one_completion_column(tmp_path):
    args = {**ARGS, "mask_truncated_completions": True, "beta": 0.04}
    case = Case(family="qwen3", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": True, "backward_token_budget": None},
                prompts=["what is 1 plus 2 ?", "a b"], completion_seed=0, rollout="fixed", rewards=("token_sum",),
                completions=[[EOS], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    run_case(case, tmp_path, tiny_tokenizer())


def test_metrics_of_a_micro_batch_without_tokens_cut_into_slices(tmp_path):
    """2. Every completion truncated under `mask_truncated_completions=True` and the micro batch cut into slices by
    `backward_token_budget`: the merged token means (`entropy`, the clip ratios) were NaN (logged as None) where
    TRL's masked mean divides by `count.clamp(min=1)` and logs 0.0."""
    args = {**ARGS, "mask_truncated_completions": True, "loss_type": "luspo", "num_generations": 3,
            "per_device_train_batch_size": 3}
    case = Case(family="qwen3", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": 8},
                prompts=["what is 1 plus 2 ?"], completion_seed=0, rollout="fixed", rewards=("token_sum",),
                completions=[[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    run_case(case, tmp_path, tiny_tokenizer())


def test_metrics_of_a_one_column_micro_batch_cut_into_slices(tmp_path):
    """3. Completions one token wide (TRL's batch too) cut into slices by `backward_token_budget`: TRL reads the
    [B, 1] entropies as one value per row (a row mean, masked rows included); the slices were merged by tokens
    (`entropy` 1.521 vs `GRPOTrainer`'s 1.141)."""
    args = {**ARGS, "mask_truncated_completions": True, "loss_type": "cispo", "max_completion_length": 1}
    case = Case(family="cohere", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": 8},
                prompts=["0", "0 0"], completion_seed=0, rollout="fixed", rewards=("token_sum",),
                completions=[[EOS], [5], [6], [EOS]])
    run_case(case, tmp_path, tiny_tokenizer())


SPLIT = dict(ARGS, num_generations=4, per_device_train_batch_size=4, steps_per_generation=2, beta=0.04,
             max_completion_length=6, epsilon=0.05)
MIXED = [[5, 6, 7, 8, 9, 10], [11, EOS], [12, 13, 14, EOS], [15], [16, 17, 18, 19, 20, 21], [22, 23, EOS], [24],
         [25, 26, 27, 28, 29, EOS]]


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "padded"])
def test_metrics_over_trls_micro_batches(tmp_path, shared):
    """4. Two micro batches per generation and optimizer step, completions of mixed lengths: `entropy` and `kl` were
    means over our micro batches (grouped by prompt / by length) instead of TRL's random split."""
    args = {**SPLIT, "gradient_accumulation_steps": 2, "max_steps": 2}
    case = Case(family="qwen3", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": shared, "backward_token_budget": None},
                prompts=["what is 1 plus 2 ?", "a b"], completion_seed=0, rollout="fixed", rewards=("token_sum",),
                completions=MIXED)
    run_case(case, tmp_path, tiny_tokenizer())


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "padded"])
def test_optimizer_steps_inside_a_generation_get_trls_rows(tmp_path, shared):
    """5. `gradient_accumulation_steps=1` with `steps_per_generation=2`: each optimizer step trained on one of our
    micro batches, not on TRL's rows for that step (gradients off)."""
    args = {**SPLIT, "gradient_accumulation_steps": 1, "max_steps": 2}
    case = Case(family="qwen3", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": shared, "backward_token_budget": None},
                prompts=["what is 1 plus 2 ?", "a b"], completion_seed=0, rollout="fixed", rewards=("token_sum",),
                completions=MIXED)
    run_case(case, tmp_path, tiny_tokenizer())


def test_functional_dropout_runs_trls_micro_batches(tmp_path):
    """6. OPT with its `dropout=0.1` (functional, out of reach of `disable_dropout`), one prompt of one token, two
    one-token completions: our length-ordered micro batch held TRL's two rows in the other order, so each row got
    the other's dropout mask (log-prob 0.0325 nats off)."""
    args = {**ARGS, "per_device_train_batch_size": 2, "max_completion_length": 1}
    case = Case(family="opt", model_overrides={"num_hidden_layers": 1, "dropout": 0.1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": None},
                prompts=["0"], completion_seed=0, rollout="fixed", rewards=("token_sum",))
    run_case(case, tmp_path, tiny_tokenizer())


def test_dropout_modules_with_several_micro_batches_and_shared_prefix(tmp_path):
    """6. GPT-2 with its default `*_pdrop=0.1`, two micro batches per generation and `shared_prefix_training=True`:
    the shared-prefix probe drew from the global generator, and our micro batches held other rows than TRL's
    split (log-prob 0.04 nats off)."""
    args = {**ARGS, "per_device_train_batch_size": 2, "steps_per_generation": 2, "gradient_accumulation_steps": 2}
    case = Case(family="gpt2", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": True, "backward_token_budget": None},
                prompts=["what is 1 plus 2 ?", "a b"], completion_seed=0, rollout="fixed", rewards=("token_sum",),
                completions=[[5, 6, 7, EOS], [9], [13, 14, 15, 16], [17, 18]])
    run_case(case, tmp_path, tiny_tokenizer())


def test_engine_rollout_with_dropout_on(tmp_path):
    """7. GPT-2 with its default `*_pdrop=0.1` and `disable_dropout=False`, rolled out by the engine, two
    iterations: the sampling log-prob check held the eval-mode rollout to the dropout forward's log-probs."""
    args = {**ARGS, "per_device_train_batch_size": 2, "num_iterations": 2, "max_completion_length": 1,
            "disable_dropout": False, "max_steps": 2}
    case = Case(family="gpt2", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": None, "rollout_max_active_sequences": 1,
                      "rollout_block_size": 1}, prompts=["0"], completion_seed=0, rollout="engine", rewards=("token_sum",))
    run_engine_case(case, tmp_path)


def test_engine_rollout_of_a_left_padded_row_with_learned_positions(tmp_path):
    """8. GPT-2, dropout off, prompts of one and two tokens rolled out by the engine, two iterations."""
    args = {**ARGS, "num_iterations": 2, "max_completion_length": 1, "disable_dropout": True, "max_steps": 2}
    case = Case(family="gpt2", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": None, "rollout_max_active_sequences": 1,
                      "rollout_block_size": 1, "rollout_kv_cache_release": False}, prompts=["0", "0 0"],
                completion_seed=0, rollout="engine", rewards=("token_sum",))
    run_engine_case(case, tmp_path)


def test_cispo_with_top_entropy_quantile_and_adaptive_entropy_over_two_iterations(tmp_path):
    """9. (module docstring)"""
    args = {**ARGS, "loss_type": "cispo", "num_generations": 4, "steps_per_generation": 2,
            "gradient_accumulation_steps": 2, "num_iterations": 2, "max_completion_length": 8, "temperature": 1.3,
            "scale_rewards": "batch", "learning_rate": 0.3, "pad_to_multiple_of": "auto",
            "use_bias_correction_kl": False, "top_entropy_quantile": 0.5, "entropy_coef": 0.01,
            "use_adaptive_entropy": True, "max_steps": 2}
    case = Case(family="gpt_neox", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": None},
                prompts=["of 5 knight plus add", "0", "0", "0", "of 5 knight plus add"], completion_seed=23,
                rollout="fixed", rewards=("token_sum",))
    run_case(case, tmp_path, tiny_tokenizer())


def test_a_vanishing_reference_gradient_is_compared_at_float32_rounding(tmp_path):
    """10. (module docstring)"""
    args = {**ARGS, "loss_type": "luspo", "steps_per_generation": 2, "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 1, "num_iterations": 2, "max_completion_length": 8, "beta": 0.5,
            "pad_to_multiple_of": "auto", "use_bias_correction_kl": False, "max_steps": 2}
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 2.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    case = Case(family="llama3", model_overrides={"rope_parameters": rope, "num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": True, "backward_token_budget": None},
                prompts=["0 19 12 0 0", "0", "0", "0 19 12 0 0"], completion_seed=7, rollout="fixed",
                rewards=("token_sum",))
    run_case(case, tmp_path, tiny_tokenizer())


def test_rows_first_trained_after_an_optimizer_step_are_checked_against_the_old_log_probs(tmp_path):
    """11. (module docstring)"""
    args = {**ARGS, "num_generations": 4, "per_device_train_batch_size": 2, "steps_per_generation": 2,
            "num_iterations": 2, "max_completion_length": 3, "mask_truncated_completions": True,
            "pad_to_multiple_of": "auto", "use_bias_correction_kl": False, "max_steps": 2}
    case = Case(family="gptj", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": None, "activation_memory_gb": 1.0,
                      "rollout_max_active_sequences": 1, "rollout_block_size": 1, "rollout_kv_cache_release": True,
                      "rollout_reward_chunks": "groups"},
                prompts=["0"], completion_seed=0, rollout="engine", rewards=("token_sum",))
    run_engine_case(case, tmp_path)


def test_engine_rollout_of_a_row_padded_to_a_multiple_with_learned_positions(tmp_path):
    """12. (module docstring)"""
    args = {**ARGS, "per_device_train_batch_size": 2, "max_completion_length": 1, "disable_dropout": True,
            "pad_to_multiple_of": 4, "use_bias_correction_kl": False}
    case = Case(family="gpt2", model_overrides={"num_hidden_layers": 1}, args=args,
                ours={"shared_prefix_training": False, "backward_token_budget": None, "activation_memory_gb": 1.0,
                      "rollout_max_active_sequences": 1, "rollout_block_size": 1, "rollout_kv_cache_release": False,
                      "rollout_kv_cache_reuse_across_calls": False, "rollout_reward_chunks": "groups"},
                prompts=["0"], completion_seed=0, rollout="engine", rewards=("token_sum",))
    run_engine_case(case, tmp_path)


def run_engine_case(case: Case, tmp_path) -> None:
    """A regression of the engine's rollout of the case's model: skipped, named, where the installed transformers does
    not route that model's attention kwargs (the engine then refuses it, and the case would test TRL's fallback)."""
    if engine_refuses(case, build_model(case, tmp_path)):
        pytest.skip(f"the installed transformers does not route `{case.family}`'s attention kwargs")
    run_case(case, tmp_path, tiny_tokenizer())
