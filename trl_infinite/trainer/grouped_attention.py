"""Attention of the shared-prefix training forward, through transformers' `AttentionInterface`.

A model trained with the shared-prefix forward has its attention configs pointed at `grouped_name(original)`, a
dispatcher registered here: a forward that passes `prefix_groups=GroupedContext(...)` (the packed batch of
`packing.py`) gets grouped attention; any other forward gets the model's original implementation (`sdpa` or the
model's own `eager` function) and masks, unchanged. The name stays on the model (not only around the forward):
with gradient checkpointing the backward pass recomputes each layer, and the recompute must take the same path.

Grouped attention, per layer, with the layer's scale, sliding window / chunk (its `LayerSpec`), soft-cap and sinks:
- each group's shared prompt tokens attend causally among themselves: [S, H, s_max, D] queries against [S, Hkv,
  s_max, D] keys;
- each row's tokens attend to its group's shared tokens and causally to themselves: [R, H, r_max, D] queries against
  [R, Hkv, s_max + r_max, D] keys with a mask; or, for a plain-causal layer when every row's shared part is full
  and shorter than the rows (`GroupedLayout.causal_rows`, decided when the batch is packed), every key slot queries with `is_causal` (no mask: the
  kernel skips the blocks above the diagonal; the shared slots' outputs are dropped);
then every token's output is taken back into packed order. The gathers are differentiable, so the gradient of a
shared key or value is the sum over the rows that read it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from trl_infinite.engine.attention import LayerSpec, temperature_scaled
from trl_infinite.trainer.packing import GroupedLayout

GROUPED_PREFIX = "trl_infinite_grouped"
ORIGINALS = ("sdpa", "eager")  # implementations the dispatcher can stand in for (and call for ordinary forwards)
_PACKED: ContextVar[bool] = ContextVar("trl_infinite_packed_forward", default=False)


@dataclass(frozen=True, eq=False)
class GroupedContext:
    """What the attention function receives as `prefix_groups`: the packed batch and each layer's mask pattern."""

    layout: GroupedLayout
    layers: dict[int, LayerSpec]  # module.layer_idx -> spec (from the support probe)
    entropy: bool = False  # the head also returns entropies


def grouped_name(original: str) -> str:
    """The dispatcher standing in for `original`."""
    return f"{GROUPED_PREFIX}[{original}]"


def original_of(name: str | None) -> str | None:
    """The implementation a dispatcher name stands in for; None if `name` is not a dispatcher."""
    if isinstance(name, str) and name.startswith(GROUPED_PREFIX + "[") and name.endswith("]"):
        return name[len(GROUPED_PREFIX) + 1 : -1]
    return None


def _own_eager(module: torch.nn.Module):
    """The model's own `eager_attention_forward` (soft-caps, sinks, ... as the model computes them)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__}'s module has no `eager_attention_forward` to fall back to.")
    return fn


def _dispatch(module, query, key, value, attention_mask, *args, original: str, prefix_groups=None, **kwargs):
    if prefix_groups is None:
        fn = _own_eager(module) if original == "eager" else AttentionInterface._global_mapping[original]
        return fn(module, query, key, value, attention_mask, *args, **kwargs)
    return grouped_attention(module, query, key, value, prefix_groups, **kwargs)


def _mask_function(original: str):
    inner = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[original]

    @functools.wraps(inner)
    def mask(*args, **kwargs):
        return None if _PACKED.get() else inner(*args, **kwargs)

    return mask


for _original in ORIGINALS:
    AttentionInterface.register(grouped_name(_original), functools.partial(_dispatch, original=_original))
    if _original in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(grouped_name(_original), _mask_function(_original))


@contextmanager
def packed_forward() -> Iterator[None]:
    """Within the block the model builds no attention masks (the grouped attention has its own)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, Dk]
    key: torch.Tensor,  # [1, Hkv, N, Dk]
    value: torch.Tensor,  # [1, Hkv, N, Dv]
    ctx: GroupedContext,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Grouped attention of the packed batch: ([1, N, H, Dv], None). The mask pattern is the layer's spec (the
    probe checked it against the `sliding_window` kwarg and the masks the model builds)."""
    spec = ctx.layers.get(getattr(module, "layer_idx", None))
    if spec is None:
        raise RuntimeError(f"attention module {type(module).__name__} (layer_idx {getattr(module, 'layer_idx', None)})"
                           " was not seen when the shared-prefix forward checked the model.")
    if dropout:
        raise RuntimeError("the shared-prefix forward does not apply attention dropout (the support check refuses "
                           "models that use it in training).")
    lay = ctx.layout
    if getattr(module, "paged_temperature_tuning", False):  # Llama 4's NoPE layers: scaled by TRL's column
        query = temperature_scaled(module, query, lay.position_ids[0])
    shared_mask, row_mask = lay.masks(spec.sliding_window, spec.chunk_size)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [N, H, Dk]
    k = key[0].transpose(0, 1).to(q.dtype)  # [N, Hkv, Dk]
    v = value[0].transpose(0, 1).to(q.dtype)  # [N, Hkv, Dv]
    parts = []
    if lay.shared_index.shape[0]:
        idx = lay.shared_index
        out = _attend(q[idx], k[idx], v[idx], shared_mask, scale, softcap, s_aux)  # [S, s_max, H, Dv]
        parts.append(out.flatten(0, 1))
    keys = lay.row_keys
    if lay.causal_rows and spec.sliding_window is None and spec.chunk_size is None and softcap is None and s_aux is None:
        # every key slot queries (the shared slots' outputs are dropped): causal, no mask, the blocks above the
        # diagonal skipped; the own slots' outputs are those of the masked form below
        out = _attend(q[keys], k[keys], v[keys], None, scale, None, None)[:, lay.shared_index.shape[1]:]
    else:
        out = _attend(q[lay.row_index], k[keys], v[keys], row_mask, scale, softcap, s_aux)
    parts.append(out.flatten(0, 1))  # [R * r_max, H, Dv]
    slots = torch.cat(parts) if len(parts) > 1 else parts[0]
    return slots.index_select(0, lay.slot_of_token)[None], None  # [1, N, H, Dv]


def _attend(q, k, v, mask, scale, softcap, sinks) -> torch.Tensor:
    """[S, Q, H, Dk] queries, [S, K, Hkv, *] keys / values, [S, 1, Q, K] bool mask (None: causal, Q = K) ->
    [S, Q, H, Dv]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [S, H(kv), Q|K, D]
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=mask is None,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [S, H, Q, K]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)
