"""Every registered plug-in is built from `EngineConfig` field values alone; unknown names are refused at config
time naming the field and the registered names; the registry refuses a duplicate name unless asked to replace."""

import pytest
import torch
from _models import tiny_model

from trl_infinite.engine import EngineConfig
from trl_infinite.engine.attention import resolve_backend
from trl_infinite.engine.history import PromptHistory
from trl_infinite.engine.registry import ATTENTION_BACKENDS, BATCH_POLICIES, DRAFTERS, PREDICTORS, SCHEDULERS, Registry
from trl_infinite.engine.sampling_params import SamplingParams
from trl_infinite.engine.scheduling.factory import policies_from_config, predictor_from_config
from trl_infinite.engine.spec_decode import Speculator

CPU = torch.device("cpu")


def test_every_scheduler_and_batch_policy_is_built_from_config():
    assert {"fifo", "sjf", "lfs", "fptas", "infinite", "seer", "lrf", "lfs_max"} <= set(SCHEDULERS)
    assert {"static", "memory", "sla"} <= set(BATCH_POLICIES)
    for name in SCHEDULERS:
        cfg = EngineConfig(scheduler=name)
        policy, _ = policies_from_config(cfg, predictor_from_config(cfg))
        assert policy.name == name
    for name in BATCH_POLICIES:
        cfg = EngineConfig(batch_policy=name, sla_decode_ms=20.0, sla_window=3, sla_min_batch=2, memory_eps=0.2)
        _, admission = policies_from_config(cfg)
        assert admission.name == name


def test_admission_options_reach_the_policies():
    cfg = EngineConfig(batch_policy="sla", sla_decode_ms=20.0, sla_tolerance_ms=2.0, sla_min_batch=2, sla_alpha=4,
                       sla_delta=3, sla_window=7, max_active_sequences=48)
    _, sla = policies_from_config(cfg)
    assert (sla.tol, sla.b_min, sla.b_max, sla.alpha, sla.delta, sla.window) == (2.0, 2, 48, 4, 3, 7)
    _, mem = policies_from_config(EngineConfig(batch_policy="memory", memory_eps=0.5, memory_min_observations=9))
    assert (mem.theta, mem.min_obs) == (0.0, 9)  # Phi^-1(1 - 0.5) = 0


def test_every_length_predictor_is_built_from_config():
    assert {"none", "oracle", "group", "prefix", "history"} <= set(PREDICTORS)
    for name in PREDICTORS:
        cfg = EngineConfig(length_predictor=name, prefix_predictor_k=5, history_fallback="siblings")
        assert predictor_from_config(cfg, PromptHistory(8, 2, 0)).name == name


def test_every_drafter_is_built_from_config():
    assert {"suffix", "ngram", "draft_model", "best_of_n"} <= set(DRAFTERS)
    for name in DRAFTERS:
        cfg = EngineConfig(speculative_method=name, speculative_draft_model=tiny_model(), kv_cache_tokens=256)
        drafter = Speculator(cfg, CPU, cfg.block_size, history=PromptHistory(8, 2, 1000)).build_drafter(
            SamplingParams(max_new_tokens=8))
        assert drafter.name == name


def test_every_attention_backend_is_built_from_config():
    assert {"torch", "triton"} <= set(ATTENTION_BACKENDS)
    for name in ATTENTION_BACKENDS:
        backend = resolve_backend(EngineConfig(attention_backend=name).attention_backend, CPU)
        assert backend is ATTENTION_BACKENDS.get_or_raise(name)
    assert resolve_backend("auto", CPU) is ATTENTION_BACKENDS.get_or_raise("torch")


@pytest.mark.parametrize("field, registry", [
    ("scheduler", SCHEDULERS), ("batch_policy", BATCH_POLICIES), ("length_predictor", PREDICTORS),
    ("speculative_method", DRAFTERS), ("attention_backend", ATTENTION_BACKENDS),
])
def test_unknown_name_names_the_field_and_the_choices(field, registry):
    with pytest.raises(ValueError, match=rf"`{field}` must be one of .*{sorted(registry)[0]}.*got 'no-such'"):
        EngineConfig(**{field: "no-such"})


def test_registry_refuses_a_duplicate_unless_replacing():
    reg = Registry("thing", {"lazy_one": "trl_infinite.engine.scheduling.policies"})
    first, second = type("First", (), {}), type("Second", (), {})
    reg.register("a")(first)
    with pytest.raises(ValueError, match="`thing` 'a' is already registered.*replace=True"):
        reg.register("a")(second)
    assert reg.get_or_raise("a") is first
    reg.register("a", replace=True)(second)
    assert reg.get_or_raise("a") is second and second.name == "a"
    assert reg.names() == ["a", "lazy_one"] and "lazy_one" in reg
    # a built-in name is taken too: registering it loads the built-in, then refuses
    with pytest.raises(ValueError, match="fifo"):
        SCHEDULERS.register("fifo")(type("Mine", (), {}))
    with pytest.raises(ValueError, match="`thing` must be one of \\['a', 'lazy_one'\\], got 'b'"):
        reg.get_or_raise("b")


def test_drafter_and_predictor_options_reach_the_plugins():
    cfg = EngineConfig(speculative_method="best_of_n", speculative_ngram_max_n=6, speculative_ngram_min_n=3,
                       speculative_suffix_max_depth=9, speculative_suffix_min_confidence=0.3,
                       speculative_suffix_min_match=2, speculative_best_of_n_tail_batch=7)
    drafter = Speculator(cfg, CPU, cfg.block_size).build_drafter(SamplingParams(max_new_tokens=8))
    suffix, ngram = drafter.members
    assert (suffix.max_depth, suffix.min_confidence, suffix.min_match) == (9, 0.3, 2)
    assert (ngram.max_n, ngram.min_n, drafter.tail_batch) == (6, 3, 7)
    cfg = EngineConfig(length_predictor="history", history_fallback="prefix", prefix_predictor_k=5,
                       prefix_predictor_min_train=3, prefix_predictor_l2=0.5, history_mean_window=11)
    pred = predictor_from_config(cfg)
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
