"""Metadata of one forward pass over the paged KV pool, built once per forward and read by every layer.

A forward runs a flat, packed batch of `T` query tokens (batch dimension 1) that belong to `S` segments. A segment
is the new tokens of one sample (or one prompt): its context is the group's prompt blocks (the shared prefix,
`prompt_lens[s]` tokens) followed by the sample's own completion blocks. Position `p` of segment `s` lives in
prefix block `prefix_table[s, p // B]` if `p < prompt_lens[s]`, else in own block
`suffix_table[s, (p - prompt_lens[s]) // B]`; its slot in the pool is `block * B + offset`.

Two builders make the same `PagedAttentionMetadata`: `build_metadata` from host-side `Segment`s (prefill,
recompute, verification: eager), and `decode_metadata` from the persistent device tables of the static decode
batch (one token per row, no host data: it runs inside a compiled / captured region).

`ContextPlan` is what the torch backend needs, computed once per forward: every segment's context laid out as
`[prefix columns | own columns]` (`Cp = Wp * B` slots read through the prefix table, `Cs = Ws * B` through the own
table), the pool slot of each column and one additive mask per attention pattern of the model's layers (sliding
window, chunk: `layer.allowed`, the one mask rule every backend follows).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from trl_infinite.engine.attention.layer import allowed

MaskKey = tuple[int | None, int | None]  # (sliding window, chunk size) of a layer; (None, None) = full causal


@dataclass
class Segment:
    """Host-side description of one segment before it is packed into tensors."""

    prompt_len: int
    prefix_blocks: list[int]
    suffix_blocks: list[int]
    start_pos: int  # position of the first new token
    tokens: list[int]
    group_index: int = 0  # segments of the same group share `prefix_blocks` (used by cascade kernels)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source slot, target slot) of prefix-cache KV
    # copied into this segment's context by every layer before it attends (the batch's `PrefillCopy`,
    # `PagedAttentionMetadata.copy_slots`)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)


@dataclass
class CascadePlan:
    """Decode context split at the prompt (torch backend, static decode): the prompts of the `Gb` groups in the batch
    are gathered once each and attended by every row in one call, each row's own tokens separately, and the two
    halves merged by log-sum-exp. Row `n` sees prefix column `c` iff `c // Cp == group_slot[n]`, `c % Cp` is
    inside its prompt and the layer's mask allows it."""

    prefix_slots: torch.Tensor  # [Gb * Cp] pool slot of every prompt column of every group slot
    own_slots: torch.Tensor  # [S * Cs] pool slot of every own column, row-major
    prefix_masks: dict[MaskKey, torch.Tensor]  # [1, 1, S, Gb * Cp] additive bias
    own_masks: dict[MaskKey, torch.Tensor]  # [S, 1, 1, Cs] additive bias
    prefix_visible: dict[MaskKey, torch.Tensor]  # [S] bool: the row sees at least one prompt column


@dataclass
class ContextPlan:
    """Per-forward context layout of the torch backend (S segments, Q = longest query run, C = Cp + Cs)."""

    slots: torch.Tensor  # [S * C] pool slot of every context column, segment-major
    masks: dict[MaskKey, torch.Tensor]  # [S, 1, Q, C] additive bias (0 / -inf): which columns each query sees
    query_index: tuple[torch.Tensor, torch.Tensor] | None  # (segment, index in segment) of each query; None: Q == 1
    cascade: CascadePlan | None = None  # decode forwards that carry group slots (`decode_metadata`)


@dataclass
class PagedAttentionMetadata:
    """Device tensors describing the packed batch (shapes in comments; B = block size)."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] pool slot written by each new token
    q_seg: torch.Tensor  # [T] segment of each query token
    q_pos: torch.Tensor  # [T] absolute position of each query token
    q_start: torch.Tensor  # [S] first query index of each segment in the packed batch
    prompt_lens: torch.Tensor  # [S]
    prefix_table: torch.Tensor  # [S, Wp]
    suffix_table: torch.Tensor  # [S, Ws]
    seg_group: torch.Tensor  # [S] group index of each segment
    max_q_len: int  # host int: 1 for decode forwards
    # host int: the distinct prompts (groups) of the segments, or an upper bound of them (the static decode step
    # passes a power-of-two bucket, `triton_tiles.group_bucket`); sizes the Triton prompt splits. None: unknown
    num_groups: int | None = None
    context: ContextPlan | None = None  # filled by `with_context` for the torch backend
    cascade: tuple[torch.Tensor, torch.Tensor] | None = None  # Triton backend: (order, run_len), see `cascade_plan`
    row_group_slot: torch.Tensor | None = None  # [S] decode: slot of each row's group in `group_prefix_table`
    group_prefix_table: torch.Tensor | None = None  # [Gb, Wp] decode: prompt blocks of each group slot
    # prefill: ([C] source slots, [C] target slots) each layer copies right after writing the new keys and values
    # (partial prefix-cache hits, `Segment.copies`); None: no copy
    copy_slots: tuple[torch.Tensor, torch.Tensor] | None = None

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


def _table_slots(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[S, W] block ids -> [S, W * B] slots of every position of those blocks."""
    offsets = torch.arange(block_size, device=table.device)
    return (table[:, :, None] * block_size + offsets).reshape(table.shape[0], -1)


def with_context(meta: PagedAttentionMetadata, mask_keys: tuple[MaskKey, ...]) -> PagedAttentionMetadata:
    """`meta` with the torch backend's `ContextPlan` (built once per forward; every layer reuses it)."""
    device, bs = meta.prompt_lens.device, meta.block_size
    num_seg = meta.prompt_lens.shape[0]
    slots = torch.cat([_table_slots(meta.prefix_table, bs), _table_slots(meta.suffix_table, bs)], 1)  # [S, C]
    cp, cs = meta.prefix_table.shape[1] * bs, meta.suffix_table.shape[1] * bs
    col = torch.arange(cp + cs, device=device)
    plen = meta.prompt_lens[:, None]
    kpos = torch.where(col < cp, col, plen + col - cp)  # [S, C] absolute position of each column
    in_table = (col >= cp) | (col < plen)  # prefix columns past the prompt hold nothing
    if meta.is_decode:
        query_index = None
        qpos = meta.q_pos[:, None]  # [S, 1]
    else:
        q_idx = torch.arange(meta.q_pos.shape[0], device=device) - meta.q_start[meta.q_seg]
        qpos = torch.full((num_seg, meta.max_q_len), -1, dtype=torch.long, device=device)
        qpos[meta.q_seg, q_idx] = meta.q_pos
        query_index = (meta.q_seg, q_idx)
    pad = (qpos < 0)[:, :, None] & (col == 0)  # padding queries attend to one column (no NaN)
    keys = tuple(dict.fromkeys(((None, None), *mask_keys)))
    masks = {}
    for window, chunk in keys:
        mask = in_table[:, None, :] & allowed(qpos[:, :, None], kpos[:, None, :], window, chunk)  # [S, Q, C]
        masks[(window, chunk)] = _bias(mask | pad)[:, None]
    cascade = None
    if meta.is_decode and meta.group_prefix_table is not None and device.type == "cpu":
        # (the log-sum-exp it needs comes from the CPU attention kernel; the whole-context masks above still serve
        # the layers that need explicit scores, and are dropped by the compiler when no layer reads them)
        cascade = _cascade_plan(meta, keys)
    return replace(meta, context=ContextPlan(slots=slots.reshape(-1), masks=masks, query_index=query_index,
                                             cascade=cascade))


def _bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def _cascade_plan(meta: PagedAttentionMetadata, mask_keys: tuple[MaskKey, ...]) -> CascadePlan:
    """The split decode context (see `CascadePlan`), built once per forward."""
    bs, device = meta.block_size, meta.prompt_lens.device
    groups = meta.group_prefix_table  # [Gb, Wp]
    cp = groups.shape[1] * bs
    pcol = torch.arange(groups.shape[0] * cp, device=device)  # [Gb * Cp]
    ppos = pcol % cp  # absolute position of each prompt column
    mine = (pcol // cp)[None, :] == meta.row_group_slot[:, None]  # [S, Gb * Cp]
    in_prompt = mine & (ppos[None, :] < meta.prompt_lens[:, None])
    cs = meta.suffix_table.shape[1] * bs
    opos = meta.prompt_lens[:, None] + torch.arange(cs, device=device)  # [S, Cs] absolute position of own columns
    qpos = meta.q_pos[:, None]
    prefix_masks, own_masks, prefix_visible = {}, {}, {}
    for window, chunk in mask_keys:
        seen = in_prompt & allowed(qpos, ppos[None, :], window, chunk)  # [S, Gb * Cp]
        prefix_masks[(window, chunk)] = _bias(seen)[None, None]
        prefix_visible[(window, chunk)] = seen.any(1)
        own_masks[(window, chunk)] = _bias(allowed(qpos, opos, window, chunk))[:, None, None]
    return CascadePlan(prefix_slots=_table_slots(groups, bs).reshape(-1),
                       own_slots=_table_slots(meta.suffix_table, bs).reshape(-1), prefix_masks=prefix_masks,
                       own_masks=own_masks, prefix_visible=prefix_visible)


def _pad(rows: list[list[int]]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True)


def _check_capacity(segments: list[Segment], q_seg: torch.Tensor, q_pos: torch.Tensor, prompt_lens: torch.Tensor,
                    block_size: int) -> None:
    """Refuse a forward that would write KV past a segment's blocks (host tensors, no device sync): the slot lookup
    clamps to the table, so such a token would silently overwrite another position's KV (the scheduler reserves
    the blocks of every token a forward writes; a caller that drafts more than it reserved is a bug)."""
    prefix_cap = torch.tensor([len(s.prefix_blocks) for s in segments], dtype=torch.long) * block_size  # [S]
    own_cap = torch.tensor([len(s.suffix_blocks) for s in segments], dtype=torch.long) * block_size  # [S]
    plen = prompt_lens[q_seg]  # [T]
    fits = torch.where(q_pos < plen, q_pos < prefix_cap[q_seg], q_pos - plen < own_cap[q_seg])  # [T]
    if not bool(fits.all()):
        i = int(q_seg[~fits][0])
        seg = segments[i]
        raise RuntimeError(
            f"segment {i} writes KV at positions {seg.start_pos}..{seg.end_pos - 1} (prompt {seg.prompt_len} tokens) "
            f"but holds {len(seg.prefix_blocks)} prompt and {len(seg.suffix_blocks)} own blocks of {block_size}: it "
            "would overwrite other KV (a caller wrote more tokens than the scheduler reserved slots for)")


def build_metadata(segments: list[Segment], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Pack host-side segments into `input_ids` [1, T], `position_ids` [1, T] and the attention metadata."""
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
    _check_capacity(segments, q_seg, q_pos, prompt_lens, block_size)
    slot_mapping = slots_for_positions(q_pos[:, None], prompt_lens[q_seg], prefix_table[q_seg], suffix_table[q_seg], block_size)[:, 0]
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    copies = torch.tensor([c for s in segments for c in s.copies], dtype=torch.long).reshape(-1, 2)  # [C, 2]
    meta = PagedAttentionMetadata(
        block_size=block_size, slot_mapping=to(slot_mapping), q_seg=to(q_seg), q_pos=to(q_pos), q_start=to(q_start),
        prompt_lens=to(prompt_lens), prefix_table=to(prefix_table), suffix_table=to(suffix_table),
        seg_group=to(torch.tensor([s.group_index for s in segments], dtype=torch.long)), max_q_len=int(q_lens.max()),
        num_groups=len({(s.group_index, s.prompt_len, tuple(s.prefix_blocks)) for s in segments}),
        copy_slots=(to(copies[:, 0]), to(copies[:, 1])) if copies.numel() else None,
    )
    return to(input_ids)[None], to(q_pos)[None], meta


def decode_metadata(
    positions: torch.Tensor,  # [N] position of each row's input token (its last output token)
    prompt_lens: torch.Tensor,  # [N]
    prefix_table: torch.Tensor,  # [N, Wp]
    suffix_table: torch.Tensor,  # [N, Ws]
    groups: torch.Tensor,  # [N]
    block_size: int,
    row_group_slot: torch.Tensor | None = None,  # [N] slot of each row's group in `group_prefix_table`
    group_prefix_table: torch.Tensor | None = None,  # [Gb, Wp] prompt blocks per group slot (cascade decode)
    num_groups: int | None = None,  # host int: the rows' distinct prompts, or a bucket above (Triton prompt splits)
) -> PagedAttentionMetadata:
    """Metadata of a decode forward (one query per row) from device tensors only: no host sync, static shapes.
    With the group slots, the torch backend attends each group's prompt once for all its rows (`CascadePlan`)."""
    rows = torch.arange(positions.shape[0], device=positions.device)
    own = positions - prompt_lens  # the input token is a completion token: it lives in the row's own blocks
    block = suffix_table.gather(1, (own // block_size)[:, None])[:, 0]
    return PagedAttentionMetadata(
        block_size=block_size, slot_mapping=block * block_size + own % block_size, q_seg=rows, q_pos=positions,
        q_start=rows, prompt_lens=prompt_lens, prefix_table=prefix_table, suffix_table=suffix_table, seg_group=groups,
        max_q_len=1, num_groups=num_groups, row_group_slot=row_group_slot, group_prefix_table=group_prefix_table,
    )
