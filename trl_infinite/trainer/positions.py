"""Positions in the training forward: `GRPOTrainer`'s, whatever the micro batch.

The reference is TRL's numbering. TRL's training forward passes `input_ids` and `attention_mask` of the generation
batch (this process's rows, prompts left-padded to the longest prompt, completions right-padded to the longest
completion) and no `position_ids`, so the model numbers its tokens itself: by column (`arange(P + C)`: GPT-2's
learned positions, RoPE, ...) or from the attention mask (OPT). `InfiniteGRPOTrainer` keeps exactly these
numbers in every training forward:

- micro batches keep the generation batch's prompt columns (`micro_batches.trim_padding` drops trailing completion
  columns only), so a token's column, and its position, is the one it has in TRL's batch;
- the shared-prefix forward (`packing.py`) passes each packed token's column as its position;
- a RoPE whose frequencies depend on the longest position of the forward (`dynamic` NTK scaling, Phi-3's
  `longrope`: `transformers.modeling_rope_utils.dynamic_rope_update`) sees the whole padded width `P + C` of TRL's
  batch: its micro batches keep every column, and the packed forward (whose longest position is not TRL's) is
  refused, the trainer falling back to TRL's padded forward with a warning.

For a model whose outputs depend on absolute positions (learned position embeddings, length-dependent RoPE), these
positions are not the rollout's (the engine and `generate` number each row from its first real token): with left
padding, the trained distribution differs from the sampled one, in `GRPOTrainer` and here alike (docs/trainer.md).
"""

from __future__ import annotations

import torch

from trl_infinite.engine.config.inputs import text_config

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # `dynamic_rope_update`'s rope types


def _rope_types(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        if isinstance(value.get("rope_type", value.get("type")), str):
            return [value.get("rope_type", value.get("type"))]
        return [t for v in value.values() for t in _rope_types(v)]  # per layer type
    return []


def length_dependent_rope(model: torch.nn.Module) -> str | None:
    """The rope type of `model` whose frequencies depend on the longest position of a forward (`dynamic`,
    `longrope`), from its rotary modules and its text config; None if it has none."""
    found = [t for m in model.modules() for t in _rope_types(getattr(m, "rope_type", None))]
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg = text_config(cfg)
        for key in ("rope_parameters", "rope_scaling"):
            found += _rope_types(getattr(cfg, key, None))
    for rope_type in found:
        if rope_type == "longrope" or "dynamic" in rope_type:
            return rope_type
    return None
