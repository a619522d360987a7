"""Per-prompt history across `generate` calls: what each prompt produced on its last few visits.

GRPO revisits the same prompts every epoch. The engine keeps, per prompt (keyed by its token ids), the completion
lengths of its last `max_visits` visits and, within a token budget, their token ids. Length predictors read the
lengths (RhymeRL, Seer: a prompt's earlier lengths predict its next ones); the suffix drafter reads the token ids
(RhymeRL, DAS, SPEC-RL: earlier rollouts of the same prompt are good drafts). Drafts are only proposals, so the
history can never change what is sampled, only how fast.

Memory is bounded: at most `max_prompts` prompts (least recently visited evicted first) and at most `max_tokens`
completion token ids in all (the oldest visits of the least recently visited prompts drop their token ids first;
their lengths stay). One history per engine, in this process only; `clear()` forgets everything.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from trl_infinite.engine.config.engine_config import HistoryConfig
from trl_infinite.engine.sched.sequence import Group


@dataclass
class PromptVisit:
    """One visit of a prompt: the G completion lengths (sample order) and, if kept, their token ids."""

    lengths: list[int]
    completions: list[array] | None = None  # int32 token ids per completion; None once dropped for the budget

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completions) if self.completions is not None else 0


def prompt_key(prompt_ids) -> bytes:
    """Compact hashable key of a prompt's token ids."""
    return array("q", prompt_ids).tobytes()


class PromptHistory:
    """Bounded LRU of per-prompt visits (see module docstring), as `config` (`EngineConfig.history`, validated
    there; default: its defaults) bounds it. `max_prompts=0` keeps nothing."""

    def __init__(self, config: HistoryConfig | None = None):
        config = config or HistoryConfig()
        self.max_prompts, self.max_visits, self.max_tokens = config.max_prompts, config.max_visits, config.max_tokens
        self._entries: OrderedDict[bytes, list[PromptVisit]] = OrderedDict()  # visits oldest first
        self._num_tokens = 0

    def visits(self, prompt_ids) -> list[PromptVisit]:
        """The prompt's recorded visits, oldest first (empty when unseen). Reading does not refresh recency."""
        return list(self._entries.get(prompt_key(prompt_ids), []))

    def lengths(self, prompt_ids) -> list[int]:
        """Every completion length of the prompt's recorded visits (oldest visit first)."""
        return [n for v in self.visits(prompt_ids) for n in v.lengths]

    def completions(self, prompt_ids) -> list[array]:
        """Token ids of the prompt's recorded completions still within the token budget (oldest visit first)."""
        return [c for v in self.visits(prompt_ids) if v.completions is not None for c in v.completions]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt_ids) -> bool:
        return prompt_key(prompt_ids) in self._entries

    @property
    def num_tokens(self) -> int:
        """Completion token ids held now (<= `max_tokens`)."""
        return self._num_tokens

    def record(self, prompt_ids, lengths: list[int], completions: list[list[int]] | None = None) -> None:
        """Add one visit of a prompt (its G completions); the prompt becomes the most recently visited."""
        if self.max_prompts == 0 or not lengths:
            return
        key = prompt_key(prompt_ids)
        entry = self._entries.pop(key, None) or []
        self._entries[key] = entry  # most recent last
        kept = None
        if completions is not None and self.max_tokens > 0:
            kept = [array("i", c) for c in completions]
            self._num_tokens += sum(len(c) for c in kept)
        entry.append(PromptVisit(list(lengths), kept))
        while len(entry) > self.max_visits:
            self._num_tokens -= entry.pop(0).num_tokens
        while len(self._entries) > self.max_prompts:
            _, old = self._entries.popitem(last=False)
            self._num_tokens -= sum(v.num_tokens for v in old)
        self._trim_tokens()

    def _trim_tokens(self) -> None:
        """Drop token ids, oldest visit of the least recently visited prompt first, until within budget."""
        entries = iter(self._entries.values())
        while self._num_tokens > self.max_tokens:
            for visit in next(entries):
                if visit.completions is not None and self._num_tokens > self.max_tokens:
                    self._num_tokens -= visit.num_tokens
                    visit.completions = None

    def clear(self) -> None:
        """Forget every prompt."""
        self._entries.clear()
        self._num_tokens = 0


def remember_visits(history: PromptHistory, groups: list[Group], tokens: bool = True) -> None:
    """Record one visit per group of a finished `generate` call (engine and simulator alike); `tokens=False`
    records the lengths only (the simulator has no real tokens)."""
    for g in groups:
        samples = sorted(g.samples, key=lambda s: s.sample_idx)
        history.record(g.prompt_ids, [s.num_generated for s in samples],
                       [s.output_ids for s in samples] if tokens else None)
