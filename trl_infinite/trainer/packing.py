"""TRL's padded training batch as one packed sequence in which each group's prompt appears once.

TRL's training forward runs `[B, P + C]` rows: each prompt left-padded to `P`, each completion right-padded to `C`,
and a GRPO group's G rows hold the same prompt, so its tokens are encoded G times. Here the rows are packed into one
sequence of `N` tokens with no padding, group by group:

    [ shared_g | row_g1 | row_g2 | ... | row_gG ]  for each group g,
    shared_g = the prompt without its last token            (columns P - p_g .. P - 2),
    row_r    = the prompt's last token, then the completion (columns P - 1 .. P + c_r - 1),

where `p_g` is the prompt's length and `c_r` the row's completion length (its `attention_mask` ones). Each row
segment starts with its own copy of the prompt's last token because the hidden state there predicts the row's first
completion token: one position per row, so every scored position has exactly one label. Tokens keep the column
index of TRL's padded batch as their position (what the model's own forward numbers them, `arange(P + C)`), and the
attention masks number them from their row's first real token, as transformers' masks do (the causal order and a
sliding window depend only on differences; Llama 4's attention chunks are counted from the first real token,
`masking_utils.chunked_overlay`), so the packed forward computes the same function as TRL's: a row segment attends to its group's shared tokens and causally
to itself (`grouped_attention.py`), the shared tokens causally among themselves, and the gradient reaching the
shared tokens is the sum over the G rows, as in TRL's G copies.

Rows whose completion is fully masked score nothing (their log-probs stay 0, as in TRL's fused head where the
labels are -100) and are left out; a batch whose masks are not TRL's shapes (prompt mask not a suffix, completion
mask not a prefix, an empty prompt) is not packed (`pack_rows` returns the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class GroupedLayout:
    """The packed sequence and everything the attention and the head read from it, built once per forward.

    Query slots: shared segments padded to `s_max` ([num_shared, s_max]) and row segments padded to `r_max`
    ([num_rows, r_max]); a row's keys are its group's shared slots followed by its own slots ([num_rows, s_max +
    r_max]). Index tensors point into the packed sequence (padding slots point at token 0 and are masked)."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N] column index in TRL's padded batch
    mask_positions: torch.Tensor  # [N] position from the row's first real token (the masks' numbering)
    shared_index: torch.Tensor  # [num_shared, s_max] packed index of each shared slot
    shared_valid: torch.Tensor  # [num_shared, s_max] bool
    row_index: torch.Tensor  # [num_rows, r_max] packed index of each row slot
    row_valid: torch.Tensor  # [num_rows, r_max] bool
    row_keys: torch.Tensor  # [num_rows, s_max + r_max] packed index of each key of a row (shared, then own)
    row_keys_valid: torch.Tensor  # [num_rows, s_max + r_max] bool
    slot_of_token: torch.Tensor  # [N] index of each packed token in cat(shared slots, row slots) flattened
    score_index: torch.Tensor  # [M] packed positions whose next token is scored
    labels: torch.Tensor  # [M] the token each scored position predicts
    out_rows: torch.Tensor  # [M] TRL row of each scored token
    out_cols: torch.Tensor  # [M] completion column of each scored token
    batch_shape: tuple[int, int]  # (B, C) of TRL's per-token outputs
    num_groups: int
    # each row's keys (its group's shared slots, then its own) are one unbroken causal run: every row has its
    # group's whole shared part of `s_max` tokens (no padding before its own tokens), and `s_max < r_max` (so
    # attending from every key slot, the shared slots' wasted queries included, with a causal mask costs less than
    # the rows' dense masked attention); then a plain-causal layer attends the rows with `is_causal`
    causal_rows: bool
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def masks(self, sliding_window: int | None, chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean masks of one attention pattern (built once per forward and pattern, shared by its layers):
        shared [num_shared, 1, s_max, s_max] and rows [num_rows, 1, r_max, s_max + r_max] (query x key)."""
        key = (sliding_window, chunk_size)
        if key not in self._masks:
            self._masks[key] = (
                _mask(self.mask_positions, self.shared_index, self.shared_valid, self.shared_index,
                      self.shared_valid, sliding_window, chunk_size),
                _mask(self.mask_positions, self.row_index, self.row_valid, self.row_keys, self.row_keys_valid,
                      sliding_window, chunk_size),
            )
        return self._masks[key]


def _mask(positions, q_index, q_valid, k_index, k_valid, sliding_window, chunk_size) -> torch.Tensor:
    """[S, 1, Q, K] bool: causal by position, the layer's window / chunk, valid keys only. A padding query sees every
    valid key (its output is dropped; a row of no keys would give NaN in the backward)."""
    from trl_infinite.engine.attention import allowed

    q_pos, k_pos = positions[q_index], positions[k_index]  # [S, Q], [S, K]
    ok = allowed(q_pos[:, :, None], k_pos[:, None, :], sliding_window, chunk_size) & k_valid[:, None, :]
    ok = torch.where(q_valid[:, :, None], ok, k_valid[:, None, :])
    return ok[:, None]


def _suffix_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """Per-row count of a mask whose ones form a suffix of the row ([B]), None if some row's do not."""
    lengths = mask.sum(dim=1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    return lengths if torch.equal(mask.bool(), cols[None, :] >= (mask.shape[1] - lengths)[:, None]) else None


def _prefix_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    lengths = mask.sum(dim=1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    return lengths if torch.equal(mask.bool(), cols[None, :] < lengths[:, None]) else None


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> GroupedLayout | str:
    """Pack TRL's `[B, P + C]` batch (prompt left-padded, completion right-padded, `C = logits_to_keep`); rows with
    the same prompt form a group. Returns the layout, or why the batch cannot be packed (then run TRL's forward)."""
    B, T = input_ids.shape
    C = int(logits_to_keep)
    P = T - C
    if P < 1 or C < 1:
        return "the batch has no prompt or no completion columns"
    device = input_ids.device
    ids_cpu, mask_cpu = input_ids.cpu(), attention_mask.cpu()
    prompt_len = _suffix_lengths(mask_cpu[:, :P])
    comp_len = _prefix_lengths(mask_cpu[:, P:])
    if prompt_len is None or comp_len is None:
        return "its attention mask is not a left-padded prompt followed by a right-padded completion"
    if bool((prompt_len < 1).any()):
        return "a row has an empty prompt"
    keys = ids_cpu[:, :P].masked_fill(mask_cpu[:, :P] == 0, -1)
    _, group_of = torch.unique(keys, dim=0, return_inverse=True)  # [B]
    live = comp_len > 0
    if not bool(live.any()):
        return "no row has a completion token to score"
    # group order = order of first appearance among rows that score something; rows keep their order
    first_row: dict[int, int] = {}
    for r in range(B):
        if bool(live[r]):
            first_row.setdefault(int(group_of[r]), r)
    groups = sorted(first_row, key=first_row.get)
    members = {g: [r for r in range(B) if bool(live[r]) and int(group_of[r]) == g] for g in groups}

    # segments in packed order: (source row, first column, length, shared?); the row's padding is P - p
    segments: list[tuple[int, int, int, bool]] = []
    for g in groups:
        rep = first_row[g]
        p = int(prompt_len[rep])
        if p > 1:
            segments.append((rep, P - p, p - 1, True))
        for r in members[g]:
            segments.append((r, P - 1, 1 + int(comp_len[r]), False))
    seg_pad = torch.tensor([P - int(prompt_len[s[0]]) for s in segments])
    seg_row = torch.tensor([s[0] for s in segments])
    seg_col = torch.tensor([s[1] for s in segments])
    seg_len = torch.tensor([s[2] for s in segments])
    seg_shared = torch.tensor([s[3] for s in segments])
    seg_start = torch.cumsum(seg_len, 0) - seg_len  # packed index of each segment's first token
    n = int(seg_len.sum())
    tok_seg = torch.repeat_interleave(torch.arange(len(segments)), seg_len)  # [N]
    tok_off = torch.arange(n) - seg_start[tok_seg]  # offset inside the segment
    tok_col = seg_col[tok_seg] + tok_off  # [N] column in TRL's batch = position
    tok_mask_pos = tok_col - seg_pad[tok_seg]  # [N] position from the row's first real token
    tok_ids = ids_cpu[seg_row[tok_seg], tok_col]

    shared_segs = torch.nonzero(seg_shared).flatten()
    row_segs = torch.nonzero(~seg_shared).flatten()
    s_max = max(1, int(seg_len[shared_segs].max()) if shared_segs.numel() else 1)
    r_max = int(seg_len[row_segs].max())
    slots_s = torch.arange(s_max)
    slots_r = torch.arange(r_max)
    shared_valid = slots_s[None, :] < seg_len[shared_segs][:, None]  # [S, s_max]
    shared_index = torch.where(shared_valid, seg_start[shared_segs][:, None] + slots_s[None, :], 0)
    row_valid = slots_r[None, :] < seg_len[row_segs][:, None]  # [R, r_max]
    row_index = torch.where(row_valid, seg_start[row_segs][:, None] + slots_r[None, :], 0)
    # each row's shared segment (the one of its group), if its prompt has more than one token
    shared_of_group = {int(group_of[int(seg_row[s])]): k for k, s in enumerate(shared_segs.tolist())}
    row_shared = torch.tensor([shared_of_group.get(int(group_of[int(seg_row[s])]), -1) for s in row_segs.tolist()])
    has_shared = row_shared >= 0
    pick = row_shared.clamp(min=0)
    if shared_segs.numel():
        k_shared = shared_index[pick]
        k_shared_valid = shared_valid[pick] & has_shared[:, None]
    else:
        k_shared = torch.zeros(len(row_segs), s_max, dtype=torch.long)
        k_shared_valid = torch.zeros(len(row_segs), s_max, dtype=torch.bool)
    causal_rows = bool(shared_segs.numel()) and bool(k_shared_valid.all()) and s_max < r_max
    row_keys = torch.cat([torch.where(k_shared_valid, k_shared, 0), row_index], dim=1)
    row_keys_valid = torch.cat([k_shared_valid, row_valid], dim=1)

    # where each packed token's attention output lives in cat(shared slots, row slots)
    slot_of_token = torch.empty(n, dtype=torch.long)
    slot_of_token[shared_index[shared_valid]] = (
        torch.arange(len(shared_segs))[:, None] * s_max + slots_s[None, :])[shared_valid]
    slot_of_token[row_index[row_valid]] = (
        len(shared_segs) * s_max + torch.arange(len(row_segs))[:, None] * r_max + slots_r[None, :])[row_valid]

    # scored positions: every row-segment token but the last predicts the next one (completion column j)
    scored = (~seg_shared[tok_seg]) & (tok_off < seg_len[tok_seg] - 1)
    score_index = torch.nonzero(scored).flatten()
    out_rows = seg_row[tok_seg[score_index]]
    out_cols = tok_off[score_index]
    labels = ids_cpu[out_rows, P + out_cols]

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return GroupedLayout(
        input_ids=dev(tok_ids[None]), position_ids=dev(tok_col[None]), mask_positions=dev(tok_mask_pos),
        shared_index=dev(shared_index), shared_valid=dev(shared_valid),
        row_index=dev(row_index), row_valid=dev(row_valid),
        row_keys=dev(row_keys), row_keys_valid=dev(row_keys_valid),
        slot_of_token=dev(slot_of_token), score_index=dev(score_index), labels=dev(labels),
        out_rows=dev(out_rows), out_cols=dev(out_cols), batch_shape=(B, C), num_groups=len(groups),
        causal_rows=causal_rows,
    )
