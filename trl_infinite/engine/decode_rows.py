"""Persistent device state of the decode batch, updated incrementally between steps.

Row `r < n` holds one running sample; the rows stay dense (a leaving row is filled with the last one, one row copy)
so the batch is always rows `0 .. n-1`, padded to a bucket. Per row the device holds what the decode metadata is
computed from: prompt length, group and sample index (the sampling keys), the prompt's block table and the sample's
own block table, and with a repetition penalty which ids the row's context holds. Rows `>= n` are padding: every
table entry points at the pool's null block, so a padded row writes and reads only that block.

Per step the host uploads one [2, n] tensor (each row's input token and its position) plus only what changed:
tables of joining rows, block ids appended since the last step, tokens to mark as seen. A row is rewritten when the
sample's block list or its prompt's block list was replaced (preemption, eviction, host offload: the scheduler
always assigns a new list then), detected by identity.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


class DecodeRows:
    """Device tensors of `capacity` rows; `prefix_cols` / `own_cols` block-table columns per row."""

    def __init__(self, capacity: int, prefix_cols: int, own_cols: int, block_size: int, null_block: int,
                 device: torch.device, vocab: int | None):
        self.capacity, self.prefix_cols, self.own_cols = capacity, prefix_cols, own_cols
        self.block_size = block_size
        self.null_block = null_block
        self.device = device
        self.inputs = torch.zeros(2, capacity, dtype=torch.long, device=device)  # [token; position] per row
        self.prompt_len = torch.zeros(capacity, dtype=torch.long, device=device)
        self.group = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.sample = torch.zeros(capacity, dtype=torch.long, device=device)
        self.prefix_table = torch.full((capacity, prefix_cols), null_block, dtype=torch.long, device=device)
        self.suffix_table = torch.full((capacity, own_cols), null_block, dtype=torch.long, device=device)
        self.seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=device) if vocab else None
        self.seqs: list[Sequence] = []  # row -> sample
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._lists: list[tuple[list[int], list[int]]] = []  # per row: (own block list, prompt block list) seen
        self._written: list[int] = []  # per row: own block ids uploaded
        self._marked: list[int] = []  # per row: output tokens marked in `seen`
        self.max_prompt_blocks = 0  # widest table row in use after the last `update`
        self.max_own_blocks = 0

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    def fits(self, capacity: int, prefix_cols: int, own_cols: int, vocab: int | None) -> bool:
        return (capacity <= self.capacity and prefix_cols <= self.prefix_cols and own_cols <= self.own_cols
                and (vocab is None or (self.seen is not None and self.seen.shape[1] == vocab)))

    def _state(self) -> list[torch.Tensor]:
        tensors = [self.prompt_len, self.group, self.sample, self.prefix_table, self.suffix_table]
        return tensors + ([self.seen] if self.seen is not None else [])

    # ------------------------------------------------------------------ one step
    def update(self, seqs: list[Sequence]) -> list[int]:
        """Make rows `0 .. len(seqs)-1` hold exactly `seqs`; returns each sample's row (in `seqs` order)."""
        current = {s.seq_id for s in seqs}
        self._drop([r for r, s in enumerate(self.seqs) if s.seq_id not in current or self._replaced(r, s)])
        joiners = [s for s in seqs if s.seq_id not in self.row_of]
        if joiners:
            self._join(joiners)
        self._step_inputs()
        return [self.row_of[s.seq_id] for s in seqs]

    def _replaced(self, row: int, seq: Sequence) -> bool:
        own, prompt = self._lists[row]
        return own is not seq.blocks or prompt is not seq.group.prompt_blocks

    def _drop(self, leaving: list[int]) -> None:
        """Remove rows; the last rows that stay move into the holes below the new count (one copy per tensor)."""
        if not leaving:
            return
        n = len(self.seqs)
        m = n - len(leaving)
        gone = set(leaving)
        holes = [r for r in leaving if r < m]
        movers = [r for r in range(m, n) if r not in gone]
        for r in leaving:
            del self.row_of[self.seqs[r].seq_id]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for t in self._state():
                t[dst] = t[src]
            for h, mv in zip(holes, movers):
                self.seqs[h], self._lists[h] = self.seqs[mv], self._lists[mv]
                self._written[h], self._marked[h] = self._written[mv], self._marked[mv]
                self.row_of[self.seqs[h].seq_id] = h
        del self.seqs[m:], self._lists[m:], self._written[m:], self._marked[m:]
        self._reset(m, n)

    def _reset(self, start: int, end: int) -> None:
        self.inputs[:, start:end] = 0
        self.prompt_len[start:end] = 0
        self.group[start:end] = -1
        self.sample[start:end] = 0
        self.prefix_table[start:end] = self.null_block
        self.suffix_table[start:end] = self.null_block

    def _join(self, joiners: list[Sequence]) -> None:
        start = len(self.seqs)
        rows = torch.arange(start, start + len(joiners), device=self.device)
        ids = torch.tensor([[s.prompt_len, s.group_id, s.sample_idx] for s in joiners], dtype=torch.long)
        ids = ids.to(self.device)
        self.prompt_len[rows], self.group[rows], self.sample[rows] = ids[:, 0], ids[:, 1], ids[:, 2]
        self.prefix_table[rows] = self._table([s.group.prompt_blocks for s in joiners], self.prefix_cols)
        self.suffix_table[rows] = self._table([s.blocks for s in joiners], self.own_cols)
        for i, s in enumerate(joiners):
            self.row_of[s.seq_id] = start + i
            self.seqs.append(s)
            self._lists.append((s.blocks, s.group.prompt_blocks))
            self._written.append(len(s.blocks))
            self._marked.append(0)
        if self.seen is not None:
            self.seen[rows] = False
            self._mark([(start + i, t) for i, s in enumerate(joiners) for t in s.group.prompt_ids])

    def _table(self, lists: list[list[int]], cols: int) -> torch.Tensor:
        out = torch.full((len(lists), cols), self.null_block, dtype=torch.long)
        for i, blocks in enumerate(lists):
            out[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        return out.to(self.device)

    def _step_inputs(self) -> None:
        """One pass over the rows: each row's input token and position, own block ids appended since the last step,
        newly emitted tokens to mark as seen, the widest rows."""
        n = len(self.seqs)
        inputs = [0] * (2 * n)
        cells, marks = [], []
        max_prompt = max_own = 0
        for r, s in enumerate(self.seqs):
            out = s.output_ids
            inputs[r] = out[-1]
            inputs[n + r] = s.group.prompt_len + len(out) - 1
            blocks = s.blocks
            have = len(blocks)
            if have > self._written[r]:
                cells.extend((r, c, blocks[c]) for c in range(self._written[r], have))
            self._written[r] = have  # fewer after a lookahead rollback: the extra entries are never read
            if self.seen is not None and self._marked[r] < len(out):
                marks.extend((r, t) for t in out[self._marked[r]:])
                self._marked[r] = len(out)
            max_own = max(max_own, have)
            max_prompt = max(max_prompt, len(s.group.prompt_blocks))
        self.max_prompt_blocks, self.max_own_blocks = max_prompt, max_own
        if n:
            self.inputs[:, :n].copy_(torch.tensor(inputs, dtype=torch.long).view(2, n), non_blocking=True)
        if cells:
            c = torch.tensor(cells, dtype=torch.long).to(self.device)
            self.suffix_table[c[:, 0], c[:, 1]] = c[:, 2]
        if marks:
            self._mark(marks)

    def _mark(self, cells: list[tuple[int, int]]) -> None:
        c = torch.tensor(cells, dtype=torch.long).to(self.device)
        self.seen[c[:, 0], c[:, 1]] = True
