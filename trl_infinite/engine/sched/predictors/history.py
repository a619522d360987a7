"""`length_predictor="history"`: a prompt's own past lengths, then (optionally) finished siblings and the prefix head,
then the mean of recent lengths.

GRPO revisits its prompts every epoch, and a prompt's completion lengths change slowly between visits (RhymeRL
2508.18588 §3; Seer uses the lengths of the same prompt's siblings). The chain, first source that answers wins:

1. **history**: the lengths the prompt produced on its last visits (`PromptHistory`, kept by the engine). They are an
   empirical distribution H, used per *sample rank*, not only through its mean: once r of the group's G samples
   have finished, the G - r still running are its longest, so a remaining sample is predicted by the mean of the
   upper (G - r) / G part of H, i.e. E_H[L | L >= Q_H(r / G), L > e], with e the tokens it already generated.
2. **siblings** (Seer's probe; only with `fallback` "siblings" or "siblings+prefix"): the mean of this call's
   finished siblings longer than e.
3. **prefix** (Infinite Sampling; only with `fallback` "prefix" or "siblings+prefix"): the regression head on the
   hidden state at completion token k (samples that no earlier link answers for probe their first k tokens).
4. **global**: the mean of recent finished lengths (all prompts) longer than e; `max_new_tokens` before any.

`fallback="none"` (the default, `history_fallback`) keeps links 1 and 4: on the recorded SmolLM2 traces
the sibling link made `lfs` lose to FIFO on first visits (the first siblings to finish are the short ones, and
within-prompt spread dominates), and the prefix link makes every unseen prompt's samples stop at token k+1 to probe
(see benchmarks/RESULTS.md). Every estimate is conditioned on the sample still running (L > e), so it grows as the
sample outlives its prediction. Scoring: the first prediction a sample was ranked with is compared with its true
length at finish, next to the constant-mean predictor (mean of the lengths finished before that moment), per source.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from trl_infinite.engine.sched.history import PromptHistory
from trl_infinite.engine.sched.predictors.base import ErrorStats, LengthPredictor, PrefixPredictor, register_predictor
from trl_infinite.engine.sched.sequence import Group, Sequence

if TYPE_CHECKING:
    from trl_infinite.engine.config.engine_config import SchedulingConfig

SOURCES = ("history", "siblings", "prefix", "global")


class SortedLengths:
    """Lengths sorted ascending with suffix sums: conditional means over a rank range in O(log n)."""

    def __init__(self, values) -> None:
        self.xs = sorted(values)
        self.suffix = [0] * (len(self.xs) + 1)  # suffix[i] = sum(xs[i:])
        for i in range(len(self.xs) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.xs[i]

    def __len__(self) -> int:
        return len(self.xs)

    def mean_above(self, elapsed: int, rank_fraction: float = 0.0) -> float | None:
        """Mean of the values above `elapsed` among the upper (1 - rank_fraction) part; None when there are none."""
        i = max(int(len(self.xs) * rank_fraction), bisect.bisect_right(self.xs, elapsed))
        n = len(self.xs) - i
        return self.suffix[i] / n if n > 0 else None


@dataclass
class FirstPrediction:
    """What a sample was first ranked with, and what the constant-mean predictor would have said then."""

    value: float
    source: str
    constant: float


@register_predictor("history")
class HistoryPredictor(LengthPredictor):
    """The chain of the module docstring. `history`: the engine's `PromptHistory` (a private one when None);
    `config.history_predictor`: `fallback` (the links between history and the global mean) and `mean_window`
    (recent finished lengths kept for the global mean); the prefix link is a `PrefixPredictor` of `config`."""

    def __init__(self, config: SchedulingConfig, history: PromptHistory | None = None):
        super().__init__()
        options = config.history_predictor
        fallback = options.fallback
        self.history = history if history is not None else PromptHistory()
        self.use_siblings = "siblings" in fallback
        self.prefix = PrefixPredictor(config)
        self.prefix_k = self.prefix.prefix_k if "prefix" in fallback else None
        self.wants_hidden = "prefix" in fallback
        self.recent: deque[int] = deque(maxlen=options.mean_window)
        self._recent_sorted: SortedLengths | None = None
        self._recent_sum = 0
        self._past: WeakKeyDictionary[Group, SortedLengths] = WeakKeyDictionary()
        self._done: WeakKeyDictionary[Group, list[int]] = WeakKeyDictionary()
        self._first: dict[int, FirstPrediction] = {}  # seq_id -> first prediction (side table, popped at finish)
        self.source_scores: dict[str, ErrorStats] = {s: ErrorStats() for s in SOURCES}
        self.baseline = ErrorStats()  # the constant-mean predictor on the same samples

    def begin_call(self, groups: list[Group]) -> None:
        self.prefix.begin_call(groups)
        self._past.clear()
        self._done.clear()

    def end_call(self) -> None:
        super().end_call()
        self.prefix.end_call()
        self._first.clear()
        self._past.clear()
        self._done.clear()
        self.baseline.end_call()
        for scores in self.source_scores.values():
            scores.end_call()

    def _past_lengths(self, group: Group) -> SortedLengths:
        past = self._past.get(group)
        if past is None:
            past = self._past[group] = SortedLengths(self.history.lengths(group.prompt_ids))
        return past

    def predict_with_source(self, seq: Sequence) -> tuple[float | None, str]:
        """(predicted total length, source); (None, "global") when nothing is known yet."""
        e = seq.num_generated
        group = seq.group
        done = self._done.get(group, [])
        past = self._past_lengths(group)
        if len(past):
            pred = past.mean_above(e, len(done) / group.num_generations)  # rank r = finished siblings
            if pred is not None:
                return pred, "history"
        longer = [n for n in done if n > e] if self.use_siblings else []
        if longer:
            return sum(longer) / len(longer), "siblings"
        pred = self.prefix.predict(seq) if self.prefix_k is not None else None
        if pred is not None and pred > e:
            return pred, "prefix"
        if self._recent_sorted is None:
            self._recent_sorted = SortedLengths(self.recent)
        return self._recent_sorted.mean_above(e), "global"

    def predict(self, seq: Sequence) -> float | None:
        pred, source = self.predict_with_source(seq)
        return pred if source != "global" else None

    def estimate(self, seq: Sequence) -> float:
        pred, source = self.predict_with_source(seq)  # moves with e and with finished siblings: never cached
        value = float(seq.max_new_tokens) if pred is None else min(float(seq.max_new_tokens), pred)
        if seq.seq_id not in self._first:
            constant = self._recent_sum / len(self.recent) if self.recent else float(seq.max_new_tokens)
            self._first[seq.seq_id] = FirstPrediction(value, source, constant)
        return max(float(seq.num_generated), value)

    def has_estimate(self, seq: Sequence) -> bool:
        return self.predict_with_source(seq)[1] != "global"

    def longest_known(self, seq: Sequence) -> float | None:
        """The longest of the prompt's past lengths and this call's finished siblings."""
        past, done = self._past_lengths(seq.group), self._done.get(seq.group, [])
        known = ([past.xs[-1]] if len(past) else []) + done
        return float(max(known)) if known else None

    def observe_hidden(self, seq: Sequence, hidden) -> None:
        self.prefix.observe_hidden(seq, hidden)

    def needs_prefix(self, seq: Sequence) -> bool:
        """With the prefix link, only samples that no earlier link answers for probe the prefix."""
        return self.prefix_k is not None and self.predict_with_source(seq)[1] in ("prefix", "global")

    def observe(self, seq: Sequence) -> None:
        n = seq.num_generated
        first = self._first.pop(seq.seq_id, None)
        if first is not None:
            self.scores.add(abs(first.value - n))
            self.source_scores[first.source].add(abs(first.value - n))
            self.baseline.add(abs(first.constant - n))
        if self.prefix_k is not None:
            self.prefix.observe(seq)
        self._done.setdefault(seq.group, []).append(n)
        if len(self.recent) == self.recent.maxlen:
            self._recent_sum -= self.recent[0]
        self.recent.append(n)
        self._recent_sum += n
        self._recent_sorted = None

    @property
    def baseline_mae(self) -> float | None:
        """MAE of the constant-mean predictor on the same samples, at the same moments (all calls)."""
        return self.baseline.mae

    def mae_by_source(self) -> dict[str, tuple[float, int]]:
        """{source: (MAE, samples)} of the first predictions, per chain link that made them (all calls)."""
        return {s: (e.mae, e.count) for s, e in self.source_scores.items() if e.count}
