"""The shared-prefix training forward and the token-budgeted sub-batches against vanilla `GRPOTrainer`.

For one TRL-layout micro batch (two GRPO groups, left-padded prompts of different lengths, ragged right-padded
completions, one fully masked row), `InfiniteGRPOTrainer.compute_loss` + backward gives TRL's loss, per-token
log-probs, entropies and every parameter's gradient, for every loss type, with each group's prompt encoded once;
again with the micro batch cut into slices by `backward_token_budget`, with TRL's logged metrics merged back.
Tolerance: float32 round-off of different reduction orders, relative 1e-4 of the largest value (the models are
tiny; a real mismatch is of order 1).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _models import tiny_model
from trainer_helpers import cpu_args, token_sum_reward
from trl import GRPOConfig, GRPOTrainer

from trl_infinite.testing.tiny_configs import build_tiny_model
from trl_infinite.trainer import InfiniteGRPOTrainer
from trl_infinite.trainer.loss_slices import loss_slices
from trl_infinite.trainer.packing import GroupedLayout, pack_rows
from trl_infinite.trainer.prefix_probe import padded_reference, probe_batch
from trl_infinite.trainer.shared_prefix import SharedPrefixForward, SharedPrefixUnsupported

LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ARCHS = {
    "llama": lambda: tiny_model("llama"),
    "qwen3": lambda: tiny_model("qwen3"),  # GQA
    "gemma2": lambda: build_tiny_model("gemma2", sliding_window=8),  # soft-caps, a window shorter than the prompts
}


def trl_batch(vocab: int, seed: int = 0, group_size: int = 3, prompt_lens: tuple[int, int] = (13, 6)) -> dict:
    """Two groups of `group_size` rows in TRL's layout: prompts of 13 and 6 tokens left-padded to 13, completions of
    0..7 tokens right-padded to 7 (the first row of the second group fully masked), advantages, sampling log-probs
    a little off the policy's (so that ratios clip), `num_items_in_batch`."""
    g = torch.Generator().manual_seed(seed)
    P, C = max(prompt_lens), 7
    rows, pmask, comp, cmask = [], [], [], []
    for gi, plen in enumerate(prompt_lens):
        prompt = torch.randint(4, vocab, (plen,), generator=g)
        for j in range(group_size):
            n = 0 if (gi, j) == (1, 0) else int(torch.randint(1, C + 1, (1,), generator=g))
            rows.append(torch.cat([torch.zeros(P - plen, dtype=torch.long), prompt]))
            pmask.append(torch.cat([torch.zeros(P - plen, dtype=torch.long), torch.ones(plen, dtype=torch.long)]))
            comp.append(torch.cat([torch.randint(4, vocab, (n,), generator=g), torch.zeros(C - n, dtype=torch.long)]))
            cmask.append(torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(C - n, dtype=torch.long)]))
    completion_mask = torch.stack(cmask)
    return {
        "prompt_ids": torch.stack(rows), "prompt_mask": torch.stack(pmask),
        "completion_ids": torch.stack(comp), "completion_mask": completion_mask,
        "advantages": torch.randn(len(rows), generator=g),
        "old_per_token_logps": -torch.rand(len(rows), C, generator=g) * 3 * completion_mask,
        "num_items_in_batch": completion_mask.sum(),
    }


OURS_ONLY = ("backward_token_budget", "shared_prefix_training", "activation_memory_gb")


def trainers(tmp_path, arch, tokenizer, dataset, **overrides):
    model = ARCHS[arch]().train()
    kw = dict(per_device_train_batch_size=6, num_generations=3, max_completion_length=7, temperature=0.9,
              gradient_checkpointing=False)
    kw.update(overrides)
    trl_kw = {k: v for k, v in kw.items() if k not in OURS_ONLY}
    ref = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=token_sum_reward, processing_class=tokenizer,
                      args=cpu_args(tmp_path / "trl", cls=GRPOConfig, **trl_kw), train_dataset=dataset)
    ours = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, processing_class=tokenizer,
                               args=cpu_args(tmp_path / "ours", **kw), train_dataset=dataset)
    for trainer in (ref, ours):
        trainer.current_gradient_accumulation_steps = 1  # set by `train()`, read by the loss
    return ref, ours


def loss_and_grads(trainer, inputs):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, want, what):
    scale = max(want.abs().max().item(), 1e-6)
    assert (got - want).abs().max().item() <= 1e-4 * scale, what


@pytest.mark.parametrize("arch", list(ARCHS))
def test_shared_prefix_forward_equals_trl_for_every_loss(tmp_path, tokenizer, dataset, arch):
    ref, ours = trainers(tmp_path, arch, tokenizer, dataset, backward_token_budget=None)
    assert ours.shared_prefix is not None, ours.shared_prefix_reason
    inputs = trl_batch(ref.model.config.vocab_size)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    want = ref._get_per_token_logps_and_entropies(ref.model, ids, mask, 7, compute_entropy=True)
    got = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 7, compute_entropy=True)
    layout = pack_rows(ids, mask, 7)
    assert layout.num_tokens == 12 + 5 + int(inputs["completion_mask"].sum()) + 5  # each prompt once
    assert_close(got[0], want[0], "log-probs")
    assert_close(got[1], want[1], "entropies")
    for loss_type, quantile in [(loss, 1.0) for loss in LOSSES] + [("dapo", 0.5)]:
        ref.loss_type = ours.loss_type = loss_type
        ref.top_entropy_quantile = ours.top_entropy_quantile = quantile  # 0.5: the loss on high-entropy tokens only
        assert_same_loss_and_grads(ref, ours, inputs, loss_type)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_rows_attend_causally_when_every_shared_part_is_full(tmp_path, tokenizer, dataset, arch, monkeypatch):
    """Prompts of one length shorter than the completions: the rows' attention runs with `is_causal` over every key
    slot instead of a mask (gemma2: its soft-capped layers keep the mask); log-probs, loss and gradients equal TRL's,
    and the masked form's."""
    ref, ours = trainers(tmp_path, arch, tokenizer, dataset, backward_token_budget=None)
    inputs = trl_batch(ref.model.config.vocab_size, prompt_lens=(4, 4))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    assert pack_rows(ids, mask, 7).causal_rows
    other = trl_batch(ref.model.config.vocab_size)  # prompts of 13 and 6 tokens: the second group's is padded
    assert not pack_rows(torch.cat([other["prompt_ids"], other["completion_ids"]], 1),
                         torch.cat([other["prompt_mask"], other["completion_mask"]], 1), 7).causal_rows
    seen = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(bool(kwargs.get("is_causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    want = ref._get_per_token_logps_and_entropies(ref.model, ids, mask, 7, compute_entropy=True)
    seen.clear()
    got = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 7, compute_entropy=True)
    assert any(seen) == (arch != "gemma2"), seen  # gemma2 soft-caps: eager scores with the mask
    assert_close(got[0], want[0], "log-probs")
    assert_close(got[1], want[1], "entropies")
    assert_same_loss_and_grads(ref, ours, inputs, "dapo, causal rows")
    causal_loss, causal_grads = loss_and_grads(ours, inputs)
    import trl_infinite.trainer.trainer as trainer_module

    def masked_rows(*args):  # the same packed batch, attended with the mask
        return dataclasses.replace(pack_rows(*args), causal_rows=False)

    monkeypatch.setattr(trainer_module, "pack_rows", masked_rows)
    seen.clear()
    masked_loss, masked_grads = loss_and_grads(ours, inputs)
    assert not any(seen) and (bool(seen) or arch == "gemma2")  # gemma2: soft-capped scores, no SDPA call
    assert_close(causal_loss, masked_loss, "loss, causal vs masked rows")
    for name in masked_grads:
        assert_close(causal_grads[name], masked_grads[name], f"gradient of {name}, causal vs masked rows")


def assert_same_loss_and_grads(ref, ours, inputs, what: str) -> None:
    want_loss, want_grads = loss_and_grads(ref, inputs)
    got_loss, got_grads = loss_and_grads(ours, inputs)
    assert_close(got_loss, want_loss, f"{what} loss")
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], f"{what} gradient of {name}")


@pytest.mark.parametrize("shared", [True, False])
def test_token_budget_slices_keep_loss_gradients_and_metrics(tmp_path, tokenizer, dataset, shared):
    """A budget of 20 tokens cuts the micro batch into several slices: the same loss, gradient and logged metrics
    as one pass (with the shared-prefix forward and with TRL's)."""
    ref, ours = trainers(tmp_path, "qwen3", tokenizer, dataset, backward_token_budget=20,
                         shared_prefix_training=shared)
    inputs = trl_batch(ref.model.config.vocab_size, seed=1)
    assert len(loss_slices(ours, inputs)) > 2
    for loss_type in LOSSES:
        ref.loss_type = ours.loss_type = loss_type
        ref._metrics["train"].clear()
        ours._metrics["train"].clear()
        want_loss, want_grads = loss_and_grads(ref, inputs)
        got_loss, got_grads = loss_and_grads(ours, inputs)
        assert_close(got_loss, want_loss, f"{loss_type} loss")
        for name in want_grads:
            assert_close(got_grads[name], want_grads[name], f"{loss_type} gradient of {name}")
        want_metrics, got_metrics = dict(ref._metrics["train"]), dict(ours._metrics["train"])
        assert got_metrics.keys() == want_metrics.keys()
        for key, values in want_metrics.items():
            assert len(got_metrics[key]) == len(values) == 1, key
            torch.testing.assert_close(torch.tensor(got_metrics[key]), torch.tensor(values), rtol=1e-4, atol=1e-6,
                                       equal_nan=True, msg=f"{loss_type} metric {key}")


def test_budget_not_applied_where_the_loss_is_not_a_sum_over_rows(tmp_path, tokenizer, dataset):
    _, ours = trainers(tmp_path, "qwen3", tokenizer, dataset, backward_token_budget=20, top_entropy_quantile=0.5)
    assert loss_slices(ours, trl_batch(96)) is None


def test_top_entropy_quantile_trains_with_trls_forward_and_says_why(tmp_path, tokenizer, dataset):
    """The top-entropy mask is a hard threshold on the forward's entropies: another forward's rounding moves tied
    entropies across it (fuzz regression 9), so the training forward is TRL's own: no shared-prefix forward (one
    warning naming the setting), TRL's micro batches at TRL's widths."""
    with pytest.warns(UserWarning, match="top_entropy_quantile < 1"):
        ref, ours = trainers(tmp_path, "qwen3", tokenizer, dataset, top_entropy_quantile=0.5,
                             steps_per_generation=3, gradient_accumulation_steps=3)
    assert ours.shared_prefix is None and "top_entropy_quantile" in ours.shared_prefix_reason
    assert ours.trl_forward is not None and ref.top_entropy_quantile == 0.5
    batch = trl_batch(96)
    micro_batches = {}
    for trainer in (ref, ours):
        trainer._buffered_inputs = None
        trainer._generate_and_score_completions = lambda _batch: dict(batch)
        torch.manual_seed(0)
        micro_batches[trainer] = []
        for trainer._step in range(3):
            micro_batches[trainer].append(trainer._prepare_inputs(None))
    for want, got in zip(micro_batches[ref], micro_batches[ours]):  # 2 rows each, some shorter than 7 columns
        assert want.keys() == got.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), key


def test_refused_model_trains_with_trls_forward_and_says_why(tmp_path, tokenizer, dataset):
    """A model whose training forward is random (dropout) is refused by the contract: TRL's forward, one warning."""
    model = build_tiny_model("llama", attention_dropout=0.1).train()
    with pytest.warns(UserWarning, match="training forward is random"):
        trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, processing_class=tokenizer,
                                      args=cpu_args(tmp_path, gradient_checkpointing=False), train_dataset=dataset)
    assert trainer.shared_prefix is None and "dropout" in trainer.shared_prefix_reason
    assert model.config._attn_implementation in ("sdpa", "eager")  # the model is left as it was


def test_micro_batches_hold_whole_groups(tmp_path, tokenizer, dataset):
    """With the shared-prefix forward and two micro batches per generation, each micro batch holds whole groups."""
    from trl_infinite.trainer.micro_batches import make_micro_batches

    batch = trl_batch(96, group_size=4)
    for _ in range(5):  # random group order: every draw keeps groups whole
        chunks = make_micro_batches(batch, 2, "dapo", by_group=True)
        for c in chunks:
            ids = c["prompt_ids"].masked_fill(c["prompt_mask"] == 0, -1)
            assert torch.unique(ids, dim=0).shape[0] == 1


def test_kv_pool_is_free_during_the_backward(tmp_path, tokenizer, dataset, model):
    """The engine's KV pool is held during the rollout and released before the loss's backward runs; on CPU the
    host tensor cache is installed and keeps nothing from the rollout (trimmed after it)."""
    from trl_infinite.engine.runner import host_memory

    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, processing_class=tokenizer,
                                  args=cpu_args(tmp_path, max_steps=2, gradient_checkpointing=False),
                                  train_dataset=dataset)
    assert trainer.host_tensor_cache and host_memory.installed()
    during_backward = []
    weight = next(p for p in model.parameters() if p.requires_grad)

    def hook(grad):
        during_backward.append((trainer._engine.pool.allocated_bytes, host_memory.stats()))

    weight.register_hook(hook)
    trainer.train()
    assert trainer.uses_engine and len(during_backward) == 2
    assert [held for held, _ in during_backward] == [0, 0]
    kept = [s.cached_bytes for _, s in during_backward]
    assert all(k <= s.limit_bytes for k, (_, s) in zip(kept, during_backward))
    held = [h["rollout/peak_kv_gb"] for h in trainer.state.log_history if "rollout/peak_kv_gb" in h]
    assert held and all(v > 0 for v in held)  # the rollouts did use the pool


def _llama4(chunk: int):
    return build_tiny_model("llama4_text", attention_chunk_size=chunk).train()


def test_packed_chunked_attention_counts_chunks_from_each_rows_first_token(tmp_path, tokenizer, dataset):
    """Llama 4 (chunks of 3; the second group's 7 padding columns are not a multiple of 3): the packed forward's
    log-probs and entropies are the model's own padded forward's (TRL's fused head cannot run `Llama4ForCausalLM`,
    whose `base_model` is itself, so the reference is the model's forward). Counting chunks from column 0 was 5%
    off."""
    ours = InfiniteGRPOTrainer(model=_llama4(3), reward_funcs=token_sum_reward, processing_class=tokenizer,
                               args=cpu_args(tmp_path, per_device_train_batch_size=6, num_generations=3,
                                             max_completion_length=7, temperature=0.9), train_dataset=dataset)
    forward = ours.shared_prefix
    assert forward is not None, ours.shared_prefix_reason
    inputs = trl_batch(ours.model.config.vocab_size)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        want = padded_reference(forward.model, forward._previous, ids, mask, 7, forward.head)
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 7, compute_entropy=True)
    assert_close(got[0], want[0], "log-probs")
    assert_close(got[1], want[1], "entropies")


@pytest.mark.parametrize("chunk", [2, 3, 4, 5, 7, 8, 10])
def test_probe_pads_by_a_non_multiple_of_the_chunk(chunk):
    L = max(24, chunk + 2)
    _, mask, keep = probe_batch(torch.arange(4, 4 + L), [chunk])
    pads = (mask[:, :-keep] == 0).sum(1)
    assert any(int(p) % chunk for p in pads)


def test_probe_refuses_chunks_counted_from_column_0(monkeypatch):
    """The start-up probe sees a packed forward that counts chunks from column 0 (the old bug) and refuses it."""
    from trl_infinite.trainer.logprobs import HeadSpec

    def column_masks(self, sliding_window, chunk_size):  # the bug: the masks numbered by column
        from trl_infinite.trainer.packing import _mask

        pos = self.position_ids[0]
        return (_mask(pos, self.shared_index, self.shared_valid, self.shared_index, self.shared_valid,
                      sliding_window, chunk_size),
                _mask(pos, self.row_index, self.row_valid, self.row_keys, self.row_keys_valid, sliding_window,
                      chunk_size))

    model = _llama4(5)
    head = HeadSpec.from_model(model, 1.0, False)
    monkeypatch.setattr(GroupedLayout, "masks", column_masks)
    with pytest.raises(SharedPrefixUnsupported, match="does not reproduce"):
        SharedPrefixForward.install(model, head)
    monkeypatch.undo()
    SharedPrefixForward.install(model, head).uninstall()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_llama4_temperature_tuning_scales_by_trls_column(checkpointing):
    """Llama 4's NoPE layers scale queries by the token's index in the forward (`floor_scale` 4 here, 8192 in real
    configs), which in TRL's padded forward is the token's column: the packed forward applies the same scale from
    each token's column, so its log-probs and gradients are the padded forward's far past `floor_scale` (the old
    packed forward was refused here, and ran TRL's forward past it), with gradient checkpointing's recomputation
    too; the model's own scaling is back after each packed forward and after `uninstall`."""
    from trl_infinite.trainer.logprobs import HeadSpec

    model = build_tiny_model("llama4_text", no_rope_layers=[0, 1], floor_scale=4, attn_scale=2.0).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # sharp attention: the scale matters
    head = HeadSpec.from_model(model, 1.0, False)
    forward = SharedPrefixForward.install(model, head)
    if checkpointing:
        model.gradient_checkpointing_enable()
    inputs = trl_batch(model.config.vocab_size)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    layout = pack_rows(ids, mask, 7)
    assert layout.num_tokens > 4  # past `floor_scale` (4): the temperature tuning matters
    params = [p for p in model.parameters() if p.requires_grad]
    want = padded_reference(model, forward._previous, ids, mask, 7, head)[0]
    want_grads = torch.autograd.grad(want.sum(), params, allow_unused=True)
    got = model(prefix_groups=forward.context(layout, entropy=False)).log_probs
    got_grads = torch.autograd.grad(got.sum(), params, allow_unused=True)
    assert_close(got, want, "log-probs")
    for g, w in zip(got_grads, want_grads):
        if w is not None:
            assert_close(g, w, "gradient")
    tuned = [m for m in model.modules() if getattr(m, "floor_scale", None) == 4 and not m.use_rope]
    assert [m.attn_temperature_tuning for m in tuned] == [True]
    forward.uninstall()
    model.config.attn_temperature_tuning = False  # (the module reads its own attribute, not the config)
    assert [m.attn_temperature_tuning for m in tuned] == [True] and not tuned[0]._forward_hooks


# ---------------------------------------------------------------------------------------------- one decision per dtype
DECISIONS = {  # model -> installed (exact) or refused, the same in every dtype
    "opt": (lambda: build_tiny_model("opt", dropout=0.0, attention_dropout=0.0), False),  # positions from the mask
    "llama4 chunk 7": (lambda: _llama4(7), True),
    "llama4 chunk 8": (lambda: _llama4(8), True),
    "llama": (lambda: build_tiny_model("llama"), True),
}
DTYPES = ["float32", "bf16 weights", "float32 weights under bf16 autocast"]


def _install(model, dtype: str):
    from trl_infinite.trainer.logprobs import HeadSpec

    if dtype == "bf16 weights":
        model = model.to(torch.bfloat16)
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16)) if "autocast" in dtype else None
    return SharedPrefixForward.install(model.train(), HeadSpec.from_model(model, 1.0, False), autocast=autocast)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECISIONS))
def test_the_decision_is_the_same_in_every_dtype(case, dtype):
    """The structural decision is made in float32 whatever the run's dtype: OPT (positions from the attention mask,
    2e-2 off in float32, 8% under bf16 autocast) is refused in bf16 too, where a fixed 5e-2 tolerance accepted it;
    Llama 4 with chunks of 7 / 8 (padding not a multiple of the chunk) and Llama are installed everywhere."""
    make, exact = DECISIONS[case]
    if exact:
        _install(make(), dtype).uninstall()
        return
    with pytest.raises(SharedPrefixUnsupported, match="does not reproduce") as info:
        _install(make(), dtype)
    assert ("in float32" in str(info.value)) == (dtype != "float32")


@pytest.mark.parametrize("case", ["opt", "llama"])
def test_decision_on_a_float32_replica_when_no_copy_fits(monkeypatch, case):
    """16-bit weights too large to copy: the decision is made on a float32 replica built from the config."""
    from trl_infinite.engine.model import replica

    monkeypatch.setattr(replica, "FLOAT32_COPY_MAX_PARAMS", 0)
    make, exact = DECISIONS[case]
    if exact:
        _install(make(), "bf16 weights").uninstall()
    else:
        with pytest.raises(SharedPrefixUnsupported, match="float32 replica"):
            _install(make(), "bf16 weights")


def test_16bit_bound_is_derived_from_the_models_rounding_noise():
    """The run's own 16-bit check is held to 4 x the padded forward's bf16-vs-float32 distance, within 2 to 12
    units of bf16: not the old fixed 5e-2."""
    from trl_infinite.engine.model.exactness import CAP_ULPS, FLOOR_ULPS
    from trl_infinite.trainer.logprobs import HeadSpec
    from trl_infinite.trainer.prefix_probe import float32_decision
    from trl_infinite.trainer.shared_prefix import _structure

    model = build_tiny_model("llama").train()
    ids, _ = _structure(model, None)
    bound = float32_decision(model, HeadSpec.from_model(model, 1.0, False),
                             lambda: torch.autocast("cpu", torch.bfloat16), torch.bfloat16, False, ids, None,
                             SharedPrefixForward.install)
    eps = torch.finfo(torch.bfloat16).eps
    assert bound.noise is not None and 0 < bound.noise < FLOOR_ULPS * eps  # bf16 rounding of a tiny model: ~2e-4
    assert FLOOR_ULPS * eps <= bound.bound <= CAP_ULPS * eps < 5e-2 * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_refused_opt_trains_like_grpo_trainer(tmp_path, tokenizer, dataset, dtype):
    """OPT (float32; bf16 weights; TRL's default `bf16=True`: float32 weights under bf16 autocast) is refused with
    the fallback warning and trains with TRL's forward: loss and every gradient are `GRPOTrainer`'s for the same
    batch."""
    model = build_tiny_model("opt", dropout=0.0, attention_dropout=0.0).train()
    if dtype == "bf16 weights":
        model = model.to(torch.bfloat16)
    kw = dict(per_device_train_batch_size=6, num_generations=3, max_completion_length=7, temperature=0.9,
              gradient_checkpointing=False, bf16="autocast" in dtype)
    ref = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=token_sum_reward, processing_class=tokenizer,
                      args=cpu_args(tmp_path / "trl", cls=GRPOConfig, **kw), train_dataset=dataset)
    with pytest.warns(UserWarning, match="in float32" if dtype != "float32" else "does not reproduce"):
        ours = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, processing_class=tokenizer,
                                   args=cpu_args(tmp_path / "ours", **kw), train_dataset=dataset)
    assert ours.shared_prefix is None and "does not reproduce" in ours.shared_prefix_reason
    for trainer in (ref, ours):
        trainer.current_gradient_accumulation_steps = 1
    inputs = trl_batch(model.config.vocab_size)
    want_loss, want = loss_and_grads(ref, copy.deepcopy(inputs))
    got_loss, got = loss_and_grads(ours, copy.deepcopy(inputs))
    assert_close(got_loss, want_loss, "loss")
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], name)
