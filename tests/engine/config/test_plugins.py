"""Every registered plug-in is built from `EngineConfig` values alone, the one way (`Registry.build`), refusing
unknown arguments; unknown names are refused at config time naming the field and the registered names; the registry
refuses a duplicate name unless asked to replace."""

import pytest
import torch
from _models import tiny_model

from trl_infinite.engine import EngineConfig
from trl_infinite.engine.attention import resolve_backend
from trl_infinite.engine.call import RolloutCall
from trl_infinite.engine.config.engine_config import HistoryConfig
from trl_infinite.engine.config.registry import (
    ATTENTION_BACKENDS,
    BATCH_POLICIES,
    DRAFTERS,
    PREDICTORS,
    SAMPLING_MODES,
    SCHEDULERS,
    Registry,
)
from trl_infinite.engine.config.sampling_params import SamplingParams
from trl_infinite.engine.sched.block_manager import BlockAllocator
from trl_infinite.engine.sched.history import PromptHistory
from trl_infinite.engine.sched.predictors.base import build_predictor
from trl_infinite.engine.spec_decode import DraftContext, Speculator

CPU = torch.device("cpu")


def _call(cfg: EngineConfig) -> RolloutCall:
    return RolloutCall.build(cfg, [], BlockAllocator(8, cfg.block_size), build_predictor(cfg.scheduling),
                             lambda call: None)  # built, not run: no executor needed


def test_every_scheduler_batch_policy_and_sampling_mode_is_built_from_config():
    assert {"fifo", "sjf", "lfs", "fptas", "infinite", "seer", "lrf", "lfs_max"} <= set(SCHEDULERS)
    assert {"static", "memory", "sla"} <= set(BATCH_POLICIES)
    assert {"full_group", "micro_group", "fixed_slot", "dynamic_slot"} <= set(SAMPLING_MODES)
    for name in SCHEDULERS:
        assert _call(EngineConfig(scheduler=name)).scheduler.policy.name == name
    for name in BATCH_POLICIES:
        cfg = EngineConfig(batch_policy=name, sla_decode_ms=20.0, sla_window=3, sla_min_batch=2, memory_eps=0.2)
        assert _call(cfg).scheduler.admission.name == name
    for name in SAMPLING_MODES:
        call = _call(EngineConfig(sampling_mode=name, max_active_sequences=5))
        assert call.mode.name == name and call.scheduler.mode is call.mode
        assert call.mode.slot_limit == (5 if name in ("micro_group", "fixed_slot") else None)


def test_admission_options_reach_the_policies():
    cfg = EngineConfig(batch_policy="sla", sla_decode_ms=20.0, sla_tolerance_ms=2.0, sla_min_batch=2, sla_alpha=4,
                       sla_delta=3, sla_window=7, max_active_sequences=48)
    sla = _call(cfg).scheduler.admission
    assert (sla.tol, sla.b_min, sla.b_max, sla.alpha, sla.delta, sla.window) == (2.0, 2, 48, 4, 3, 7)
    mem = _call(EngineConfig(batch_policy="memory", memory_eps=0.5, memory_min_observations=9)).scheduler.admission
    assert (mem.theta, mem.min_obs) == (0.0, 9)  # Phi^-1(1 - 0.5) = 0


def test_every_length_predictor_is_built_from_config():
    assert {"none", "oracle", "group", "prefix", "history"} <= set(PREDICTORS)
    for name in PREDICTORS:
        cfg = EngineConfig(length_predictor=name, prefix_predictor_k=5, history_fallback="siblings")
        assert build_predictor(cfg.scheduling, PromptHistory(HistoryConfig(8, 2, 0))).name == name


def test_every_drafter_is_built_from_config():
    assert {"suffix", "ngram", "draft_model", "best_of_n"} <= set(DRAFTERS)
    for name in DRAFTERS:
        cfg = EngineConfig(speculative_method=name, speculative_draft_model=tiny_model(), kv_cache_tokens=256)
        drafter = Speculator(cfg, CPU, history=PromptHistory(HistoryConfig(8, 2, 1000))).build_drafter(
            SamplingParams(max_new_tokens=8))
        assert drafter.name == name


@pytest.mark.parametrize("registry, args", [
    (SCHEDULERS, lambda cfg: (cfg.scheduling, build_predictor(cfg.scheduling), None)),
    (BATCH_POLICIES, lambda cfg: (cfg.scheduling,)),
    (SAMPLING_MODES, lambda cfg: (cfg.scheduling,)),
    (PREDICTORS, lambda cfg: (cfg.scheduling, None)),
    (DRAFTERS, lambda cfg: (cfg.speculative, DraftContext(CPU, SamplingParams(), cfg, None, tiny_model()))),
])
def test_plugins_are_built_one_way_and_refuse_unknown_arguments(registry, args):
    """`Registry.build(name, *args)` with the registry's arguments builds every plug-in; an extra keyword is a
    `TypeError` naming it (no plug-in swallows unknown options)."""
    cfg = EngineConfig(sla_decode_ms=20.0, kv_cache_tokens=256)
    for name in registry:
        assert registry.build(name, *args(cfg)).name == name
        with pytest.raises(TypeError, match="max_n"):
            registry.build(name, *args(cfg), max_n=3)


def test_every_attention_backend_is_built_from_config():
    assert {"torch", "triton"} <= set(ATTENTION_BACKENDS)
    for name in ATTENTION_BACKENDS:
        backend = resolve_backend(EngineConfig(attention_backend=name).decode.attention_backend, CPU)
        assert backend is ATTENTION_BACKENDS.get_or_raise(name)
    assert resolve_backend("auto", CPU) is ATTENTION_BACKENDS.get_or_raise("torch")


@pytest.mark.parametrize("field, registry", [
    ("scheduler", SCHEDULERS), ("batch_policy", BATCH_POLICIES), ("length_predictor", PREDICTORS),
    ("speculative_method", DRAFTERS), ("attention_backend", ATTENTION_BACKENDS), ("sampling_mode", SAMPLING_MODES),
])
def test_unknown_name_names_the_field_and_the_choices(field, registry):
    with pytest.raises(ValueError, match=rf"`{field}` must be one of .*{sorted(registry)[0]}.*got 'no-such'"):
        EngineConfig(**{field: "no-such"})


def test_registry_refuses_a_duplicate_unless_replacing():
    reg = Registry("thing", {"lazy_one": "trl_infinite.engine.sched.policies.ordering"})
    first, second = type("First", (), {}), type("Second", (), {})
    reg.register("a")(first)
    with pytest.raises(ValueError, match="`thing` 'a' is already registered.*replace=True"):
        reg.register("a")(second)
    assert reg.get_or_raise("a") is first
    reg.register("a", replace=True)(second)
    assert reg.get_or_raise("a") is second and second.name == "a"
    assert reg.names() == ["lazy_one", "a"] and "lazy_one" in reg  # built-ins first, in their listed order
    # a built-in name is taken too: registering it loads the built-in, then refuses
    with pytest.raises(ValueError, match="fifo"):
        SCHEDULERS.register("fifo")(type("Mine", (), {}))
    with pytest.raises(ValueError, match="`thing` must be one of \\['lazy_one', 'a'\\], got 'b'"):
        reg.get_or_raise("b")


def test_drafter_and_predictor_options_reach_the_plugins():
    cfg = EngineConfig(speculative_method="best_of_n", speculative_ngram_max_n=6, speculative_ngram_min_n=3,
                       speculative_suffix_max_depth=9, speculative_suffix_min_confidence=0.3,
                       speculative_suffix_min_match=2, speculative_best_of_n_tail_batch=7)
    drafter = Speculator(cfg, CPU).build_drafter(SamplingParams(max_new_tokens=8))
    suffix, ngram = drafter.members
    assert (suffix.max_depth, suffix.min_confidence, suffix.min_match) == (9, 0.3, 2)
    assert (ngram.max_n, ngram.min_n, drafter.tail_batch) == (6, 3, 7)
    cfg = EngineConfig(length_predictor="history", history_fallback="prefix", prefix_predictor_k=5,
                       prefix_predictor_min_train=3, prefix_predictor_l2=0.5, history_mean_window=11)
    pred = build_predictor(cfg.scheduling)
    assert (pred.prefix.prefix_k, pred.prefix.min_train, pred.prefix.head.l2, pred.recent.maxlen) == (5, 3, 0.5, 11)


@pytest.mark.parametrize("kwargs, field", [
    (dict(memory_eps=1.0), "memory_eps"), (dict(memory_min_observations=0), "memory_min_observations"),
    (dict(sla_window=0), "sla_window"), (dict(sla_alpha=0), "sla_alpha"), (dict(sla_tolerance_ms=-1), "sla_tolerance_ms"),
    (dict(batch_policy="sla", sla_decode_ms=5.0, sla_min_batch=64, max_active_sequences=8), "sla_min_batch"),
    (dict(speculative_ngram_min_n=3, speculative_ngram_max_n=2), "speculative_ngram_max_n"),
    (dict(speculative_suffix_min_confidence=1.5), "speculative_suffix_min_confidence"),
    (dict(prefix_predictor_min_train=0), "prefix_predictor_min_train"), (dict(history_mean_window=0), "history_mean_window"),
])
def test_plugin_options_are_validated_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        EngineConfig(**kwargs)
