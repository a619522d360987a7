"""TRL's generation settings for the engine: the `GenerationConfig` `generate` would run with, as `SamplingParams`,
and the reasons (if any) the engine cannot run a trainer's rollouts, in which case TRL's own path generates."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

from trl_infinite.engine import SamplingParams
from trl_infinite.engine.config.logits import split_generation_config, unsupported_generation_keys


def effective_generation_config(model: torch.nn.Module, generation_config: GenerationConfig) -> GenerationConfig:
    """What `model.generate(generation_config=...)` runs with: TRL's config, its unset keys filled from the model's
    own generation config and then `generate`'s global defaults (transformers' `_prepare_generation_config`)."""
    config, _ = model._prepare_generation_config(copy.deepcopy(generation_config))
    return config


def engine_sampling_params(
    config: GenerationConfig, max_new_tokens: int, eos_token_ids: list[int], seed: int,
    logprobs_temperature: float | None = None,
) -> SamplingParams:
    """`SamplingParams` of an effective generation config: the common keys as fields, every other set key in
    `generation_kwargs`. EOS ids: TRL's (its completions end at the first of them) plus the config's.
    `logprobs_temperature`: the temperature of the log-probs handed to TRL (TRL scores tokens with
    `log_softmax(logits / args.temperature)`, without top-k / top-p / min-p or penalties; the engine then returns
    those as raw log-probs next to the processed ones)."""
    common, extra = split_generation_config(config)
    eos = list(eos_token_ids)
    config_eos = config.eos_token_id
    for t in [config_eos] if isinstance(config_eos, int) else (config_eos or []):
        if t not in eos:
            eos.append(int(t))
    return SamplingParams(
        max_new_tokens=config.max_new_tokens or max_new_tokens, eos_token_ids=eos, seed=seed,
        generation_kwargs=extra, raw_logprobs_temperature=logprobs_temperature, **common,
    )


_COLLECTIVE_FORWARD = (
    "every forward of the model all-gathers parameters (collective), so all processes would have to run the same "
    "number of decode steps, which the engine does not synchronise yet (`generate` does, with `synced_gpus`)"
)


def engine_fallback_reasons(
    model: torch.nn.Module, generation_config: GenerationConfig | None, dist=None, ds3_gather: bool = True
) -> list[str]:
    """Why the engine cannot run this trainer's rollouts exactly (empty: it can). `dist` is TRL's
    `DistributedBackend` (`is_zero3`); `ds3_gather` is `args.ds3_gather_for_generation`. FSDP (1 and 2) is no
    reason: the trainer gathers the full weights for each rollout (`full_weights.py`)."""
    reasons = []
    if dist is not None and dist.is_zero3 and not ds3_gather:
        reasons.append(f"ZeRO-3 with `ds3_gather_for_generation=False` keeps the parameters sharded during the "
                       f"rollout: {_COLLECTIVE_FORWARD}; set `ds3_gather_for_generation=True` (the default) to run "
                       "the engine on the gathered weights")
    if generation_config is not None:
        bad = unsupported_generation_keys(effective_generation_config(model, generation_config))
        if bad:
            reasons.append(f"`generation_kwargs` keys {bad} need a decoding algorithm other than sampling or greedy "
                           "search (or change what `generate` returns)")
    peft_config = getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        reasons.append(f"the PEFT method {kind} prepends virtual tokens, which the engine does not run")
    return reasons
