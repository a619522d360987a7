"""Per-layer attention settings the paged backends implement, and the one mask rule they all follow.

`LayerSpec` is static per attention layer (found once by the support probe, `engine/model/support.py`): the pool layer the
module writes to and its mask pattern (sliding window, chunk). `LayerAttention` is what a backend receives on each
call: the spec's mask pattern plus the call's own values (softmax scale, logit soft-cap, attention-sink logits, read
from the kwargs the model passes, so a trained sink parameter is always current).

Score of query head h at position q against the key at position k (natural-log units):

    s = scale * <q, k>;   s = softcap * tanh(s / softcap)   if softcap
    p = softmax over allowed k of s, with one extra logit `sinks[h]` in the denominator (no value) if sinks
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerSpec:
    """Static description of one attention layer (from the support probe)."""

    pool_index: int  # index into the pool's per-layer K/V lists
    sliding_window: int | None = None  # keys with k > q - window are visible (transformers' rule)
    chunk_size: int | None = None  # keys in the query's chunk only: k // chunk == q // chunk (Llama 4)
    needs_scores: bool = False  # the module passes a soft-cap or attention sinks (`LayerAttention.needs_scores`)


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """Everything a backend needs to know about one layer's attention on one call."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    chunk_size: int | None = None
    sinks: torch.Tensor | None = None  # [H] one extra logit per query head (gpt-oss `s_aux`)

    @property
    def needs_scores(self) -> bool:
        """True when the softmax needs the explicit score matrix (soft-cap or sinks)."""
        return self.softcap is not None or self.sinks is not None


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None, chunk_size: int | None) -> torch.Tensor:
    """Whether a query at absolute position `q_pos` sees the key at `k_pos` (broadcasting): causal, then the
    sliding window and the chunk of the layer, exactly as transformers' mask overlays."""
    ok = k_pos <= q_pos
    if sliding_window:
        ok = ok & (k_pos > q_pos - sliding_window)
    if chunk_size:
        ok = ok & (torch.div(k_pos, chunk_size, rounding_mode="floor") == torch.div(q_pos, chunk_size, rounding_mode="floor"))
    return ok
