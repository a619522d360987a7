"""The TRL releases `InfiniteGRPOTrainer` is tested with, and an import-time check of the TRL hooks it overrides.

`InfiniteGRPOTrainer` overrides private `GRPOTrainer` methods whose signatures change between TRL releases (e.g.
`_generate_single_turn` took three arguments before 1.16). A release whose hooks differ would fail at the first
rollout with a `TypeError`; `check_trl_hooks` fails at import instead, naming the supported range.
"""

from __future__ import annotations

import inspect

SUPPORTED_TRL = ">=1.16,<1.17"  # keep in sync with pyproject.toml (tested in tests/trainer/test_compat.py)

# GRPOTrainer methods overridden or called by InfiniteGRPOTrainer -> their parameters in the supported range
TRL_HOOKS: dict[str, tuple[str, ...]] = {
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_generate": ("self", "prompts"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_prepare_inputs": ("self", "generation_batch"),
    "_log_metric": ("self", "name", "value"),
    "_get_per_token_logps_and_entropies": (
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
        "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
    ),
}


def hook_mismatches(trainer_cls) -> list[str]:
    """One line per hook of `trainer_cls` that is missing or whose parameters differ from `TRL_HOOKS`."""
    out = []
    for name, expected in TRL_HOOKS.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            out.append(f"`GRPOTrainer.{name}` is missing")
            continue
        found = tuple(inspect.signature(method).parameters)
        if found != expected:
            out.append(f"`GRPOTrainer.{name}{found}` (expected {expected})")
    return out


def check_trl_hooks(trainer_cls=None, version: str | None = None) -> None:
    """Raises `ImportError` naming the supported TRL range when the installed `GRPOTrainer`'s hooks differ."""
    if trainer_cls is None:
        import trl
        from trl import GRPOTrainer

        trainer_cls, version = GRPOTrainer, trl.__version__
    bad = hook_mismatches(trainer_cls)
    if bad:
        raise ImportError(
            f"trl-infinite supports trl{SUPPORTED_TRL}; the installed trl {version} differs in the GRPOTrainer hooks "
            f"it overrides: {'; '.join(bad)}. Install a supported release: pip install 'trl{SUPPORTED_TRL}'."
        )
