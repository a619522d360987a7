"""The drafter protocol and its registry.

A drafter sees each sample through four calls: `start(seq)` when the sample first decodes (its context is
`prompt_ids + output_ids`), `update(seq, tokens)` with every token the sample emits from then on, `propose(seqs, ks)`
for up to `ks[i]` draft tokens per sample, and `stop(seq)` when it finished. Drafts are proposals only: verification
emits exactly the tokens plain decoding would (`verify.py`), so a drafter can never change the output, only the
speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..registry import DRAFTERS, register_drafter
from ..sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens for one sample (verification needs no draft distribution: it compares each draft with the
    token plain decoding emits at that position)."""

    tokens: list[int]


EMPTY = Proposal([])


class Drafter:
    """Base class: bookkeeping of started samples; subclasses implement `_start`, `update`, `propose`."""

    name = "base"
    cost_per_token = 0.0  # drafting cost of one token relative to one target decode forward (draft ladder input)

    def __init__(self) -> None:
        self.active: dict[int, Sequence] = {}

    def start(self, seq: Sequence) -> None:
        self.active[seq.seq_id] = seq
        self._start(seq)

    def started(self, seq: Sequence) -> bool:
        return seq.seq_id in self.active

    def _start(self, seq: Sequence) -> None:
        raise NotImplementedError

    def update(self, seq: Sequence, tokens: list[int]) -> None:
        """`tokens` were appended to the sample's context."""
        raise NotImplementedError

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to `ks[i]` draft tokens continuing sample i's context (a sample with k = 0 gets `EMPTY`)."""
        raise NotImplementedError

    def stop(self, seq: Sequence) -> None:
        self.active.pop(seq.seq_id, None)


DrafterFactory = Callable[..., Drafter]
# Drafter classes/factories by name (`EngineConfig.speculative_method`) live in `engine.registry.DRAFTERS`; a factory
# is called as `factory(config=EngineConfig, device=torch.device, **extras)`.
__all__ = ["DRAFTERS", "EMPTY", "Drafter", "DrafterFactory", "Proposal", "build_drafter", "register_drafter"]


def build_drafter(name: str, **kwargs) -> Drafter:
    return DRAFTERS.get_or_raise(name)(**kwargs)
