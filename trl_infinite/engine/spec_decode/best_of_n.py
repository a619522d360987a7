"""Best-of-N drafting (SpecActor §4.2): several drafters per sample, the one with the best expected tokens per
unit cost is verified.

Every member keeps its own per-sample acceptance estimate `alpha_m` (decayed Beta counts, see `adaptive.py`). A
proposal of length L from member m is worth `(1 + E_L(alpha_m)) / (1 + c_m L)` tokens per unit cost (the draft
ladder: expected emitted tokens over the cost of drafting, `c_m` = member's drafting cost per token relative to a
target forward). Cheap members (suffix tree, n-gram) propose every step; costly ones (a draft model) only for the
samples that pick them from their estimates, or for every sample in the tail (batch <= `tail_batch`), where
spare compute lets tail requests try more than one drafter. After verification every member that proposed is
scored against the emitted tokens (the length of its proposal's prefix that matches them), so the estimates of
the members that were not verified improve for free.
"""

from __future__ import annotations

from trl_infinite.engine.config.engine_config import SpeculativeConfig
from trl_infinite.engine.sched.sequence import Sequence
from trl_infinite.engine.spec_decode.adaptive import AcceptanceTracker, expected_accepted
from trl_infinite.engine.spec_decode.drafter import EMPTY, DraftContext, Drafter, Proposal, register_drafter
from trl_infinite.engine.spec_decode.ngram import NgramDrafter
from trl_infinite.engine.spec_decode.suffix import SuffixDrafter


@register_drafter("best_of_n")
class BestOfNDrafter(Drafter):
    """Picks, per sample, the member drafter with the most expected accepted tokens per unit cost (module docs).
    Members: the suffix tree, n-grams, and the draft model where `context` has one; `config.best_of_n`."""

    def __init__(self, config: SpeculativeConfig, context: DraftContext):
        super().__init__()
        self.members: list[Drafter] = [SuffixDrafter(config, context), NgramDrafter(config, context)]
        if context.draft_model is not None:
            from trl_infinite.engine.spec_decode.draft_model import DraftModelDrafter

            self.members.append(DraftModelDrafter(config, context))
        self.tail_batch = config.best_of_n.tail_batch
        self.tracker = AcceptanceTracker()
        self.pending: dict[int, list[tuple[int, list[int]]]] = {}  # seq -> [(member, proposal)] awaiting scoring
        self.chosen: dict[str, int] = {m.name: 0 for m in self.members}

    def _start(self, seq: Sequence) -> None:
        for m in self.members:
            m.start(seq)

    def update(self, seq: Sequence, tokens: list[int]) -> None:
        for mi, draft in self.pending.pop(seq.seq_id, []):
            matched = next((j for j, (d, t) in enumerate(zip(draft, tokens)) if d != t), min(len(draft), len(tokens)))
            self.tracker.observe((seq.seq_id, mi), len(draft), matched)
        for m in self.members:
            m.update(seq, tokens)

    def _value(self, seq: Sequence, mi: int, length: int) -> float:
        alpha = self.tracker.alpha((seq.seq_id, mi))
        return (1.0 + expected_accepted(alpha, length)) / (1.0 + self.members[mi].cost_per_token * length)

    supports_ahead = True

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return self._best(seqs, ks, None)

    def propose_ahead(self, seqs: list[Sequence], assumed: list[list[int]], ks: list[int]) -> list[Proposal]:
        """The members' drafts after the context + `assumed`, the best one per sample (members are scored against
        the emitted tokens only for drafts proposed from the context itself)."""
        return self._best(seqs, ks, assumed)

    def _best(self, seqs: list[Sequence], ks: list[int], assumed: list[list[int]] | None) -> list[Proposal]:
        tail = len(seqs) <= self.tail_batch
        by_member: list[list[Proposal]] = []

        def ask(m: Drafter, want: list[int]) -> list[Proposal]:
            return m.propose(seqs, want) if assumed is None else m.propose_ahead(seqs, assumed, want)

        for mi, m in enumerate(self.members):
            if m.cost_per_token == 0 or tail:
                by_member.append(ask(m, ks))
                continue
            # a costly member drafts only for samples whose estimate says it beats every cheap one
            want = [k if k > 0 and self._prefers(s, mi, k) else 0 for s, k in zip(seqs, ks)]
            by_member.append(ask(m, want) if any(want) else [EMPTY] * len(seqs))
        out = []
        for i, s in enumerate(seqs):
            options = [(self._value(s, mi, len(p[i].tokens)), mi) for mi, p in enumerate(by_member) if p[i].tokens]
            if not options:
                out.append(EMPTY)
                continue
            best = max(options)[1]
            self.chosen[self.members[best].name] += 1
            if assumed is None:
                self.pending[s.seq_id] = [(mi, by_member[mi][i].tokens) for _, mi in options]
            out.append(by_member[best][i])
        return out

    def _prefers(self, seq: Sequence, mi: int, k: int) -> bool:
        return all(self._value(seq, mi, k) >= self._value(seq, j, k) for j in range(len(self.members)) if j != mi)

    def stop(self, seq: Sequence) -> None:
        super().stop(seq)
        self.pending.pop(seq.seq_id, None)
        for mi, m in enumerate(self.members):
            m.stop(seq)
            self.tracker.forget((seq.seq_id, mi))
