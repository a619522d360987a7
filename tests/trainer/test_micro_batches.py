"""`trainer/micro_batches.py`: the gradient accumulated over one generation batch equals vanilla `GRPOTrainer`'s for the
same completions, although the micro batches are length-sorted and each padded only to its own longest sequence."""

import pytest
import torch
from _models import tiny_model
from trainer_helpers import GradCapture, cpu_args, token_sum_reward
from trl import GRPOConfig, GRPOTrainer

from trl_infinite.testing.tiny_configs import build_tiny_model
from trl_infinite.trainer import InfiniteGRPOTrainer
from trl_infinite.trainer.micro_batches import make_micro_batches, trim_padding


def fixed_completions(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Deterministic completions of very different lengths (1..9 tokens), no EOS, a function of the row only."""
    out = []
    for i, p in enumerate(prompt_ids):
        n = 1 + (7 * i + sum(p)) % 9
        out.append([4 + (sum(p) + 3 * i + j) % 90 for j in range(n)])
    return out, None


def accumulated_grads(cls, config_cls, tmp_path, tokenizer, dataset, generate=fixed_completions, model=None,
                      **overrides):
    args = cpu_args(
        tmp_path / cls.__name__, cls=config_cls, gradient_accumulation_steps=3, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=9, max_grad_norm=0.0, **overrides,
    )
    capture = GradCapture()
    trainer = cls(
        model=(model if model is not None else tiny_model("qwen3")).train(), reward_funcs=token_sum_reward, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[capture],
    )
    if generate is not None:
        trainer._generate_single_turn = generate
    trainer.train()
    return capture.grads, trainer


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
def test_accumulated_gradient_matches_trl(tmp_path, tokenizer, dataset, loss_type):
    ours, _ = accumulated_grads(InfiniteGRPOTrainer, None, tmp_path, tokenizer, dataset, loss_type=loss_type)
    ref, _ = accumulated_grads(GRPOTrainer, GRPOConfig, tmp_path, tokenizer, dataset, loss_type=loss_type)
    assert ours.keys() == ref.keys() and len(ours) > 0
    scale = max(g.abs().max().item() for g in ref.values())
    assert scale > 0
    for name in ref:
        # float32 sums over differently padded/ordered micro batches: equal up to rounding
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


SPLIT_DEPENDENT = {
    "entropy_bonus": dict(entropy_coef=0.5),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    "moe_aux_loss": dict(router_aux_loss_coef=0.5),
}


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "padded"])
@pytest.mark.parametrize("term", list(SPLIT_DEPENDENT))
def test_split_dependent_terms_get_trls_split(tmp_path, tokenizer, dataset, term, shared):
    """The entropy bonus (a token mean per micro batch), the top-entropy quantile (over the micro batch) and the MoE
    router loss (over the micro batch's tokens) depend on which rows share a micro batch: with them on, the micro
    batches are TRL's own random split (same generator draw), so the gradient is `GRPOTrainer`'s. Grouping rows by
    prompt or length was off by up to 100%."""
    model = (lambda: build_tiny_model("qwen2_moe")) if term == "moe_aux_loss" else (lambda: tiny_model("qwen3"))
    kw = dict(SPLIT_DEPENDENT[term], loss_type="dapo")
    ours, trainer = accumulated_grads(InfiniteGRPOTrainer, None, tmp_path, tokenizer, dataset, model=model(),
                                      shared_prefix_training=shared, **kw)
    assert trainer.split_dependent_loss
    ref, _ = accumulated_grads(GRPOTrainer, GRPOConfig, tmp_path, tokenizer, dataset, model=model(), **kw)
    assert ours.keys() == ref.keys() and ref
    scale = max(g.abs().max().item() for g in ref.values())
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_engine_completions_give_trl_gradient(tmp_path, tokenizer, dataset, monkeypatch):
    """Record what the engine generates, replay exactly those completions through vanilla TRL: same gradient."""
    recorded = []
    original = InfiniteGRPOTrainer._generate_single_turn

    def recording(self, *args, **kwargs):
        completions, logprobs = original(self, *args, **kwargs)
        assert len(logprobs) == len(completions) and all(len(a) == len(b) for a, b in zip(logprobs, completions))
        recorded.append(completions)
        return completions, logprobs

    monkeypatch.setattr(InfiniteGRPOTrainer, "_generate_single_turn", recording)
    # seed 1 (the same for both runs: same data order): the engine's samples end at EOS after several lengths
    ours, _ = accumulated_grads(InfiniteGRPOTrainer, None, tmp_path, tokenizer, dataset, generate=None, seed=1)
    assert len({len(c) for c in recorded[0]}) > 1  # the engine produced completions of several lengths

    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return recorded[0], None

    ref, _ = accumulated_grads(GRPOTrainer, GRPOConfig, tmp_path, tokenizer, dataset, generate=replay, seed=1)
    scale = max(g.abs().max().item() for g in ref.values())
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_micro_batches_sorted_and_trimmed():
    torch.manual_seed(0)
    lengths = [5, 1, 3, 8, 2, 7]
    prompt_lens = [2, 4, 3, 1, 4, 2]
    B, P, C = len(lengths), max(prompt_lens), max(lengths)
    completion_mask = torch.tensor([[1] * n + [0] * (C - n) for n in lengths])
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in prompt_lens])
    batch = {
        "prompt_ids": torch.arange(B * P).view(B, P), "prompt_mask": prompt_mask,
        "completion_ids": torch.arange(B * C).view(B, C), "completion_mask": completion_mask,
        "advantages": torch.arange(B, dtype=torch.float), "num_items_in_batch": torch.tensor(26),
    }
    chunks = make_micro_batches(batch, 3, "grpo")
    assert sorted(int(c["completion_mask"].sum()) for c in chunks) == [3, 8, 15]  # {1,2} {3,5} {7,8}
    for c in chunks:
        assert c["completion_mask"].shape[1] == int(c["completion_mask"].sum(1).max())  # own longest
        assert c["prompt_ids"].shape[1] == P  # the prompt columns stay: they number the tokens (TRL's positions)
        assert c["completion_mask"][:, -1].any()
        assert c["num_items_in_batch"] is batch["num_items_in_batch"]
        for row in range(2):  # rows stay intact: ids/advantages move together
            b = int(c["advantages"][row])
            n = lengths[b]
            assert c["completion_ids"][row, :n].tolist() == batch["completion_ids"][b, :n].tolist()
    # bnpo keeps a random split, still trimmed; rounding to pad_to_multiple_of
    assert len(make_micro_batches(batch, 2, "bnpo")) == 2
    assert trim_padding(batch, multiple=4)["completion_ids"].shape[1] == 8
    one = {k: (v[1:2] if k != "num_items_in_batch" else v) for k, v in batch.items()}
    trimmed = trim_padding(one, multiple=4)
    assert trimmed["completion_ids"].shape[1] == 4 and trimmed["prompt_ids"].shape[1] == P
    assert all(c["completion_ids"].shape[1] == C for c in make_micro_batches(batch, 3, "grpo", trim=False))


def test_split_metrics_warned_once_with_several_processes(tmp_path, tokenizer, dataset, model, monkeypatch):
    """With several processes TRL's per-micro-batch metrics (`entropy`, `kl`, the clip ratios) are not composed over
    TRL's micro batches (TRL's metric code reduces across processes in each loss call): one warning names them."""
    from accelerate import Accelerator

    args = cpu_args(tmp_path, steps_per_generation=2, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                    max_steps=2)
    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer)
    trainer._generate_single_turn = fixed_completions
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))  # (one process does the work)
    with pytest.warns(UserWarning) as caught:
        trainer.train()
    split = [str(w.message) for w in caught if "over its own micro batches" in str(w.message)]
    assert len(split) == 1 and "`entropy`" in split[0] and "`clip_ratio/low_min`" in split[0], split


@pytest.mark.parametrize("by_group", [False, True], ids=["by_length", "by_group"])
def test_micro_batches_draw_trls_permutation_and_tag_its_split(by_group):
    """Every split draws exactly TRL's `shuffle_sequence_dict` permutation (the generator is left as TRL leaves it),
    and each row carries its micro batch in TRL's split (`TRL_SET_KEY`), over which the metrics are composed."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from trl_infinite.trainer.micro_batches import TRL_SET_KEY

    B, P, C = 8, 3, 6
    lengths = [5, 1, 3, 6, 2, 4, 6, 1]
    batch = {
        "prompt_ids": torch.arange(B * P).view(B, P) // (2 * P) if by_group else torch.arange(B * P).view(B, P),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.arange(B * C).view(B, C),
        "completion_mask": torch.tensor([[1] * n + [0] * (C - n) for n in lengths]),
        "advantages": torch.arange(B, dtype=torch.float),
    }
    torch.manual_seed(3)
    ours = make_micro_batches(batch, 2, "grpo", by_group=by_group, tag_trl_sets=True)
    after_ours = torch.random.get_rng_state()
    torch.manual_seed(3)
    trl = split_tensor_dict(shuffle_sequence_dict(batch), 2)
    assert torch.equal(after_ours, torch.random.get_rng_state())
    trl_set = {int(a): t for t, chunk in enumerate(trl) for a in chunk["advantages"]}
    tagged = {int(a): int(s) for chunk in ours for a, s in zip(chunk["advantages"], chunk[TRL_SET_KEY])}
    assert tagged == trl_set
    if by_group:  # whole groups per micro batch still
        for chunk in ours:
            assert torch.unique(chunk["prompt_ids"], dim=0).shape[0] == 2
