"""Block metadata of one forward pass over the paged KV pool.

A forward runs a flat, packed batch of `T` query tokens (batch dimension 1) that belong to `S` segments. A segment
is the new tokens of one sample (or one prompt): its context is the group's prompt blocks (the shared prefix,
`prompt_lens[s]` tokens) followed by the sample's own completion blocks. Position `p` of segment `s` lives in
prefix block `prefix_table[s, p // B]` if `p < prompt_lens[s]`, else in own block
`suffix_table[s, (p - prompt_lens[s]) // B]`; its slot in the pool is `block * B + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """Host-side description of one segment before it is packed into tensors."""

    prompt_len: int
    prefix_blocks: list[int]
    suffix_blocks: list[int]
    start_pos: int  # position of the first new token
    tokens: list[int]
    group_index: int = 0  # segments of the same group share `prefix_blocks` (used by cascade kernels)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)


@dataclass
class PagedAttentionMetadata:
    """Device tensors describing the packed batch (shapes in comments; B = block size)."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] pool slot written by each new token
    q_seg: torch.Tensor  # [T] segment of each query token
    q_pos: torch.Tensor  # [T] absolute position of each query token
    q_start: torch.Tensor  # [S] first query index of each segment in the packed batch
    q_lens: torch.Tensor  # [S]
    ctx_lens: torch.Tensor  # [S] context length after this forward (prefix + own, new tokens included)
    prompt_lens: torch.Tensor  # [S]
    prefix_table: torch.Tensor  # [S, max_prefix_blocks] (padded with 0)
    suffix_table: torch.Tensor  # [S, max_suffix_blocks] (padded with 0)
    seg_group: torch.Tensor  # [S] group index of each segment
    max_q_len: int
    max_ctx_len: int

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1


def slots_for_positions(
    pos: torch.Tensor, prompt_lens: torch.Tensor, prefix_table: torch.Tensor, suffix_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Pool slot of absolute positions `pos` ([S, N]) of each segment, through its prefix/suffix block tables."""
    in_prefix = pos < prompt_lens[:, None]
    own = (pos - prompt_lens[:, None]).clamp_min(0)
    p_idx = (pos // block_size).clamp(max=max(prefix_table.shape[1] - 1, 0))
    s_idx = (own // block_size).clamp(max=max(suffix_table.shape[1] - 1, 0))
    p_blk = prefix_table.gather(1, p_idx) if prefix_table.shape[1] else torch.zeros_like(pos)
    s_blk = suffix_table.gather(1, s_idx) if suffix_table.shape[1] else torch.zeros_like(pos)
    block = torch.where(in_prefix, p_blk, s_blk)
    offset = torch.where(in_prefix, pos % block_size, own % block_size)
    return block * block_size + offset


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def build_metadata(segments: list[Segment], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Pack segments into `input_ids` [1, T], `position_ids` [1, T] and the attention metadata."""
    q_lens = torch.tensor([len(s.tokens) for s in segments], dtype=torch.long)
    starts = torch.tensor([s.start_pos for s in segments], dtype=torch.long)
    q_start = torch.cumsum(q_lens, 0) - q_lens
    num_tokens = int(q_lens.sum())
    q_seg = torch.repeat_interleave(torch.arange(len(segments)), q_lens)
    q_pos = starts[q_seg] + torch.arange(num_tokens) - q_start[q_seg]
    input_ids = torch.tensor([t for s in segments for t in s.tokens], dtype=torch.long)
    prompt_lens = torch.tensor([s.prompt_len for s in segments], dtype=torch.long)
    prefix_table = _pad([s.prefix_blocks for s in segments])
    suffix_table = _pad([s.suffix_blocks for s in segments])
    slot_mapping = slots_for_positions(q_pos[:, None], prompt_lens[q_seg], prefix_table[q_seg], suffix_table[q_seg], block_size)[:, 0]
    ctx_lens = starts + q_lens
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    meta = PagedAttentionMetadata(
        block_size=block_size,
        slot_mapping=to(slot_mapping),
        q_seg=to(q_seg),
        q_pos=to(q_pos),
        q_start=to(q_start),
        q_lens=to(q_lens),
        ctx_lens=to(ctx_lens),
        prompt_lens=to(prompt_lens),
        prefix_table=to(prefix_table),
        suffix_table=to(suffix_table),
        seg_group=to(torch.tensor([s.group_index for s in segments], dtype=torch.long)),
        max_q_len=int(q_lens.max()),
        max_ctx_len=int(ctx_lens.max()),
    )
    return to(input_ids)[None], to(q_pos)[None], meta
