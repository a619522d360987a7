"""Positions in the training forward (`trainer/positions.py`): the same as `GRPOTrainer`'s for the same completions.

TRL's training forward passes `input_ids` and `attention_mask` of the generation batch left-padded to its longest
prompt, so a model numbers each token by its column there. Micro batches of other rows (by group or by length),
each trimmed to its own longest completion, and the packed shared-prefix forward must number every token the same:
GPT-2 (learned absolute positions), a dynamic-NTK Llama and a Phi-3 `longrope` (RoPE whose frequencies depend on the
longest position of the forward) get TRL's gradient. Prompts of 2 to 11 words, so every micro batch pads differently.
Tolerance: float32 round-off of different reduction orders, relative 1e-5 of the largest entry (measured: 1e-7; the
broken numbering was off by 6.5e-5 (dynamic, packed) to 0.65 (GPT-2, packed) on these tiny models).
"""

from __future__ import annotations

import pytest
from datasets import Dataset
from trainer_helpers import GradCapture, cpu_args, token_sum_reward
from trl import GRPOConfig, GRPOTrainer

from trl_infinite.testing.tiny_configs import build_tiny_model
from trl_infinite.trainer import InfiniteGRPOTrainer
from trl_infinite.trainer.positions import length_dependent_rope

PROMPTS = ["what is 1 plus 2 and 3 ?", "add 5 .", "is a knight a knave or not ?", "the sum ?",
           "what is 7 minus 2 ?", "x y z of the answer is the final one ?"]


def _longrope(**kw):
    half = 4  # head_dim 8 -> 4 frequencies
    return build_tiny_model("phi3", max_position_embeddings=64, original_max_position_embeddings=16,
                            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * half,
                                                 long_factor=[1.5, 2.0, 3.0, 4.0],
                                                 original_max_position_embeddings=16), **kw)


MODELS = {
    "gpt2": lambda: build_tiny_model("gpt2", n_positions=64),
    "llama_dynamic": lambda: build_tiny_model(
        "llama", max_position_embeddings=8,
        rope_parameters=dict(rope_type="dynamic", factor=8.0, rope_theta=10000.0)),
    "phi3_longrope": _longrope,
}


def fixed_completions(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Completions of 1..9 tokens, a function of the row only (no EOS)."""
    out = []
    for i, p in enumerate(prompt_ids):
        n = 1 + (5 * i + sum(p)) % 9
        out.append([4 + (sum(p) + 3 * i + j) % 60 for j in range(n)])
    return out, None


def grads(cls, config_cls, tmp_path, tokenizer, model, **overrides):
    args = cpu_args(tmp_path / cls.__name__, cls=config_cls, gradient_accumulation_steps=3,
                    per_device_train_batch_size=4, num_generations=2, max_completion_length=9, max_grad_norm=0.0, disable_dropout=True,
                    **overrides)
    capture = GradCapture()
    trainer = cls(model=model.train(), reward_funcs=token_sum_reward, args=args,
                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
                  callbacks=[capture])
    trainer._generate_single_turn = fixed_completions
    trainer.train()
    return capture.grads, trainer


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "padded"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_training_positions_are_trls(tmp_path, tokenizer, arch, shared):
    ours, trainer = grads(InfiniteGRPOTrainer, None, tmp_path, tokenizer, MODELS[arch](),
                          shared_prefix_training=shared)
    ref, _ = grads(GRPOTrainer, GRPOConfig, tmp_path, tokenizer, MODELS[arch]())
    assert ours.keys() == ref.keys() and ref
    scale = max(g.abs().max().item() for g in ref.values())
    worst = max((ours[n] - ref[n]).abs().max().item() for n in ref)
    assert worst <= 1e-5 * scale, f"gradient off by {worst / scale:.2e} of its largest entry"


def test_length_dependent_rope_is_recognised():
    assert length_dependent_rope(MODELS["llama_dynamic"]()) == "dynamic"
    assert length_dependent_rope(MODELS["phi3_longrope"]()) == "longrope"
    assert length_dependent_rope(MODELS["gpt2"]()) is None
    assert length_dependent_rope(build_tiny_model("llama")) is None


def test_shared_prefix_refuses_length_dependent_rope(tmp_path, tokenizer):
    """The packed forward's longest position is not TRL's padded batch's: the trainer says so and trains with TRL's
    forward (which the gradient test above checks)."""
    with pytest.warns(UserWarning, match="frequencies that depend on the sequence length"):
        trainer = InfiniteGRPOTrainer(model=MODELS["llama_dynamic"]().train(), reward_funcs=token_sum_reward,
                                      args=cpu_args(tmp_path, num_generations=2),
                                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                      processing_class=tokenizer)
    assert trainer.shared_prefix is None
