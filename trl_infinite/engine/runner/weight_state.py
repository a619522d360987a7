"""When the engine's weight-derived state must be recomputed: the prefix cache's KV and the 16-bit weight copy.

Both are computed from the model's weights and kept across `generate` calls where the KV pool is kept
(`kv_cache_release=False`, or a run of `keep_pool=True` calls). No cheap observation of the weights sees every way
they change: `torch.optim.AdamW(fused=True)` (transformers' default `adamw_torch_fused`) and `p.data.copy_(...)`
bump no version counter, a parameter made under `torch.inference_mode()` has none, and disabling or switching a
PEFT adapter changes no parameter at all. So the rule is an explicit one (`WeightTracker.begin_call`):

- within a run of `keep_pool=True` calls (the turns of one tool loop) the weights are the same: the state is kept;
- across calls, it is kept only where the caller declared it tells the engine about every weight change
  (`kv_cache_reuse_across_calls=True`, then `RolloutEngine.reset_prefix_cache()` after each change; the trainer does
  it at every optimizer step and weight load); by default it is recomputed at every call;
- in every case, a changed fingerprint (`weights_fingerprint`: each parameter's and buffer's address and version
  counter, and the adapter state of PEFT's tuner layers) or a `load_state_dict` on the model since the last call
  drops it too: a backstop, not the rule.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn


def adapter_state(model: nn.Module) -> tuple:
    """What PEFT's tuner layers (duck-typed: `merged_adapters` and `_disable_adapters`) run with besides their
    parameters: the active adapters, the disabled flag, the merged adapters and LoRA's scalings, per layer."""
    out = []
    for name, module in model.named_modules():
        if not hasattr(module, "merged_adapters") or not hasattr(module, "_disable_adapters"):
            continue
        active = getattr(module, "active_adapters", ())
        scaling = getattr(module, "scaling", None)
        out.append((name, tuple(active) if isinstance(active, (list, tuple)) else (active,),
                    bool(module._disable_adapters), tuple(module.merged_adapters),
                    tuple(sorted(scaling.items())) if isinstance(scaling, dict) else None))
    return tuple(out)


def weights_fingerprint(model: nn.Module, *extra: torch.Tensor, versions: bool = True) -> tuple:
    """Address and in-place version of every parameter and buffer (0 for inference tensors, which have no version
    counter), and `adapter_state`: a cheap observation that sees an unfused optimizer step, an in-place update through
    the Parameter itself, moved or replaced tensors and adapter switches, but not every route (module docstring).
    `extra`: more tensors observed alike; `versions=False`: addresses only, what a captured or compiled step depends
    on (`decode/static.py`: it reads new values at the same addresses)."""
    tensors = (*model.parameters(), *model.buffers(), *extra)
    if not versions:
        return tuple(t.data_ptr() for t in tensors), adapter_state(model)
    return tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in tensors), adapter_state(model)


def _mark_loaded(tracker: weakref.ref, module: nn.Module, incompatible_keys) -> None:
    alive = tracker()
    if alive is not None:
        alive.changed()


@dataclass
class WeightTracker:
    """Whether what the engine derived from `model`'s weights is still valid at the start of a call."""

    model: nn.Module
    reuse_across_calls: bool  # the caller reports every weight change (`changed`) between calls
    stale: bool = True  # a change was reported (`changed`, a `load_state_dict`) since the last call began
    in_run: bool = False  # the last call had `keep_pool=True` and `end_run` was not called since
    fingerprint: tuple | None = None
    _hook: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # `load_state_dict` on the model (a checkpoint, `assign=True`, inference tensors): a reported change
        self._hook = self.model.register_load_state_dict_post_hook(partial(_mark_loaded, weakref.ref(self)))
        weakref.finalize(self, self._hook.remove)

    def changed(self) -> None:
        """The weights changed (or may have): the next call recomputes what was derived from them."""
        self.stale = True

    def begin_call(self) -> bool:
        """At the start of a call: True where the weight-derived state must be dropped (module docstring)."""
        fingerprint = weights_fingerprint(self.model)
        keep = not self.stale and fingerprint == self.fingerprint and (self.in_run or self.reuse_across_calls)
        self.stale, self.fingerprint = False, fingerprint
        return not keep

    def end_call(self, keep_pool: bool) -> None:
        self.in_run = keep_pool

    def end_run(self) -> None:
        self.in_run = False

