"""Prompt-lookup drafting: continue the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

from trl_infinite.engine.config.engine_config import SpeculativeConfig
from trl_infinite.engine.sched.sequence import Sequence
from trl_infinite.engine.spec_decode.drafter import EMPTY, DraftContext, Drafter, Proposal, register_drafter


@register_drafter("ngram")
class NgramDrafter(Drafter):
    """For n from `max_n` down to `min_n`, find the latest earlier position where the sample's last n tokens
    (prompt + completion) occurred and propose the tokens that followed. Tables are updated incrementally: the
    n-gram ending at index j is indexed (-> j) once token j exists, so a hit always has a continuation. Options:
    `config.ngram`."""

    def __init__(self, config: SpeculativeConfig, context: DraftContext | None = None):
        super().__init__()
        self.max_n, self.min_n = config.ngram.max_n, config.ngram.min_n
        self.ctx: dict[int, list[int]] = {}
        self.tables: dict[int, dict[tuple[int, ...], int]] = {}

    def _start(self, seq: Sequence) -> None:
        self.ctx[seq.seq_id] = []
        self.tables[seq.seq_id] = {}
        self.update(seq, seq.group.prompt_ids + seq.output_ids)

    def update(self, seq: Sequence, tokens: list[int]) -> None:
        ctx, table = self.ctx[seq.seq_id], self.tables[seq.seq_id]
        for t in tokens:
            j = len(ctx)
            for n in range(self.min_n, min(self.max_n, j) + 1):
                table[tuple(ctx[j - n : j])] = j
            ctx.append(t)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._one(s, k) if k > 0 else EMPTY for s, k in zip(seqs, ks)]

    supports_ahead = True

    def propose_ahead(self, seqs: list[Sequence], assumed: list[list[int]], ks: list[int]) -> list[Proposal]:
        """Lookup of the last n-gram of the context + `assumed` (the tables index the context only)."""
        return [self._one(s, k, extra) if k > 0 else EMPTY for s, extra, k in zip(seqs, assumed, ks)]

    def _one(self, seq: Sequence, k: int, extra: list[int] = ()) -> Proposal:
        ctx, table = self.ctx[seq.seq_id], self.tables[seq.seq_id]
        if extra:
            ctx = ctx + list(extra)
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            j = table.get(tuple(ctx[-n:]))
            if j is not None:
                return Proposal(ctx[j : j + k])
        return EMPTY

    def stop(self, seq: Sequence) -> None:
        super().stop(seq)
        self.ctx.pop(seq.seq_id, None)
        self.tables.pop(seq.seq_id, None)
