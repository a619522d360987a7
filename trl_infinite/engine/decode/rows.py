"""Persistent device state of the decode batch, updated incrementally between steps.

Row `r < n` holds one running sample; the rows stay dense (a leaving row is filled with one of the last rows, one
row copy per tensor) so the batch is always rows `0 .. n-1`, padded to a bucket. Per row the device holds what the
decode step reads: its input token and position, prompt length, group and sample index (the sampling keys), the
prompt's block table and the sample's own block table, and with a repetition penalty which ids its context holds.
Rows `>= n` are padding: every table entry points at the pool's null block and the group is -1, so a padded row
writes and reads only that block.

Each row also holds the slot of its group (`group_slot`) in a table of the batch's distinct prompts
(`group_prefix`, one row per group slot, lowest free slot first), which the torch backend uses to attend each prompt
once for all its rows. A slot is written when its group's first row joins and freed when its last row leaves.

The static step itself advances the rows it decodes (input token := the sampled one, position + 1, the token marked
as seen), so between two steps the host uploads only what changed: the whole state of joining rows, and the block
ids the scheduler appended (`ScheduledBatch.grown`). A row is rewritten when the sample's KV was rebuilt (preempted
and re-admitted with a recompute). The host work per step is a few set operations, not a loop over every row.

Uploads go through pinned memory without blocking the host (`upload`): a pageable source would make each copy
synchronous, staged through a driver buffer. PyTorch's caching host allocator keeps a pinned block until the copy
that reads it has run, so the host tensors can be dropped right away.
"""

from __future__ import annotations

from collections import Counter

import torch

from trl_infinite.engine.decode.step import padded_rows
from trl_infinite.engine.sched.sequence import Sequence


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`: on CUDA a non-blocking copy from pinned memory, elsewhere `host` itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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
        self.group_slot = torch.zeros(capacity, dtype=torch.long, device=device)
        self.group_prefix = torch.full((capacity, prefix_cols), null_block, dtype=torch.long, device=device)
        self._slot_of: dict[tuple, int] = {}  # (group id, prompt blocks) -> slot
        self._slot_key: list[tuple | None] = []  # slot -> its key (None: free)
        self._slot_rows: list[int] = []  # slot -> rows using it
        self._row_slot: list[int] = []  # per row: its group slot
        self.seqs: list[Sequence] = []  # row -> sample
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._written: list[int] = []  # per row: own block ids uploaded
        self._prompt_n: list[int] = []  # per row: prompt blocks in its table
        self._own = Counter()  # own block counts of the rows -> how many rows have it (for the widest row)
        self._prompt = Counter()

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    @property
    def max_own_blocks(self) -> int:
        return max(self._own, default=0)

    @property
    def max_prompt_blocks(self) -> int:
        return max(self._prompt, default=0)

    @property
    def num_groups(self) -> int:
        """Distinct prompts (group id, prompt blocks) among the rows: a host int, no device read."""
        return len(self._slot_of)

    @property
    def group_slots_used(self) -> int:
        """Group slots up to the highest one in use (the width of the prompt pass)."""
        return len(self._slot_key)

    def clear(self) -> None:
        """Forget every row (after a step that appended tokens without advancing the rows on the device)."""
        self.update([])

    def fits(self, capacity: int, prefix_cols: int, own_cols: int, vocab: int | None) -> bool:
        return (capacity <= self.capacity and prefix_cols <= self.prefix_cols and own_cols <= self.own_cols
                and (vocab is None or (self.seen is not None and self.seen.shape[1] == vocab)))

    def _state(self) -> list[torch.Tensor]:
        tensors = [self.inputs.T, self.prompt_len, self.group, self.sample, self.prefix_table, self.suffix_table,
                   self.group_slot]
        return tensors + ([self.seen] if self.seen is not None else [])

    def update(self, seqs: list[Sequence], grown: list[Sequence] = (), rebuilt: list[Sequence] = ()) -> list[int]:
        """Make rows `0 .. len(seqs)-1` hold exactly `seqs`; returns each sample's row (in `seqs` order).
        `grown`: samples whose own block list the scheduler extended this step; `rebuilt`: samples whose KV was
        recomputed into new blocks (their rows are rewritten)."""
        current = {s.seq_id for s in seqs}
        redo = {s.seq_id for s in rebuilt}
        leaving = [r for sid, r in self.row_of.items() if sid not in current or sid in redo]
        if leaving:
            self._drop(leaving)
        joiners = [s for s in seqs if s.seq_id not in self.row_of]
        stay = [(self.row_of[s.seq_id], s) for s in grown if s.seq_id in self.row_of]  # joiners are written whole
        if stay:  # the whole own-table row: blocks given back after drafts may have been replaced by others
            rows = upload(torch.tensor([r for r, _ in stay]), self.device)
            self.suffix_table[rows] = self._table([s.blocks for _, s in stay], self.own_cols)
            for r, s in stay:
                self._count(self._own, self._written[r], len(s.blocks))
                self._written[r] = len(s.blocks)
        if joiners:
            self._join(joiners)
        return [self.row_of[s.seq_id] for s in seqs]

    @staticmethod
    def _count(counter: Counter, old: int | None, new: int | None) -> None:
        if old is not None:
            counter[old] -= 1
            if not counter[old]:
                del counter[old]
        if new is not None:
            counter[new] += 1

    def _drop(self, leaving: list[int]) -> None:
        """Remove rows; the last rows that stay move into the holes below the new count (one copy per tensor)."""
        n = len(self.seqs)
        m = n - len(leaving)
        gone = set(leaving)
        holes = sorted(r for r in leaving if r < m)
        movers = [r for r in range(m, n) if r not in gone]
        for r in leaving:
            seq = self.seqs[r]
            del self.row_of[seq.seq_id]
            self._count(self._own, self._written[r], None)
            self._count(self._prompt, self._prompt_n[r], None)
            self._release_slot(self._row_slot[r])
        if holes:
            dst = upload(torch.tensor(holes), self.device)
            src = upload(torch.tensor(movers), self.device)
            for t in self._state():
                t[dst] = t[src]
            for h, mv in zip(holes, movers):
                self.seqs[h], self._written[h], self._prompt_n[h] = self.seqs[mv], self._written[mv], self._prompt_n[mv]
                self._row_slot[h] = self._row_slot[mv]
                self.row_of[self.seqs[h].seq_id] = h
        del self.seqs[m:], self._written[m:], self._prompt_n[m:], self._row_slot[m:]
        for t, fill in zip(self._state(), (0, 0, -1, 0, self.null_block, self.null_block, 0)):  # `seen` stays
            t[m:n] = fill

    def _join(self, joiners: list[Sequence]) -> None:
        """Write every piece of state of new rows (one upload per tensor)."""
        start = len(self.seqs)
        rows = torch.arange(start, start + len(joiners), device=self.device)
        fresh = {}  # group slots taken by their group's first row: their prompt tables are written
        for s in joiners:
            slot = self._take_slot((s.group_id, tuple(s.group.prompt_blocks)))
            self._row_slot.append(slot)
            if self._slot_rows[slot] == 1:
                fresh[slot] = s.group.prompt_blocks
        ids = torch.tensor([[s.output_ids[-1], s.num_tokens - 1, s.prompt_len, s.group_id, s.sample_idx, slot]
                            for s, slot in zip(joiners, self._row_slot[start:])], dtype=torch.long)
        ids = upload(ids, self.device)
        self.inputs[:, rows] = ids[:, :2].T
        self.prompt_len[rows], self.group[rows], self.sample[rows] = ids[:, 2], ids[:, 3], ids[:, 4]
        self.group_slot[rows] = ids[:, 5]
        self.prefix_table[rows] = self._table([s.group.prompt_blocks for s in joiners], self.prefix_cols)
        self.suffix_table[rows] = self._table([s.blocks for s in joiners], self.own_cols)
        if fresh:
            at = upload(torch.tensor(list(fresh), dtype=torch.long), self.device)
            self.group_prefix[at] = self._table(list(fresh.values()), self.prefix_cols)
        for i, s in enumerate(joiners):
            self.row_of[s.seq_id] = start + i
            self.seqs.append(s)
            self._written.append(len(s.blocks))
            self._prompt_n.append(len(s.group.prompt_blocks))
            self._count(self._own, None, len(s.blocks))
            self._count(self._prompt, None, len(s.group.prompt_blocks))
        if self.seen is not None:  # the prompt and every output token (later ones are marked by the step itself)
            self.seen[rows] = False
            cells = [(start + i, t) for i, s in enumerate(joiners) for t in (*s.group.prompt_ids, *s.output_ids)]
            c = upload(torch.tensor(cells, dtype=torch.long), self.device)
            self.seen[c[:, 0], c[:, 1]] = True

    def _take_slot(self, key: tuple) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            slot = next((i for i, k in enumerate(self._slot_key) if k is None), len(self._slot_key))
            if slot == len(self._slot_key):
                self._slot_key.append(None)
                self._slot_rows.append(0)
            self._slot_key[slot] = key
            self._slot_of[key] = slot
        self._slot_rows[slot] += 1
        return slot

    def _release_slot(self, slot: int) -> None:
        self._slot_rows[slot] -= 1
        if not self._slot_rows[slot]:
            del self._slot_of[self._slot_key[slot]]
            self._slot_key[slot] = None
            while self._slot_key and self._slot_key[-1] is None:  # keep the used range tight
                self._slot_key.pop()
                self._slot_rows.pop()

    def _table(self, lists: list[list[int]], cols: int) -> torch.Tensor:
        return upload(padded_rows(lists, self.null_block, cols), self.device)
