"""The training events that change the policy's weights, reported to the rollout engine (`reset_prefix_cache`).

The engine keeps what it computed from the weights (cached prefixes, the 16-bit weight copy) across rollouts only
under `rollout_kv_cache_reuse_across_calls=True` with `rollout_kv_cache_release=False`; it then relies on its caller
to report every weight change, because no cheap observation of the weights sees them all (a fused AdamW step, the
default `adamw_torch_fused`, bumps no version counter: `engine/runner/weight_state.py`). The trainer reports:

- every optimizer step, at two points: `WeightEvents.on_optimizer_step`, the `TrainerCallback` event transformers'
  loop fires right after `optimizer.step()` whatever the optimizer is (a torch optimizer, accelerate's
  `AcceleratedOptimizer` wrapper, DeepSpeed's own optimizer, which is not a torch optimizer), and a step post-hook on
  the torch optimizer under accelerate's wrapper (`hook_optimizer`, installed when the trainer creates or is given
  it), which also sees a step made outside the loop;
- every weight load: `_load_from_checkpoint` (resume) and `_load_best_model` (`InfiniteGRPOTrainer`), and any
  `load_state_dict` on the model (the engine's own hook).

Adapter switches (TRL's reference forward under `disable_adapter()` / a reference adapter) need no event: the engine
compares PEFT's adapter state at every call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback


class WeightEvents(TrainerCallback):
    """Calls `notify()` after every optimizer step of the training loop (the callback) and of the optimizers it
    hooked (`hook_optimizer`)."""

    def __init__(self, notify: Callable[[], None]):
        self.notify = notify
        self._hooked: weakref.WeakSet = weakref.WeakSet()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.notify()

    def hook_optimizer(self, optimizer) -> bool:
        """A step post-hook on the torch optimizer `optimizer` is or wraps (accelerate's `AcceleratedOptimizer`,
        whose own `step` runs no hooks, holds it as `.optimizer`), once per optimizer; False where there is none (the
        callback alone reports its steps)."""
        inner = optimizer
        while isinstance(inner, AcceleratedOptimizer):  # DeepSpeed's wrapper too (its inner one may be no torch one)
            inner = inner.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            return False
        if inner not in self._hooked:
            notify = self.notify
            inner.register_step_post_hook(lambda opt, args, kwargs: notify())
            self._hooked.add(inner)
        return True
