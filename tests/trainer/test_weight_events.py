"""The trainer never lets a rollout read KV of older weights (issue 40, `trainer/weight_events.py`): with the pool
kept (`rollout_kv_cache_release=False`) and cross-rollout reuse declared (`rollout_kv_cache_reuse_across_calls`), the
engine's prefix cache is dropped at every optimizer step (transformers' default fused AdamW included, which bumps no
version counter; an optimizer given through `optimizers=`; a step outside the loop) and weight load, and reused
between rollouts of one optimizer step (gradient accumulation)."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_model
from datasets import Dataset
from trainer_helpers import cpu_args, token_sum_reward

from trl_infinite.engine import RolloutEngine
from trl_infinite.trainer import InfiniteGRPOTrainer

PROMPT = "what is 1 plus 2 ? what is 3 times 4 ?"  # one prompt everywhere: a kept cache would hit on every rollout


def _trainer(tmp_path, tokenizer, optimizers=(None, None), **overrides):
    kw = {"max_steps": 3, "rollout_kv_cache_release": False, "rollout_kv_cache_reuse_across_calls": True,
          "rollout_block_size": 2, "learning_rate": 0.5, **overrides}
    return InfiniteGRPOTrainer(model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward,
                               args=cpu_args(tmp_path, **kw), train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 8}),
                               processing_class=tokenizer, optimizers=optimizers)


@pytest.fixture
def calls(monkeypatch):
    """(optimizer steps done, prefix-cache hit tokens) of every engine call."""
    out: list[tuple[int, int]] = []
    generate = RolloutEngine.generate

    def spy(engine, *args, **kwargs):
        result = generate(engine, *args, **kwargs)
        out.append((spy.trainer.state.global_step, result.stats.prefix_cache_hit_tokens))
        return result

    monkeypatch.setattr(RolloutEngine, "generate", spy)
    return out, spy


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch", "sgd"])
def test_no_hit_across_an_optimizer_step(tmp_path, tokenizer, calls, optim):
    """Two rollouts per optimizer step (`steps_per_generation=1`, 2 accumulation steps): the second of a step reuses
    the first's prompt, the first after a step finds nothing."""
    out, spy = calls
    trainer = spy.trainer = _trainer(tmp_path, tokenizer, optim=optim, gradient_accumulation_steps=2,
                                     steps_per_generation=1)
    trainer.train()
    assert [step for step, _ in out] == [0, 0, 1, 1, 2, 2]
    assert [hits for _, hits in out[::2]] == [0, 0, 0]  # first rollout after each step
    assert all(hits > 0 for _, hits in out[1::2])  # same weights: the cache is reused


def test_a_fused_optimizer_given_through_optimizers(tmp_path, tokenizer, calls):
    out, spy = calls
    model = tiny_model("qwen3").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    trainer = spy.trainer = InfiniteGRPOTrainer(
        model=model, reward_funcs=token_sum_reward, processing_class=tokenizer,
        args=cpu_args(tmp_path, max_steps=3, rollout_kv_cache_release=False, rollout_kv_cache_reuse_across_calls=True,
                      rollout_block_size=2), train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 8}),
        optimizers=(optimizer, None))
    trainer.train()
    assert [hits for _, hits in out] == [0, 0, 0]


def test_a_step_outside_the_loop_and_a_weight_load_reach_the_engine(tmp_path, tokenizer, calls, monkeypatch):
    out, spy = calls
    trainer = spy.trainer = _trainer(tmp_path, tokenizer, max_steps=1)
    trainer.train()
    engine = trainer._engine
    engine.weights.stale = False
    trainer.optimizer.step()  # the step post-hook on the torch optimizer under accelerate's wrapper
    assert engine.weights.stale
    engine.weights.stale = False
    trainer.model.load_state_dict(trainer.model.state_dict())  # the engine's own hook
    assert engine.weights.stale
    engine.weights.stale = False
    trainer.reset_prefix_cache()  # the user's call (a callback that changes the weights)
    assert engine.weights.stale
    for name in ("_load_from_checkpoint", "_load_best_model"):  # what they load is transformers' business
        engine.weights.stale = False
        monkeypatch.setattr(f"trl.GRPOTrainer.{name}", lambda self, *a, **k: None)
        getattr(trainer, name)(*(["checkpoint"] if name == "_load_from_checkpoint" else []))
        assert engine.weights.stale, name


def test_the_step_hook_reaches_through_accelerates_wrapper():
    """The post-step hook sits on the torch optimizer under `AcceleratedOptimizer` (whose own `step` runs no hooks),
    once however often it is installed; the callback reports a step of any optimizer."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from trl_infinite.trainer.weight_events import WeightEvents

    reported = []
    events = WeightEvents(lambda: reported.append(1))
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = Accelerator(cpu=True).prepare_optimizer(torch.optim.AdamW([param], fused=True))
    assert isinstance(optimizer, AcceleratedOptimizer)
    assert events.hook_optimizer(optimizer) and events.hook_optimizer(optimizer.optimizer)
    optimizer.step()
    assert reported == [1]
    assert not events.hook_optimizer(object())  # not a torch optimizer (e.g. DeepSpeed's): the callback only
    events.on_optimizer_step(None, None, None)
    assert reported == [1, 1]
