"""The policy's full weights for the duration of one rollout under sharded data parallelism (FSDP2, FSDP1).

Under FSDP every parameter is sharded across the processes and each forward all-gathers the parameters it needs (a
collective), so a rollout run on the sharded model would need every process to run the same number of forwards. The
engine runs each process's own prompts for as many decode steps as they take, so instead the rollout gathers every
parameter once, runs all its forwards on the local full weights with no collective, and reshards when it ends
(`rollout_weights`):

- FSDP2 (`fully_shard`, accelerate `fsdp_version: 2`): `FSDPModule.unshard()` on every `fully_shard`ed module (all
  groups at once, their all-gathers overlapped), with `reshard_after_forward` off for the rollout so the engine's
  forwards keep them (its pre-forward unshard is then a no-op and no forward runs a collective), then `reshard()`
  on each and every module's `reshard_after_forward` back as it was;
- FSDP1 (`FullyShardedDataParallel`): `FSDP.summon_full_params(model, recurse=True, writeback=False)`, every wrapped
  module's flat parameter unsharded (TRL's `generate` path summons the root's only, `recurse=False`, and lets each
  layer all-gather in its forward).

The rule is all layers at once: the gathered weights (the model's full size in the all-gather dtype, the mixed
precision `param_dtype` where one is set) exist on every process for the rollout, beside the sharded training state,
and the engine's KV pool is sized from the memory left after the gather (the engine is built, and its pool opened,
inside this context; the pool is released before the weights are resharded). Every process enters and leaves the
context once per rollout (TRL's `_generate`), so the gathers are collectives all processes run alike whatever their
prompts; nothing inside runs one. Each process still generates only its own prompts.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class _ReshardSetting:
    """One FSDP2 module's `reshard_after_forward` state, restored exactly after the rollout."""

    module: torch.nn.Module
    auto: bool
    post_forward_mesh_infos: list


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every `fully_shard`ed module of `model` (root first, in `modules()` order)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def fsdp2_unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Every `fully_shard`ed module of `model` unsharded, and kept so by its forwards, until the context ends; then
    resharded (the gathered storage freed) with `reshard_after_forward` as before."""
    modules = fsdp2_modules(model)
    settings = []
    for m in modules:
        state = m._get_fsdp_state()
        settings.append(_ReshardSetting(m, state._auto_reshard_after_forward,
                                        [g.post_forward_mesh_info for g in state._fsdp_param_groups]))
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        handles = [m.unshard(async_op=True) for m in modules]
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield
    finally:
        for m in reversed(modules):
            m.reshard()
        for s in settings:
            state = s.module._get_fsdp_state()
            state._auto_reshard_after_forward = s.auto
            for group, info in zip(state._fsdp_param_groups, s.post_forward_mesh_infos):
                group.post_forward_mesh_info = info


@contextmanager
def fsdp1_unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP1 flat parameter of `model` unsharded (`summon_full_params(recurse=True, writeback=False)`) and
    kept so by the forwards run inside: a `FULL_SHARD` / `HYBRID_SHARD` module frees its gathered parameters after
    each forward and all-gathers them again in the next (collectives per layer per forward, measured: 54 and 36 in
    one process's two rollouts of the tests' model, following its own decode steps), so for the rollout each handle runs
    as its no-reshard-after-forward counterpart (`SHARD_GRAD_OP`, `_HYBRID_SHARD_ZERO2`: the forward keeps the
    gathered storage and only switches views). On exit the strategies come back and the summon frees the
    gathered storage."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy as S

    keep = {S.FULL_SHARD: S.SHARD_GRAD_OP, S.HYBRID_SHARD: S._HYBRID_SHARD_ZERO2}
    handles = [m._handle for m in FSDP.fsdp_modules(model) if m._handle is not None]
    saved = [h._sharding_strategy for h in handles]
    with FSDP.summon_full_params(model, recurse=True, writeback=False):
        try:
            for h in handles:
                h._sharding_strategy = keep.get(h._sharding_strategy, h._sharding_strategy)
            yield
        finally:
            for h, strategy in zip(handles, saved):
                h._sharding_strategy = strategy


@contextmanager
def rollout_weights(model_wrapped: torch.nn.Module, fsdp_version: int | None) -> Iterator[None]:
    """The full weights of the prepared model `model_wrapped` for one rollout (module docstring); nothing to do
    without FSDP (DDP and ZeRO-1/2 hold full weights; ZeRO-3 gathers in TRL's `unwrap_model_for_generation`)."""
    if fsdp_version == 2:
        with fsdp2_unsharded(model_wrapped):
            yield
    elif fsdp_version == 1:
        with fsdp1_unsharded(model_wrapped):
            yield
    else:
        yield


@contextmanager
def trl_summon_skipped(trainer) -> Iterator[None]:
    """TRL's own generation run inside a rollout's gathered window (the engine's support contract failed at its
    first call): under FSDP1 TRL's `_dist.summon_full_params(recurse=False)` would nest in the window's summon, which
    FSDP1 refuses, and every parameter is summoned already, so TRL's backend sees no FSDP1 for the call."""
    dist = trainer._dist
    if not getattr(trainer, "_weights_gathered", False) or dist.fsdp_version != 1:
        yield
        return
    trainer._dist = copy.copy(dist)
    trainer._dist.fsdp_version = None
    try:
        yield
    finally:
        trainer._dist = dist
