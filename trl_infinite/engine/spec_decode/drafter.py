"""The drafter protocol and its registry.

A drafter sees each sample through four calls: `start(seq)` when the sample first decodes (its context is
`prompt_ids + output_ids`), `update(seq, tokens)` with every token the sample emits from then on, `propose(seqs, ks)`
for up to `ks[i]` draft tokens per sample, and `stop(seq)` when it finished. Drafts are proposals only: verification
emits exactly the tokens plain decoding would (`verify.py`), so a drafter can never change the output, only the
speed.

Drafters are built by name for each `generate` call, `DRAFTERS.build(name, config, context)`: `config` is the
`SpeculativeConfig` (each drafter reads its own section: `suffix`, `ngram`, `best_of_n`), `context` a `DraftContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trl_infinite.engine.config.registry import DRAFTERS, register_drafter
from trl_infinite.engine.sched.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from trl_infinite.engine.config.engine_config import EngineConfig, SamplingParams, SpeculativeConfig
    from trl_infinite.engine.model.support import ModelSupport
    from trl_infinite.engine.sched.history import PromptHistory


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may use besides its options. `engine`: the target's config (a draft model's own pool mirrors
    its block size, KV budget and attention settings); `history`: the engine's per-prompt history; `draft_model`:
    `speculative_draft_model`, loaded once per engine (None when not set); `draft_support`: its support contract,
    checked once per engine (`draft_check.py`); `pool_blocks`: usable blocks of the target's pool for this call,
    which the draft model's pool mirrors (its bytes were taken out of the engine's KV budget; None outside an
    engine: the budget's tokens)."""

    device: torch.device
    sampling: SamplingParams
    engine: EngineConfig
    history: PromptHistory | None = None
    draft_model: torch.nn.Module | None = None
    draft_support: ModelSupport | None = None
    pool_blocks: int | None = None


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

    def __init__(self, config: SpeculativeConfig | None = None, context: DraftContext | None = None) -> None:
        self.active: dict[int, Sequence] = {}

    def start(self, seq: Sequence) -> None:
        self.active[seq.seq_id] = seq
        self._start(seq)

    def _start(self, seq: Sequence) -> None:
        raise NotImplementedError

    def update(self, seq: Sequence, tokens: list[int]) -> None:
        """`tokens` were appended to the sample's context."""
        raise NotImplementedError

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to `ks[i]` draft tokens continuing sample i's context (a sample with k = 0 gets `EMPTY`)."""
        raise NotImplementedError

    def propose_ahead(self, seqs: list[Sequence], assumed: list[list[int]], ks: list[int]) -> list[Proposal]:
        """Decoupled speculation (`decoupled.py`): up to `ks[i]` draft tokens continuing sample i's context followed
        by `assumed[i]` (its drafts under verification, taken as accepted), without changing what `update` will be
        told. Runs on the drafter thread while no other method of the drafter runs. Drafters that implement it set
        `supports_ahead`."""
        raise NotImplementedError

    supports_ahead = False

    def stop(self, seq: Sequence) -> None:
        self.active.pop(seq.seq_id, None)


__all__ = ["DRAFTERS", "EMPTY", "DraftContext", "Drafter", "Proposal", "register_drafter"]
