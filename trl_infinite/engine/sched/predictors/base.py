"""Completion-length predictors behind one interface (pure Python + numpy; no torch on the scheduling path).

`predict(seq)` returns the estimated TOTAL completion length of a sample (tokens), or None when the predictor has
nothing to say yet. `observe(seq)` is called when a sample finishes (its true length is known) so online predictors
learn. Every prediction that was used is scored against the true length at finish: `mae` is the mean absolute error.

- "oracle": the true length (`seq.forced_length`, capped at `max_new_tokens`); benchmarks and the simulator only.
- "group" (Seer): mean length of the finished siblings of the same prompt; the conservative `max_new_tokens` until one
  has finished.
- "prefix" (Infinite Sampling §4): after the first k completion tokens, a regression head on a feature vector of the
  prompt + prefix. The default features are the policy model's own last hidden state at completion token k (the
  engine / simulator deliver it through `observe_hidden`); the head is an online ridge regression on log-length,
  refitted from the samples that finished, its penalty chosen by leave-one-prompt-out error (`ridge.py`). A user
  callable `fn(prompt_ids, prefix_ids) -> float` or a Hugging Face sequence-classification model (one regression
  logit) can replace the head. The k tokens are kept: decoding resumes at k+1. Before the head has seen `min_train`
  finished samples it falls back to the "group" estimate.
- "history" (`history.py`): a prompt seen in earlier calls is predicted from its own past lengths, else
  from finished siblings, else the prefix head, else the global mean (the default chain).
- "none": no estimate (length-aware policies then see every sample as `max_new_tokens` long).

Predictors are built by `build_predictor`, one per engine, so they learn across calls; `begin_call(groups)` tells
them a new `generate` call starts (group ids restart at 0 every call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from trl_infinite.engine.config.registry import PREDICTORS, register_predictor
from trl_infinite.engine.sched.history import PromptHistory
from trl_infinite.engine.sched.predictors.ridge import OnlineRidge
from trl_infinite.engine.sched.sequence import Group, Sequence

if TYPE_CHECKING:
    from trl_infinite.engine.config.engine_config import SchedulingConfig

ModelFn = Callable[[object], Callable[[list[int], list[int]], float]]  # a model -> its length function


class ErrorStats:
    """Absolute errors of scored predictions in bounded memory: a running count and sum over every call (`mae`),
    and the errors of the current call only (`call`, emptied by `end_call`)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.call: list[float] = []

    def add(self, error: float) -> None:
        self.count += 1
        self.total += error
        self.call.append(error)

    def end_call(self) -> None:
        self.call = []

    @property
    def mae(self) -> float | None:
        return self.total / self.count if self.count else None


class LengthPredictor:
    """Base class. `prefix_k` is the number of completion tokens a sample must have before `predict` can answer
    (None = it answers from the start); `wants_hidden` asks the executor for the hidden state at token k.

    A predictor lives as long as its engine, so everything it keeps per sample or per call is dropped by
    `end_call` (the engine calls it when a `generate` call ends, also when the call was interrupted), and its
    scores are running sums (`ErrorStats`): its memory does not grow with the number of calls."""

    name = "base"
    prefix_k: int | None = None
    wants_hidden: bool = False

    def __init__(self, config: SchedulingConfig | None = None, history: PromptHistory | None = None) -> None:
        """`config` (the `SchedulingConfig`) and `history` (the engine's) are what a predictor built by name may
        read; the base class needs neither."""
        self.scores = ErrorStats()
        # seq_id -> the prediction the sample is ranked with (side table, popped when the sample finishes)
        self.predictions: dict[int, float] = {}

    def begin_call(self, groups: list[Group]) -> None:
        """A `generate` call with these prompt groups starts (called by the length-aware policies)."""

    def end_call(self) -> None:
        """A `generate` call ended (finished or interrupted): drop its per-sample and per-call tables."""
        self.predictions.clear()
        self.scores.end_call()

    def predict(self, seq: Sequence) -> float | None:
        return None

    def longest_known(self, seq: Sequence) -> float | None:
        """The longest completion known for the sample's prompt (None: nothing known)."""
        return None

    def observe_hidden(self, seq: Sequence, hidden) -> None:
        """The policy's last hidden state (numpy [hidden_size]) at the input of completion token `prefix_k`, delivered
        by the executor (the simulator: a recorded one) when `wants_hidden`."""

    def needs_prefix(self, seq: Sequence) -> bool:
        """Whether the sample should decode its first `prefix_k` tokens before it is ranked (a probe)."""
        return self.prefix_k is not None

    def observe(self, seq: Sequence) -> None:
        """A sample finished: score the prediction it was scheduled with, then learn from it."""
        pred = self.predictions.pop(seq.seq_id, None)
        if pred is not None:
            self.scores.add(abs(pred - seq.num_generated))

    @property
    def mae(self) -> float | None:
        """Mean absolute error of every prediction scored so far (all calls)."""
        return self.scores.mae

    def estimate(self, seq: Sequence) -> float:
        """The cached prediction (computed once it is available), else `max_new_tokens` (conservative)."""
        pred = self.predictions.get(seq.seq_id)
        if pred is None:
            new = self.predict(seq)
            if new is not None:
                pred = self.predictions[seq.seq_id] = float(new)
        return max(float(seq.num_generated), pred if pred is not None else float(seq.max_new_tokens))

    def has_estimate(self, seq: Sequence) -> bool:
        self.estimate(seq)
        return seq.seq_id in self.predictions


@register_predictor("none")
class NoPredictor(LengthPredictor):
    pass


@register_predictor("oracle")
class OraclePredictor(LengthPredictor):
    def predict(self, seq: Sequence) -> float | None:
        return None if seq.forced_length is None else float(seq.length_limit)


@register_predictor("group")
class GroupPredictor(LengthPredictor):
    """Seer's group-level estimate L_g: mean finished sibling length (updated as siblings finish)."""

    def __init__(self, config: SchedulingConfig | None = None, history: PromptHistory | None = None) -> None:
        super().__init__()
        self.finished: dict[int, list[int]] = {}

    def begin_call(self, groups: list[Group]) -> None:
        self.finished.clear()  # group ids restart every call: siblings are those of this call only

    def end_call(self) -> None:
        super().end_call()
        self.finished.clear()

    def predict(self, seq: Sequence) -> float | None:
        done = self.finished.get(seq.group_id)
        return sum(done) / len(done) if done else None

    def estimate(self, seq: Sequence) -> float:
        new = self.predict(seq)  # L_g moves as siblings finish: never cached
        if new is not None:
            self.predictions[seq.seq_id] = new
        return max(float(seq.num_generated), new if new is not None else float(seq.max_new_tokens))

    def longest_known(self, seq: Sequence) -> float | None:
        done = self.finished.get(seq.group_id)
        return float(max(done)) if done else None

    def observe(self, seq: Sequence) -> None:
        super().observe(seq)
        self.finished.setdefault(seq.group_id, []).append(seq.num_generated)


@register_predictor("prefix")
class PrefixPredictor(LengthPredictor):
    """Length from the prompt + first k completion tokens (see module docstring); options from
    `config.prefix_predictor`. `fn`: a user's predictor in place of the head (`length_predictor` given as a callable
    or a sequence-classification model, made a callable by `model_fn`)."""

    wants_hidden = True

    def __init__(self, config: SchedulingConfig, history: PromptHistory | None = None, fn: Callable | None = None,
                 model_fn: ModelFn | None = None):
        super().__init__()
        options = config.prefix_predictor
        self.prefix_k = options.k
        self.fn = _wrap_user_predictor(fn, model_fn) if fn is not None else None
        self.wants_hidden = fn is None
        self.head = OnlineRidge(options.l2)
        self.min_train = options.min_train
        self.fallback = GroupPredictor()
        self.features: dict = {}  # seq_id -> hidden state at token k (numpy), popped when the sample finishes

    def begin_call(self, groups: list[Group]) -> None:
        self.fallback.begin_call(groups)

    def end_call(self) -> None:
        super().end_call()
        self.fallback.end_call()
        self.features.clear()

    def predict(self, seq: Sequence) -> float | None:
        if seq.num_generated < self.prefix_k:
            return None
        if self.fn is not None:
            return self.fn(list(seq.group.prompt_ids), list(seq.output_ids[: self.prefix_k]))
        feat = self.features.get(seq.seq_id)
        if feat is None or len(self.head) < self.min_train:
            return None
        return float(min(seq.max_new_tokens, max(self.prefix_k, math.exp(self.head(feat)))))

    def estimate(self, seq: Sequence) -> float:
        est = super().estimate(seq)
        if seq.seq_id not in self.predictions:
            est = self.fallback.estimate(seq)  # the fallback keeps its own table
        return est

    def observe_hidden(self, seq: Sequence, hidden) -> None:
        self.features[seq.seq_id] = hidden

    def observe(self, seq: Sequence) -> None:
        super().observe(seq)
        self.fallback.observe(seq)
        feat = self.features.pop(seq.seq_id, None)
        if self.fn is None and feat is not None:
            # group = the prompt: the head's penalty is chosen by its error on prompts it has not seen
            self.head.add(feat, math.log(max(1, seq.num_generated)), group=hash(tuple(seq.group.prompt_ids)))


def _wrap_user_predictor(fn, model_fn: ModelFn | None) -> Callable[[list[int], list[int]], float]:
    """A callable `fn(prompt_ids, prefix_ids) -> length`, or an HF sequence-classification model (regression), run
    through `model_fn` (the engine's `runner.length_model.length_regressor`: this package imports no torch)."""
    if hasattr(fn, "config") and hasattr(fn, "forward"):
        if model_fn is None:
            raise ValueError("`length_predictor` as a sequence-classification model runs only in the engine (which "
                             "passes the function that runs it); give a callable (prompt_ids, prefix_ids) -> length.")
        return model_fn(fn)
    if not callable(fn):
        raise ValueError("`length_predictor` must be a name, a callable (prompt_ids, prefix_ids) -> length, or a "
                         "sequence-classification model.")
    return fn


def build_predictor(config: SchedulingConfig, history: PromptHistory | None = None,
                    model_fn: ModelFn | None = None) -> LengthPredictor:
    """The predictor `config.length_predictor` names (a registered name), is (a `LengthPredictor`), or wraps (a
    callable or a sequence-classification model, in place of the prefix head; `model_fn(model)` makes the model a
    callable). One per engine or simulated run: it keeps learning across calls and reads the engine's per-prompt
    `history`."""
    spec = config.length_predictor
    if isinstance(spec, LengthPredictor):
        return spec
    if isinstance(spec, str):
        return PREDICTORS.build(spec, config, history)
    return PrefixPredictor(config, history, fn=spec, model_fn=model_fn)
