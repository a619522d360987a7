"""`InfiniteGRPOConfig`: every rollout field maps to the engine, bad values raise naming the field."""

from dataclasses import fields

import pytest
from trainer_helpers import cpu_args

from trl_infinite.engine import EngineConfig
from trl_infinite.engine.config.sections import flags
from trl_infinite.trainer import InfiniteGRPOConfig, engine_config_from_args
from trl_infinite.trainer.config import TRAINER_ONLY


def test_rollout_fields_map_to_engine_config_and_have_help(tmp_path):
    args = cpu_args(tmp_path)
    engine_fields = {f.name for f in flags(EngineConfig)}
    rollout = [f for f in fields(InfiniteGRPOConfig) if f.name.startswith("rollout_")]
    assert len(rollout) >= 6
    for f in rollout:
        assert f.name in TRAINER_ONLY or f.name[len("rollout_"):] in engine_fields, f.name
        assert f.metadata.get("help"), f.name
    # defaults are the engine's own defaults
    assert engine_config_from_args(args) == EngineConfig()


def test_values_reach_the_engine_config(tmp_path):
    args = cpu_args(
        tmp_path, rollout_sampling_mode="micro_group", rollout_max_active_sequences=3, rollout_kv_cache_tokens=512,
        rollout_block_size=8,
    )
    cfg = engine_config_from_args(args)
    assert (cfg.scheduling.sampling_mode, cfg.scheduling.max_active_sequences, cfg.kv_cache.tokens, cfg.block_size) == (
        "micro_group", 3, 512, 8,
    )
    args = cpu_args(
        tmp_path, rollout_scheduler="infinite", rollout_length_predictor="group", rollout_chunk_tokens=32,
        rollout_speculative_method="suffix", rollout_speculative_num_tokens=3, rollout_speculative_adaptive=False,
    )
    cfg = engine_config_from_args(args)
    scheduling, speculative = cfg.scheduling, cfg.speculative
    assert (scheduling.scheduler, scheduling.length_predictor, scheduling.chunk_tokens) == ("infinite", "group", 32)
    assert (speculative.method, speculative.num_tokens, speculative.adaptive) == ("suffix", 3, False)


def test_every_engine_setting_is_a_cli_flag():
    """Each `EngineConfig` setting has its `rollout_` twin, parsed from argv."""
    from transformers import HfArgumentParser

    rollout = {f.name[len("rollout_"):] for f in fields(InfiniteGRPOConfig)
               if f.name.startswith("rollout_") and f.name not in TRAINER_ONLY}
    assert {f.name for f in flags(EngineConfig)} == rollout
    (args,) = HfArgumentParser(InfiniteGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--use_cpu", "--bf16", "False", "--rollout_scheduler", "sjf",
         "--rollout_speculative_method", "ngram", "--rollout_chunk_tokens", "64", "--rollout_speculative_adaptive",
         "False"]
    )
    assert (args.rollout_scheduler, args.rollout_speculative_method, args.rollout_chunk_tokens) == ("sjf", "ngram", 64)
    assert args.rollout_speculative_adaptive is False


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"rollout_sampling_mode": "bogus"}, "rollout_sampling_mode"),
        ({"rollout_max_active_sequences": 0}, "rollout_max_active_sequences"),
        ({"rollout_max_active_sequences": None}, "rollout_max_active_sequences"),
        ({"rollout_kv_cache_gb": -1.0}, "rollout_kv_cache_gb"),
        ({"rollout_kv_cache_tokens": 0}, "rollout_kv_cache_tokens"),
        ({"rollout_kv_cache_gb": 1.0, "rollout_kv_cache_tokens": 64}, "rollout_kv_cache_tokens"),
        ({"rollout_kv_cache_fraction": 1.5}, "rollout_kv_cache_fraction"),
        ({"rollout_block_size": 0}, "rollout_block_size"),
        ({"rollout_attention_backend": "flash9"}, "rollout_attention_backend"),
        ({"rollout_scheduler": "nope"}, "rollout_scheduler"),
        ({"rollout_batch_policy": "nope"}, "rollout_batch_policy"),
        ({"rollout_length_predictor": "psychic"}, "rollout_length_predictor"),
        ({"rollout_prefix_predictor_k": 0}, "rollout_prefix_predictor_k"),
        ({"rollout_fptas_epsilon": 0.0}, "rollout_fptas_epsilon"),
        ({"rollout_chunk_tokens": 0}, "rollout_chunk_tokens"),
        ({"rollout_batch_policy": "sla"}, "rollout_sla_decode_ms"),
        ({"rollout_speculative_method": "oracle"}, "rollout_speculative_method"),
        ({"rollout_speculative_num_tokens": 0}, "rollout_speculative_num_tokens"),
        ({"rollout_speculative_method": "draft_model"}, "rollout_speculative_draft_model"),
        ({"rollout_speculative_adaptive": "yes"}, "rollout_speculative_adaptive"),
        ({"rollout_reward_executor": "process"}, "rollout_reward_executor"),
        ({"host_tensor_cache_mb": -1}, "host_tensor_cache_mb"),
        ({"host_tensor_cache_mb": 1.5}, "host_tensor_cache_mb"),
    ],
)
def test_invalid_values_raise_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        cpu_args(tmp_path, **overrides)


def test_hybrid_model_falls_back_to_trls_generation(tmp_path, tokenizer, dataset):
    """A Mamba model fails the engine's support contract: the trainer says so once (naming the model type, the
    feature and `use_vllm=True`) and generates with TRL's own path, as `GRPOTrainer` would."""
    from trainer_helpers import token_sum_reward

    from trl_infinite.testing.tiny_configs import build_tiny_model
    from trl_infinite.trainer import InfiniteGRPOTrainer

    model = build_tiny_model("mamba", vocab_size=len(tokenizer))
    # the feature as the installed transformers builds it: `linear_attention` layers (5.24) or stateful mixers (5.0)
    feature = "(linear_attention|stateful non-attention mixers)"
    with pytest.warns(UserWarning, match=f"TRL's own path.*`mamba`.*{feature}.*use_vllm=True"):
        trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=cpu_args(tmp_path),
                                      train_dataset=dataset, processing_class=tokenizer)
    assert not trainer.uses_engine


def test_model_refused_by_the_engine_contract_trains_with_trls_generation(tmp_path, tokenizer, dataset):
    """BLOOM passes the structural check at construction but computes attention in its own modules: the routing
    probe refuses it when the engine is built (first rollout); that rollout and every later one run TRL's own
    `generate`, with one warning naming the reason, and training proceeds."""
    import torch
    from trainer_helpers import token_sum_reward

    from trl_infinite.testing.tiny_configs import build_tiny_model
    from trl_infinite.trainer import InfiniteGRPOTrainer

    model = build_tiny_model("bloom", vocab_size=len(tokenizer))
    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=cpu_args(tmp_path),
                                  train_dataset=dataset, processing_class=tokenizer)
    assert trainer.uses_engine
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.warns(UserWarning, match="TRL's own path.*`bloom`.*use_vllm=True") as record:
        trainer.train()
    assert len([w for w in record if "TRL's own path" in str(w.message)]) == 1
    assert not trainer.uses_engine and "rollout/decode_steps" not in trainer.state.log_history[0]
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_rollout_fields_are_generated_from_the_engine_config():
    """Every `EngineConfig` setting (nested ones included) has its `rollout_` twin with the engine's default, type
    (or the documented string form the command line parses) and help, and docs/trainer.md's table lists it."""
    import pathlib
    from typing import get_type_hints

    from trl_infinite.trainer.config import CLI_TYPES

    twins = {f.name: f for f in fields(InfiniteGRPOConfig)}
    twin_types = get_type_hints(InfiniteGRPOConfig)
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "trainer.md").read_text()
    for flag in flags(EngineConfig):
        twin = twins[f"rollout_{flag.name}"]
        assert twin.default == flag.default, flag.name
        engine_type = get_type_hints(flag.owner)[flag.path[-1]]
        want = eval(CLI_TYPES[flag.name]) if flag.name in CLI_TYPES else engine_type
        assert twin_types[twin.name] == want, flag.name
        assert twin.metadata["help"].startswith(flag.field.metadata["help"]), flag.name
        assert f"| `rollout_{flag.name}` |" in docs, f"docs/trainer.md lacks rollout_{flag.name}"
    assert set(CLI_TYPES) <= {f.name for f in flags(EngineConfig) if get_type_hints(f.owner)[f.path[-1]] is object}
