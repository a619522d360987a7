"""Random training forwards (`trainer/stochastic.py`): dropout found by module scan or by probe, without drawing from
the global generator, and a trainer that then runs TRL's own micro batches, forward and backward, with one warning.

The end-to-end equality with `GRPOTrainer` (log-probs, gradients, metrics under dropout) is checked by
`tests/fuzz/test_trainer_fuzz_regressions.py` (OPT, GPT-2) and the trainer fuzzer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from trainer_helpers import cpu_args, token_sum_reward
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import disable_dropout_in_model

from trl_infinite.testing.tiny_configs import build_tiny_model
from trl_infinite.trainer import InfiniteGRPOTrainer
from trl_infinite.trainer.loss_slices import loss_slices
from trl_infinite.trainer.stochastic import random_training_forward


class _Noisy(torch.nn.Module):
    """Adds Gaussian noise in training mode, under a name no scan knows (only the probe can find it)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        return out + torch.randn_like(out) if self.training else out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dropout_modules_and_functional_dropout_are_found():
    gpt2 = build_tiny_model("gpt2")  # nn.Dropout modules (resid / embd / attn_pdrop 0.1)
    assert "Dropout(p=0.1)" in random_training_forward(gpt2)
    disable_dropout_in_model(gpt2)  # TRL's `disable_dropout=True`
    assert random_training_forward(gpt2) is None
    opt = build_tiny_model("opt", dropout=0.1)  # `nn.functional.dropout(p=self.dropout)`: no module to switch off
    disable_dropout_in_model(opt)
    assert "dropout=0.1" in random_training_forward(opt)
    assert random_training_forward(build_tiny_model("opt", dropout=0.0)) is None
    assert random_training_forward(build_tiny_model("qwen3")) is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_probe_finds_unnamed_noise_without_drawing_from_the_global_generator():
    model = build_tiny_model("qwen3")
    layer = model.model.layers[0]
    layer.mlp.down_proj = _Noisy(layer.mlp.down_proj)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert random_training_forward(model) == "two training forwards of the same batch differ"
    assert torch.equal(torch.get_rng_state(), before)
    assert not model.training  # the model's mode is given back


def test_trainer_with_dropout_runs_trls_micro_batches(tmp_path, tokenizer, dataset):
    """GPT-2 with its default dropout: one warning naming it, the shared-prefix forward refused with a reason, no
    `backward_token_budget` slices, TRL's `_prepare_inputs`; the global generator as `GRPOTrainer.__init__` leaves
    it (the dropout masks follow it)."""
    GRPOTrainer(model=build_tiny_model("gpt2").train(), reward_funcs=token_sum_reward, train_dataset=dataset,
                args=cpu_args(tmp_path / "trl", cls=GRPOConfig, num_generations=2), processing_class=tokenizer)
    trls = torch.get_rng_state()
    args = cpu_args(tmp_path, shared_prefix_training=True, backward_token_budget=8, num_generations=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = InfiniteGRPOTrainer(model=build_tiny_model("gpt2").train(), reward_funcs=token_sum_reward, args=args,
                                      train_dataset=dataset, processing_class=tokenizer)
    assert torch.equal(torch.get_rng_state(), trls)
    messages = [str(w.message) for w in caught]
    assert sum(m.startswith("InfiniteGRPOTrainer's training forward is random") for m in messages) == 1, messages
    assert trainer.random_forward is not None and "Dropout" in trainer.random_forward
    assert trainer.shared_prefix is None and "random" in trainer.shared_prefix_reason
    inputs = {"prompt_ids": torch.ones(2, 40, dtype=torch.long), "prompt_mask": torch.ones(2, 40),
              "completion_ids": torch.ones(2, 8, dtype=torch.long), "completion_mask": torch.ones(2, 8),
              "advantages": torch.zeros(2)}
    assert loss_slices(trainer, inputs) is None  # over the budget, but not sliced


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_probe_leaves_a_dynamic_rope_as_it_was():
    """Dynamic NTK RoPE keeps the frequencies of the longest forward it has seen (above `max_position_embeddings`):
    the probe's forward must not leave them grown, or every later training forward rotates differently from
    `GRPOTrainer`'s (gradients 6.5e-5 of the largest entry off in `test_positions.py`)."""
    model = build_tiny_model("llama", max_position_embeddings=8,
                             rope_parameters=dict(rope_type="dynamic", factor=8.0, rope_theta=10000.0))
    rotary = model.model.rotary_emb
    before = rotary.inv_freq.clone(), rotary.max_seq_len_cached
    assert random_training_forward(model) is None
    assert torch.equal(rotary.inv_freq, before[0]) and rotary.max_seq_len_cached == before[1]
