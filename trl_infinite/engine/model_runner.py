"""Runs a Hugging Face causal LM over packed segments of the paged KV pool."""

from __future__ import annotations

import torch

from .attention import (
    LayerSpec,
    PagedContext,
    Segment,
    attention_configs,
    build_metadata,
    paged_attention,
    resolve_backend,
)
from .kv_pool import KVCachePool


class ModelRunner:
    """One forward = one packed batch of segments; returns the logits of the requested query tokens only."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool, attention_backend: str, layers: dict[int, LayerSpec]):
        """`layers`: one `LayerSpec` per attention `layer_idx` (from `support.check_support`)."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.backend = resolve_backend(attention_backend, self.device)
        self.layers = layers
        self._attn_configs = attention_configs(model)

    @torch.no_grad()
    def forward(self, segments: list[Segment], logit_rows: torch.Tensor | None, output_hidden: bool = False):
        """`logit_rows`: indices into the packed query tokens whose logits are needed ([R]); None = none.

        Returns (logits [R, V] or None, last hidden states [R, hidden] when `output_hidden`)."""
        input_ids, positions, meta = build_metadata(segments, self.pool.block_size, self.device)
        ctx = PagedContext(self.pool.k_caches, self.pool.v_caches, meta, self.backend, self.layers)
        keep = logit_rows.to(self.device) if logit_rows is not None else torch.zeros(1, dtype=torch.long, device=self.device)
        with paged_attention(self.model, self._attn_configs):
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=False,
                paged_ctx=ctx,
                logits_to_keep=keep,
                output_hidden_states=output_hidden,
            )
        logits = None
        if logit_rows is not None:
            logits = out.logits[0]
            if logits.shape[0] != keep.shape[0]:  # a model that ignores `logits_to_keep` returns every row
                logits = logits[keep]
        hidden = out.hidden_states[-1][0, keep] if output_hidden else None
        return logits, hidden


def last_rows(segments: list[Segment]) -> torch.Tensor:
    """Index of each segment's last token in the packed batch ([S])."""
    ends = torch.cumsum(torch.tensor([len(s.tokens) for s in segments], dtype=torch.long), 0)
    return ends - 1


def chunk_segments(segments: list[Segment], max_tokens: int) -> list[list[Segment]]:
    """Split a list of segments into forwards of at most `max_tokens` tokens (a long segment is cut in pieces,
    each piece's context being everything before it)."""
    batches: list[list[Segment]] = [[]]
    used = 0
    for seg in segments:
        start = 0
        while start < len(seg.tokens):
            room = max_tokens - used
            if room == 0:
                batches.append([])
                used, room = 0, max_tokens
            piece = seg.tokens[start : start + room]
            batches[-1].append(
                Segment(seg.prompt_len, seg.prefix_blocks, seg.suffix_blocks, seg.start_pos + start, piece, seg.group_index)
            )
            used += len(piece)
            start += len(piece)
    return [b for b in batches if b]
