"""Replay length traces through exactly the engine's rollout call (`engine/call.py`: sampling mode, scheduler,
policies, drive loop) with a trace executor.

The executor plays the model: each prefilled prompt gives every sample of its group its first token, each decode row
gets one token per step, and a sample ends after its traced length (`forced_length`); a decode step with b rows
takes `step_ms[0] + step_ms[1] * b` milliseconds (what `batch_policy="sla"` learns from). Everything else is the
engine's code, built from the same `EngineConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl_infinite.engine.call import ExecutorFactory, RolloutCall, call_blocks, sampling_mode
from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import ScheduledBatch, StepOutput
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for, pool_size
from trl_infinite.engine.sched.history import PromptHistory, remember_visits
from trl_infinite.engine.sched.predictors.base import LengthPredictor, build_predictor
from trl_infinite.engine.sched.prefix_cache import PrefixCache
from trl_infinite.engine.sched.sequence import Group, make_group
from trl_infinite.sim.traces import TraceRecord


@dataclass(frozen=True)
class SimConfig:
    """A simulated run: the engine's `EngineConfig` (the same sampling mode, scheduler, batch policy, predictor,
    history, block size and KV budget) plus the trace options. Without `kv_cache_tokens` the KV budget of a call is
    its prompts plus `max_active_sequences` completions of the longest length (every completion in a mode that runs
    them all in one round, `full_group`): a pool that never binds a g-slot schedule."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    prompts_per_call: int = 1  # B: prompts per `generate` call (the paper: 1)
    max_new_tokens: int | None = None  # None: the trace's own
    step_ms: tuple[float, float] = (10.0, 0.1)  # decode step time (ms) = step_ms[0] + step_ms[1] * rows

    def __post_init__(self) -> None:
        if not isinstance(self.prompts_per_call, int) or self.prompts_per_call < 1:
            raise ValueError(f"`prompts_per_call` must be an integer >= 1, got {self.prompts_per_call!r}.")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise ValueError(f"`max_new_tokens` must be an integer >= 1 or None, got {self.max_new_tokens!r}.")
        if len(self.step_ms) != 2 or not all(math.isfinite(x) and x >= 0 for x in self.step_ms):
            raise ValueError(f"`step_ms` must be two finite numbers >= 0 (ms per step, per row), got {self.step_ms!r}.")


@dataclass
class SimResult:
    """One `RolloutStats` per simulated call, with the call's epoch and `oracle_bound`; totals are computed from
    them (`total`)."""

    calls: list[RolloutStats] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    bounds: list[int] = field(default_factory=list)
    lengths_preserved: bool = True

    def total(self, epochs: set[int] | None = None) -> RolloutStats:
        """Totals over the calls of `epochs` (all calls when None), e.g. the second epoch, scheduled with the first
        one's history."""
        return RolloutStats.total([c for c, e in zip(self.calls, self.epochs) if epochs is None or e in epochs])

    def bound(self, epochs: set[int] | None = None) -> int:
        return sum(b for b, e in zip(self.bounds, self.epochs) if epochs is None or e in epochs)


def oracle_bound(lengths: list[int], slots: int | None) -> int:
    """Lower bound on the decode steps of `slots` continuous slots: max(longest sample, total work / slots)."""
    costs = [x - 1 for x in lengths]  # the first token comes from the prompt's prefill, each further one a row
    return max(max(costs), -(-sum(costs) // (slots or len(costs))))


class TraceExecutor:
    """Plays the model for the drive loop. `features[(prompt_index, sample_idx)]` (optional) is the hidden state at
    completion token k, handed to `predictor.observe_hidden` exactly when the engine would (the row's input is
    token k); `predictor` None: nothing is delivered. `step_ms`: the decode step time model."""

    def __init__(self, predictor: LengthPredictor | None, features: dict | None, prompt_index: dict[int, int],
                 step_ms: tuple[float, float] = SimConfig.step_ms):
        self.predictor = predictor
        self.prefix_k = predictor.prefix_k if predictor is not None else None
        self.features = features or {}
        self.prompt_index = prompt_index  # group_id -> the trace's prompt index
        self.step_ms = step_ms

    def lookahead(self, num_running: int) -> int:
        return 0

    def launch(self, batch: ScheduledBatch):
        out = self.run(batch)
        return lambda: out

    def run(self, batch: ScheduledBatch) -> StepOutput:
        out = StepOutput()
        for group in batch.prefill_groups:
            n = len(group.pending_first())
            out.first_tokens.append([0] * n)
            out.first_logprobs.append([0.0] * n)
        for seq in batch.decode:
            if seq.num_generated == self.prefix_k:
                feat = self.features.get((self.prompt_index[seq.group_id], seq.sample_idx))
                if feat is not None:
                    self.predictor.observe_hidden(seq, feat)
        out.tokens = [[0] for _ in batch.decode]
        out.logprobs = [[0.0] for _ in batch.decode]
        return out

    def after_step(self, batch: ScheduledBatch) -> None:
        pass

    def step_seconds(self, batch: ScheduledBatch, measured: float) -> float:
        return (self.step_ms[0] + self.step_ms[1] * len(batch.decode)) / 1e3

    def end_call(self, stats: RolloutStats) -> None:
        """After the call: what the executor adds to its stats (nothing here)."""


def _prompt_ids(rec: TraceRecord) -> list[int]:
    """The recorded prompt ids, else a stand-in unique to the prompt index (the history is keyed by prompt ids)."""
    if rec.prompt_ids is not None:
        return list(rec.prompt_ids)
    return [-1 - rec.prompt_index] + [0] * (rec.prompt_len - 1)


def _length_regressor(model):
    """`length_predictor` given as a sequence-classification model: run as the engine runs it (torch is imported
    only here, where such a model, and so torch, is already loaded)."""
    from trl_infinite.engine.runner.length_model import length_regressor

    return length_regressor(model)


def _calls(records: list[TraceRecord], per_call: int) -> list[list[TraceRecord]]:
    """Consecutive records, `per_call` at a time, never mixing two epochs in one call."""
    calls: list[list[TraceRecord]] = []
    for rec in records:
        if calls and len(calls[-1]) < per_call and calls[-1][-1].epoch == rec.epoch:
            calls[-1].append(rec)
        else:
            calls.append([rec])
    return calls


def _requests(records: list[TraceRecord], max_new: int) -> list[Group]:
    return [make_group(i, _prompt_ids(rec), len(rec.lengths), max_new, forced_lengths=rec.lengths)
            for i, rec in enumerate(records)]


def _budget_blocks(config: EngineConfig, groups: list[Group], max_new: int) -> int:
    """The call's KV budget in blocks (see `SimConfig`); with `kv_cache_tokens`, the engine's (one block of it is
    the null block of padded decode rows)."""
    bs, tokens = config.block_size, config.kv_cache.tokens
    if tokens is not None:
        return tokens // bs - 1
    scheduling, mode = config.scheduling, sampling_mode(config)
    samples = sum(g.num_generations for g in groups)
    one_round = mode.rounds and mode.slot_limit is None  # every sample in one round
    live = samples if one_round else scheduling.max_active_sequences or samples
    return sum(blocks_for(g.prompt_len, bs) for g in groups) + live * blocks_for(max_new, bs)


def _executors(custom: TraceExecutor | None, features: dict | None, prompt_index: dict[int, int],
               step_ms: tuple[float, float]) -> ExecutorFactory:
    """The simulator's executor factory (`call.py`): `custom`, else a `TraceExecutor` delivering hidden states to
    the call's predictor (`RolloutCall.hidden_predictor`)."""
    return lambda call: custom or TraceExecutor(call.hidden_predictor, features, prompt_index, step_ms)


def simulate(records: list[TraceRecord], config: SimConfig, predictor: LengthPredictor | None = None,
             features: dict | None = None, history: PromptHistory | None = None, executor_factory=None) -> SimResult:
    """Run the trace call by call (B prompts each, one epoch per call), each call built as the engine builds it
    (`RolloutCall`); the predictor and the per-prompt history persist across calls, as in training (a trace that
    revisits prompts feeds later epochs the earlier ones). `executor_factory(chunk, index)` (records of the call,
    group_id -> prompt index) builds another `TraceExecutor` (`sim/speculative.py`); its `lookahead(0)` is
    reserved per sample and its `end_call(stats)` runs after the call."""
    engine = config.engine
    history = history if history is not None else PromptHistory(engine.history)
    predictor = predictor or build_predictor(engine.scheduling, history, model_fn=_length_regressor)
    out = SimResult()
    for chunk in _calls(records, config.prompts_per_call):
        max_new = config.max_new_tokens or max(r.max_new_tokens or max(r.lengths) for r in chunk)
        groups = _requests(chunk, max_new)
        index = {g.group_id: rec.prompt_index for g, rec in zip(groups, chunk)}
        custom = executor_factory(chunk, index) if executor_factory is not None else None
        lookahead = custom.lookahead(0) if custom is not None else 0
        need = pool_size(call_blocks(engine, groups, max_new, lookahead))
        blocks = max(1, min(need, _budget_blocks(engine, groups, max_new + lookahead)))
        cache = PrefixCache(engine.block_size) if engine.prefix_cache else None  # the engine's, within one call
        call = RolloutCall.build(engine, groups, BlockAllocator(blocks, engine.block_size, cache), predictor,
                                 _executors(custom, features, index, config.step_ms))
        stats = call.run()
        call.executor.end_call(stats)
        seqs = [s for g in groups for s in g.samples]
        out.calls.append(stats)
        out.epochs.append(chunk[0].epoch)
        out.bounds.append(oracle_bound([s.num_generated for s in seqs], engine.scheduling.max_active_sequences))
        out.lengths_preserved &= all(s.num_generated == s.length_limit for s in seqs)
        predictor.end_call()
        remember_visits(history, groups, tokens=False)
    return out
