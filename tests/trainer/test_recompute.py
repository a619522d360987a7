"""Activation recomputation chosen by the memory budget (`trainer/recompute.py`, issue 43).

With `gradient_checkpointing=True` (TRL's default), slices of the loss whose activations fit `activation_memory_gb`
run without recomputing their forward in the backward; the loss and every gradient stay `GRPOTrainer`'s (float32,
relative 1e-4 of the largest value, the tolerance of `test_shared_prefix.py`: different reduction orders; a real
mismatch is of order 1); slices that fit only with their matrix products kept recompute the rest selectively.
"""

from __future__ import annotations

import pytest
import torch
from _models import tiny_model
from test_shared_prefix import assert_same_loss_and_grads, loss_and_grads, trainers, trl_batch
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_helpers import cpu_args

from trl_infinite.trainer import recompute
from trl_infinite.trainer.loss_slices import loss_slices, row_costs
from trl_infinite.trainer.micro_batches import take_rows
from trl_infinite.trainer.recompute import (
    Recompute,
    activation_bytes_per_token,
    checkpointed_modules,
    no_recompute,
    selective_bytes_per_token,
)


def checkpointed(pair):
    """`Trainer.train` turns gradient checkpointing on; these tests call the loss directly."""
    for trainer in pair:
        trainer.model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
    return pair


def count_recomputations(model: torch.nn.Module) -> list[int]:
    """Counts the checkpointed forwards of `model`'s layers (each is recomputed in the backward)."""
    calls = [0]
    for module in checkpointed_modules(model):
        inner = module._gradient_checkpointing_func

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)

        module._gradient_checkpointing_func = counted
    return calls


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "padded"])
def test_slices_that_fit_skip_recomputation_with_trls_loss_and_gradients(tmp_path, tokenizer, dataset, shared,
                                                                         monkeypatch):
    """Without the selective tier (a checkpointing function that cannot take a policy), slices are cut to what fits
    without recomputation, and none recomputes."""
    monkeypatch.setattr(recompute, "MIN_SLICE_TOKENS", 8)
    monkeypatch.setattr(recompute, "selective_available", lambda model: False)
    probe = tiny_model("qwen3")
    per_token = activation_bytes_per_token(probe, 2 * recompute.PROBE_TOKENS)
    if per_token > recompute.LINEAR_SLACK * activation_bytes_per_token(probe, recompute.PROBE_TOKENS):
        pytest.skip("this torch's sdpa keeps the attention weights (math kernel): the tier is off, as "
                    "test_nothing_kept_whole_where_the_activations_grow_faster_than_the_tokens checks")
    # room for 24 tokens of activations (a row holds at most 21): the batch (packed: about 50 tokens, padded: 6 rows
    # x 20) runs as several slices
    limit_gb = 24.5 * per_token / 1e9
    ref, ours = checkpointed(trainers(tmp_path, "qwen3", tokenizer, dataset, gradient_checkpointing=True,
                                      shared_prefix_training=shared, activation_memory_gb=limit_gb))
    assert checkpointed_modules(ref.model) and checkpointed_modules(ours.model)
    inputs = trl_batch(ref.model.config.vocab_size, seed=1)
    slices = loss_slices(ours, inputs)
    costs = [int(row_costs(ours, take_rows(inputs, s)).sum()) for s in slices]
    assert len(slices) >= 2 and max(costs) <= ours.recompute.max_tokens(ours.model) == 24, costs
    ref_calls, our_calls = count_recomputations(ref.model), count_recomputations(ours.model)
    for loss_type in ("dapo", "grpo", "bnpo"):
        ref.loss_type = ours.loss_type = loss_type
        assert_same_loss_and_grads(ref, ours, inputs, loss_type)
    assert ref_calls[0] > 0 and our_calls[0] == 0, (ref_calls, our_calls)
    assert all(m.gradient_checkpointing for m in checkpointed_modules(ours.model))  # restored after each slice


class MatmulCount(TorchDispatchMode):
    """Counts the matrix products (`aten.mm` / `addmm`) dispatched while active, the backward's included."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "padded"])
def test_selective_slices_repeat_no_matrix_product_with_trls_loss_and_gradients(tmp_path, tokenizer, dataset, shared,
                                                                                monkeypatch):
    """Slices that fit only with the matrix products kept run selectively: TRL's loss and gradients (the tolerance
    above), bit for bit the gradients of a full recomputation of the same slices, and as many matrix products as
    keeping everything (a full recomputation runs each layer's products again)."""
    monkeypatch.setattr(recompute, "MIN_SLICE_TOKENS", 8)
    probe = tiny_model("qwen3").train()
    probe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    full, kept = (f(probe, 2 * recompute.PROBE_TOKENS) for f in (activation_bytes_per_token, selective_bytes_per_token))
    assert 0 < kept < full, (kept, full)
    limit_gb = 24.5 * kept / 1e9  # 24 tokens kept selectively; without recomputation fewer than a row's 21 tokens
    ref, ours = checkpointed(trainers(tmp_path, "qwen3", tokenizer, dataset, gradient_checkpointing=True,
                                      shared_prefix_training=shared, activation_memory_gb=limit_gb))
    inputs = trl_batch(ref.model.config.vocab_size, seed=1)
    slices = loss_slices(ours, inputs)
    costs = [int(row_costs(ours, take_rows(inputs, s)).sum()) for s in slices]
    modes = [ours.recompute.mode(ours.model, c) for c in costs]
    assert len(slices) >= 2 and max(costs) <= ours.recompute.max_tokens(ours.model) == 24, costs
    assert Recompute.SELECTIVE in modes and Recompute.FULL not in modes, (costs, modes)
    for loss_type in ("dapo", "grpo"):
        ref.loss_type = ours.loss_type = loss_type
        assert_same_loss_and_grads(ref, ours, inputs, loss_type)
    runs = {}
    for forced in (None, Recompute.FULL, Recompute.NONE):
        if forced is not None:
            monkeypatch.setattr(recompute.RecomputePolicy, "mode", lambda self, model, tokens, _m=forced: _m)
        with MatmulCount() as counter:
            runs[forced] = (*loss_and_grads(ours, inputs), counter.calls)
    (loss, grads, products), (full_loss, full_grads, full_products) = runs[None], runs[Recompute.FULL]
    assert torch.equal(loss, full_loss) and grads.keys() == full_grads.keys()
    assert all(torch.equal(grads[n], full_grads[n]) for n in grads)
    assert products == runs[Recompute.NONE][2] < full_products, (products, runs[Recompute.NONE][2], full_products)
    assert all(m._gradient_checkpointing_func.keywords.get("context_fn") is None
               for m in checkpointed_modules(ours.model) if hasattr(m, "_gradient_checkpointing_func"))


def test_reentrant_checkpointing_has_no_selective_tier():
    model = tiny_model("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not recompute.selective_available(model)
    policy = recompute.RecomputePolicy(1.0)
    policy.max_tokens(model)
    assert policy.selective_bytes_per_token is None


def test_a_budget_too_small_recomputes_as_trl(tmp_path, tokenizer, dataset):
    """Where not even `MIN_SLICE_TOKENS` fit, every slice recomputes (and the slices are `backward_token_budget`'s)."""
    ref, ours = checkpointed(trainers(tmp_path, "qwen3", tokenizer, dataset, gradient_checkpointing=True,
                                      activation_memory_gb=1e-9))
    inputs = trl_batch(ref.model.config.vocab_size, seed=1)
    assert ours.recompute.max_tokens(ours.model) is None and loss_slices(ours, inputs) is None
    calls = count_recomputations(ours.model)
    loss_and_grads(ours, inputs)
    assert calls[0] > 0


def test_none_is_trls_recomputation(tmp_path, tokenizer, dataset):
    _, ours = checkpointed(trainers(tmp_path, "qwen3", tokenizer, dataset, gradient_checkpointing=True,
                                    activation_memory_gb=None))
    calls = count_recomputations(ours.model)
    loss_and_grads(ours, trl_batch(ours.model.config.vocab_size, seed=1))
    assert ours.recompute.max_tokens(ours.model) is None and calls[0] > 0


def test_probe_counts_activations_per_token_and_leaves_the_model_as_it_was():
    """The probe counts more than the layer inputs a checkpointed forward keeps, and leaves the global generator and
    the checkpointing setting as they were."""
    model = tiny_model("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = torch.random.get_rng_state()
    small = activation_bytes_per_token(model, 32)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert small > 4 * layers * hidden * 4  # hidden size x 4 bytes per layer and token, 4 times over
    assert 4 * layers * hidden < selective_bytes_per_token(model, 32) < small
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(m.gradient_checkpointing for m in checkpointed_modules(model))
    with no_recompute(model):
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_nothing_kept_whole_where_the_activations_grow_faster_than_the_tokens(attention):
    """A limit per token cannot bound an unfused attention's weights (T x T per head): where the probe's bytes per
    token grow from 64 to 128 tokens (`eager` always; `sdpa` where torch falls back to its math kernel), no slice
    keeps everything; where they do not, the limit holds a proportional number of tokens."""
    model = tiny_model("llama", attn_implementation=attention).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    short, long = (activation_bytes_per_token(model, n) for n in (64, 128))
    grows = long > recompute.LINEAR_SLACK * short
    assert grows or attention == "sdpa", (short, long)
    policy = recompute.RecomputePolicy(1000 * long / 1e9)
    keep, _ = policy._fitting(model)
    assert keep == (0 if grows else 1000), (keep, short, long)


@pytest.mark.parametrize("value", [0, -1.0, "1", True])
def test_activation_memory_gb_is_checked(tmp_path, value):
    with pytest.raises(ValueError, match="activation_memory_gb"):
        cpu_args(tmp_path, activation_memory_gb=value)


def test_probe_leaves_a_dynamic_rope_as_it_was():
    """A dynamic NTK RoPE grows its frequencies past its longest position: the 64-token probe of a model with 8
    positions must not leave them grown (the training forward would then number tokens otherwise than TRL's)."""
    from trl_infinite.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("llama", max_position_embeddings=8,
                             rope_parameters=dict(rope_type="dynamic", factor=8.0, rope_theta=10000.0)).train()
    rope = model.model.rotary_emb
    before = {k: v.clone() for k, v in rope.named_buffers()}, dict(vars(rope))
    activation_bytes_per_token(model, 64)
    assert all(torch.equal(rope.get_buffer(k), v) for k, v in before[0].items())
    assert {k: v for k, v in vars(rope).items() if isinstance(v, (int, float))} == \
        {k: v for k, v in before[1].items() if isinstance(v, (int, float))}
