"""Every plug-in registry of the engine, by the `EngineConfig` field that names the plug-in.

A leaf module: it imports no plug-in. Each registry lists its built-in names with the module that defines them and
imports that module when one of them is first built (`utils.registry.Registry`), so `EngineConfig` validates names
here without importing schedulers, drafters or kernels, and no plug-in module imports the code that uses it.
"""

from __future__ import annotations

from ..utils.registry import Registry

_SCHED = "trl_infinite.engine.scheduling"
_SPEC = "trl_infinite.spec_decode"
_ATTN = "trl_infinite.engine.attention"

# `SchedulePolicy` classes: which pending sample takes a free slot
SCHEDULERS: Registry[type] = Registry("scheduler", {
    "fifo": f"{_SCHED}.policies",
    **{name: f"{_SCHED}.length_aware" for name in ("sjf", "lfs", "fptas", "infinite", "seer", "lrf", "lfs_max")},
})
# `AdmissionPolicy` classes: how many samples run at once
BATCH_POLICIES: Registry[type] = Registry("batch_policy", {
    name: f"{_SCHED}.admission" for name in ("static", "memory", "sla")
})
# `LengthPredictor` classes of the length-aware schedulers
PREDICTORS: Registry[type] = Registry("length_predictor", {
    **{name: f"{_SCHED}.predictors" for name in ("none", "oracle", "group", "prefix")},
    "history": f"{_SCHED}.history_predictor",
})
# drafter classes/factories, called as `factory(config=EngineConfig, device=torch.device, **extras)`
DRAFTERS: Registry = Registry("speculative_method", {
    "suffix": f"{_SPEC}.suffix", "ngram": f"{_SPEC}.ngram", "draft_model": f"{_SPEC}.draft_model",
    "best_of_n": f"{_SPEC}.best_of_n",
})
# `attention.backends.AttentionBackend` instances (paged attention kernels)
ATTENTION_BACKENDS: Registry = Registry("attention_backend", {
    "torch": f"{_ATTN}.backends", "triton": f"{_ATTN}.triton_backend",
})

register_scheduler = SCHEDULERS.register
register_batch_policy = BATCH_POLICIES.register
register_predictor = PREDICTORS.register
register_drafter = DRAFTERS.register
