"""Per-token log-probabilities and entropies of chosen positions, without the `[tokens, vocab]` logits.

The projection and the selective log-softmax are TRL's own `ChunkedLogProbFunction` (its fused LM head: the
`[tokens, vocab]` product in tiles, folded into online log-sum-exp statistics, recomputed tile by tile in the
backward), applied to the scored positions only (the completion tokens; TRL scores every position on devices without
Triton), all of them in one call (one weight gradient in its backward) and, off CUDA, in tiles of at most
`TILE_BYTES` (vocabulary columns narrowed), so neither the logits nor a full-width tile exists. The logit transform
is the one TRL's `add_fused_lm_head` applies (`HeadSpec.from_model`):

    z = (x @ W^T + b) * logit_scale;  z = softcap * tanh(z / softcap) if softcap;  z = z / temperature
    log p(label) = z[label] - logsumexp(z),  entropy = logsumexp(z) - sum softmax(z) * z
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from trl.kernels import ChunkedLogProbFunction
from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
from trl.trainer.utils import maybe_gather_lm_head_ctx

from trl_infinite.engine.config.inputs import text_config

# most bytes of one [tokens, vocab columns] tile of the projection (CPU; on CUDA TRL's own tile sizes). TRL's CPU fold
# of a tile (torch ops, no Triton) makes about 7 temporaries of the tile's size in the backward, which runs first
# in a backward slice, beside the checkpointed activations (and, after the first slice, the whole gradient).
TILE_BYTES = 16 * 2**20
TRL_VOCAB_CHUNK = 32768  # TRL's vocabulary width per tile (`_CHUNKED_LOGPROB_CHUNK_SIZE`)


@dataclass(frozen=True)
class HeadSpec:
    """How the model's LM-head output becomes the sampling distribution's logits (TRL's rules)."""

    temperature: float
    softcap: float | None
    logit_scale: float
    fp32: bool  # TRL's `cast_lm_head_to_fp32`: the projection in float32, outside autocast

    @classmethod
    def from_model(cls, model: torch.nn.Module, temperature: float, cast_lm_head_to_fp32: bool) -> HeadSpec:
        """`add_fused_lm_head`'s reading of the config: final logit soft-cap; the logit multiplier (`logit_scale`,
        `output_multiplier`, `lm_head_multiplier`, 1 / `logits_scaling`, or `logits_scaling` for HyperCLOVA X)."""
        cfg = text_config(model)
        scale = getattr(cfg, "logit_scale", None)
        if scale is None:
            scale = getattr(cfg, "output_multiplier", None)
        if scale is None:
            scale = getattr(cfg, "lm_head_multiplier", None)
        if scale is None and getattr(cfg, "logits_scaling", None) is not None:
            scale = cfg.logits_scaling if cfg.model_type == "hyperclovax" else 1 / cfg.logits_scaling
        return cls(temperature=float(temperature), softcap=getattr(cfg, "final_logit_softcapping", None),
                   logit_scale=1.0 if scale is None else float(scale), fp32=bool(cast_lm_head_to_fp32))


def _columns(num_tokens: int, vocab: int, itemsize: int, device: torch.device) -> int:
    """Vocabulary columns per tile: TRL's on CUDA; elsewhere narrowed so that TRL's `[min(tokens,
    TOKEN_CHUNK_SIZE), columns]` tile stays within `TILE_BYTES`. Every position goes through one call, so its
    backward allocates one `[vocab, hidden]` float32 weight gradient (one per call), not one per token tile."""
    if device.type == "cuda":
        return TRL_VOCAB_CHUNK
    rows = max(1, min(num_tokens, TOKEN_CHUNK_SIZE))
    return max(1, min(vocab, TRL_VOCAB_CHUNK, TILE_BYTES // (rows * itemsize)))


def selected_logprobs(
    hidden: torch.Tensor,  # [M, H] hidden states of the scored positions
    lm_head: torch.nn.Module,
    labels: torch.Tensor,  # [M] the token each position predicts
    spec: HeadSpec,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label) [M], entropy [M] or None) under the head's transformed logits, differentiable w.r.t. `hidden`
    and the head's parameters."""
    weight, bias = lm_head.weight, lm_head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the head once, like TRL
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    hidden = hidden.to(weight.device)
    autocast = nullcontext()
    if spec.fp32:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    compute = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else \
        hidden.dtype
    if spec.fp32:
        compute = torch.float32
    columns = _columns(hidden.shape[0], weight.shape[0], torch.finfo(compute).bits // 8, hidden.device)
    with autocast, maybe_gather_lm_head_ctx(weight, bias):
        logps, ents, *_ = ChunkedLogProbFunction.apply(
            hidden, weight, bias, labels, spec.temperature, columns, spec.softcap, spec.logit_scale, outputs)
    return logps, (ents if entropy else None)
