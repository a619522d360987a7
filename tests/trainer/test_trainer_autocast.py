"""TRL's precision defaults through `InfiniteGRPOTrainer`.

What TRL's forwards run under, per setting (accelerate's `get_mixed_precision_context_manager`, entered both by
`accelerator.autocast()` around TRL's training forwards and by the wrapper `prepare_model` puts on `forward`):
`bf16=True` (TRL's default) -> `torch.autocast(device, bfloat16)`, on CPU too (`use_cpu=True`); `fp16=True` ->
`torch.autocast(device, float16)` on accelerators, and on CPU no autocast at all (accelerate enables fp16 mixed
precision off-CPU only: the run is float32). The engine is built and runs under the same state.

- TRL's default `GRPOConfig` (`bf16=True`, max_completion_length 512, batch 8, G=8; only `use_cpu`, `output_dir`,
  `report_to` and `max_steps` set) on float32 weights trains on the engine: no fallback warning, `uses_engine`
  stays True, the KV pool is bf16 and the C++ float32 kernel is not built for it. The tiny model has head dim 16,
  which the kernel serves in float32: before, its fp32 decode attention failed the exactness check against the
  model's bf16-autocast forward and the trainer fell back to TRL's `generate` for the run.
- TRL's `test_train` on a tiny Cohere2 (TRL's tiny config with a 96-token vocabulary; lr 0.1, batch 3, G=3, 8
  tokens) trains on the engine, with bf16 weights and the way TRL's test loads it (a path: float32 by default).
- `fp16=True` on CPU trains on the engine in float32.
- A model refused at the first rollout falls back with an accurate warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset
from trainer_helpers import PROMPTS, cpu_args, token_sum_reward

from trl_infinite.engine.attention import cpu_decode
from trl_infinite.testing.tiny_configs import build_tiny_model, sizes
from trl_infinite.trainer import InfiniteGRPOConfig, InfiniteGRPOTrainer

FALLBACK = "instead of the rollout engine"


def _train(trainer) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in record if FALLBACK in str(w.message)]


def test_trl_default_config_trains_on_the_engine(tmp_path, tokenizer, dataset, monkeypatch):
    builds = []
    monkeypatch.setattr(cpu_decode, "build", lambda: builds.append(1) or False)
    args = InfiniteGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2)
    assert args.bf16 and args.max_completion_length == 512 and args.per_device_train_batch_size == 8
    model = build_tiny_model("qwen3", size=sizes(16)).train()
    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer)
    assert _train(trainer) == []
    assert trainer.uses_engine and trainer.engine_fallback_reasons == []
    engine = trainer._engine
    assert engine.autocast == torch.bfloat16 and engine.pool.dtype == torch.bfloat16
    assert not engine.support.decode_kernel and builds == []
    log = trainer.state.log_history[-1]  # (TRL's default logging_steps=10: the run's summary)
    assert log["rollout/decode_steps"] > 0 and torch.isfinite(torch.tensor(log["train_loss"]))
    assert next(trainer.model.parameters()).dtype == torch.float32  # autocast, not cast weights


def _cohere2(dtype: torch.dtype) -> torch.nn.Module:
    """TRL's tiny Cohere2 (`scripts/generate_tiny_models/for_causal_lm/cohere2_for_causal_lm.py`: hidden 8 over 4
    heads, so head dim 2; 2 sliding-window layers; tied embeddings) with our tokenizer's 96-token vocabulary."""
    from transformers import Cohere2Config, Cohere2ForCausalLM

    config = Cohere2Config(vocab_size=96, hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, intermediate_size=32, logit_scale=1.0, rope_theta=50000,
                           pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Cohere2ForCausalLM(config).to(dtype)


@pytest.mark.parametrize("loaded", ["bf16 weights", "from a path, as TRL's test loads it"])
def test_trl_test_train_on_cohere2(tmp_path, tokenizer, dataset, loaded):
    """TRL's `test_train`: its GRPOConfig (bf16 left at its default, True) with `use_cpu`; parameters change."""
    model = _cohere2(torch.bfloat16)
    if loaded != "bf16 weights":  # GRPOTrainer loads a model id in float32 unless `model_init_kwargs` says otherwise
        model.save_pretrained(tmp_path / "tiny-cohere2")
        tokenizer.save_pretrained(tmp_path / "tiny-cohere2")
        model = str(tmp_path / "tiny-cohere2")
    args = InfiniteGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, learning_rate=0.1,
                              per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
                              report_to="none", max_steps=2)
    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer)
    weights = torch.bfloat16 if loaded == "bf16 weights" else torch.float32
    assert next(trainer.model.parameters()).dtype == weights
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    assert _train(trainer) == []
    assert trainer.uses_engine and trainer._engine.pool.dtype == torch.bfloat16
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, param in before.items():
        assert not torch.equal(param, trainer.model.get_parameter(name)), f"{name} did not change"


def test_fp16_on_cpu_trains_on_the_engine_in_float32(tmp_path, tokenizer, dataset):
    from _models import tiny_model

    trainer = InfiniteGRPOTrainer(model=tiny_model("qwen3").train(), reward_funcs=token_sum_reward,
                                  args=cpu_args(tmp_path, fp16=True, max_steps=1), train_dataset=dataset,
                                  processing_class=tokenizer)
    with trainer.accelerator.autocast():  # accelerate: fp16 mixed precision is for accelerators only
        assert not torch.is_autocast_enabled("cpu")
    assert _train(trainer) == []
    assert trainer.uses_engine and trainer._engine.autocast is None and trainer._engine.pool.dtype == torch.float32


def test_refusal_at_the_first_rollout_warns_accurately(tmp_path, tokenizer):
    """BLOOM passes the construction-time check and is refused when the engine is built: one warning that names the
    cause and what generates instead (TRL's path, rewards after generation) for the rest of the run."""
    model = build_tiny_model("bloom", vocab_size=len(tokenizer))
    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=cpu_args(tmp_path, bf16=True),
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    messages = _train(trainer)
    assert len(messages) == 1 and not trainer.uses_engine
    msg = messages[0]
    assert "TRL's own path (transformers `generate`, rewards scored after generation)" in msg
    assert "for the rest of this run" in msg and "`bloom`" in msg and "`AttentionInterface`" in msg
    assert "use_vllm=True" in msg and ".." not in msg and "Streamed rewards" not in msg


def test_weight_copy_is_gone_before_the_backward(tmp_path, tokenizer, dataset):
    """`rollout_weight_copy="auto"` (the default; CPU): rollouts run on a bf16 copy of the Linear weights (bf16 autocast, float32
    weights), and the copy is freed before the loss's backward: no copy tensor alive, every module back on its float32
    Parameter, the training forward on float32 weights."""
    import gc
    import weakref

    model = build_tiny_model("llama", seed=1, size=sizes(16)).train()
    args = cpu_args(tmp_path, bf16=True, max_steps=2)
    trainer = InfiniteGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer)
    seen: list[tuple[torch.dtype, weakref.ref]] = []
    trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(  # (TRL's loss reads `lm_head.weight` itself)
        lambda module, args, out: seen.append((module.weight.dtype, weakref.ref(module.weight))))
    at_backward = []
    backward = trainer.accelerator.backward

    def checked_backward(loss, **kwargs):
        gc.collect()
        engine = trainer._engine
        at_backward.append((
            engine.weight_copy is not None and engine.weight_copy.tensors() == [],
            [r() is None for dtype, r in seen if dtype == torch.bfloat16],
            all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in trainer.model.parameters()),
            seen[-1][0],  # the loss's forward
        ))
        return backward(loss, **kwargs)

    trainer.accelerator.backward = checked_backward
    assert _train(trainer) == []
    assert len(at_backward) == 2
    for released, copies_dead, float32, loss_weights in at_backward:
        assert released and copies_dead and all(copies_dead) and float32 and loss_weights == torch.float32
    assert [h["rollout/weight_copy_gb"] for h in trainer.state.log_history if "rollout/weight_copy_gb" in h][0] > 0
