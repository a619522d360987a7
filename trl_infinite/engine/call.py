"""One rollout call, built the same way by the engine and the simulator: they differ only by the executor factory.

    need = call_blocks(config, groups, max_new, lookahead)      # the KV blocks the call can use
    allocator = ...  # the engine: its pool opened with `pool_size(need)` blocks (never above the budget);
                     # the simulator: a `BlockAllocator` of the same size
    call = RolloutCall.build(config, groups, allocator, predictor, make_executor)
    stats = call.run(...)                                        # the one drive loop

`build` makes the call's sampling mode, ordering and admission policies (by name, from `config.scheduling`), its
scheduler and its executor (`make_executor(call)`: the engine's model executor, `engine.py`; the simulator's trace
replayer, `sim/replay.py`); `run` drives it and fills the call's `RolloutStats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.registry import BATCH_POLICIES, SAMPLING_MODES, SCHEDULERS
from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import ScheduledBatch, StepOutput
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for
from trl_infinite.engine.sched.predictors.base import LengthPredictor
from trl_infinite.engine.sched.scheduler import Scheduler
from trl_infinite.engine.sched.sequence import Group, Sequence
from trl_infinite.engine.sched.slot_modes import SamplingMode

TAIL_FRACTION = 0.9  # decode steps taken once this fraction of the samples has finished count as tail steps


class Executor(Protocol):
    """Runs one `ScheduledBatch`: prefills the batch's prompts (first tokens), then one decode forward over
    `batch.decode` (if any). Must not change scheduler state: the tokens go back through `StepOutput`."""

    def lookahead(self, num_running: int) -> int:
        """Extra KV slots per running sample the next step may write (speculative drafts), 0 otherwise."""
        ...

    def launch(self, batch: ScheduledBatch) -> Callable[[], StepOutput]:
        """Carry out `batch.moves` (the KV moves the scheduler ordered: `KVCachePool.apply`) before the forward, then
        start the step; the returned function waits for it. The loop runs the previous step's finish callbacks
        in between, so on a GPU they overlap the running decode step."""
        ...

    def after_step(self, batch: ScheduledBatch) -> None:
        """Called once the step's tokens were appended (and finished samples freed): carry out `batch.moves_after`
        (completion caching's copies, ordered by `postprocess`)."""
        ...

    def step_seconds(self, batch: ScheduledBatch, measured: float) -> float:
        """The decode step's duration the admission policy learns from (`batch_policy="sla"`): the measured wall
        time for the model, a step-time model's for the simulator."""
        ...


StepTimer = Callable[[ScheduledBatch, float], None]  # (batch, seconds from launch to completion), decode steps


ExecutorFactory = Callable[["RolloutCall"], Executor]  # what the engine's and the simulator's calls differ by


def sampling_mode(config: EngineConfig) -> SamplingMode:
    """The sampling mode `config` names (built for each call, like the call's other plug-ins)."""
    scheduling = config.scheduling
    return SAMPLING_MODES.build(scheduling.sampling_mode, scheduling)


def call_blocks(config: EngineConfig, groups: list[Group], max_new: int, lookahead: int = 0) -> int:
    """Most KV blocks the call can hold at once: every prompt's blocks, and the completion blocks (up to `max_new`
    tokens plus `lookahead` draft slots) of every sample that can be live together (the sampling mode's slots, or
    all samples where none bound them or divided rollout parks samples with their KV)."""
    scheduling, bs = config.scheduling, config.block_size
    live = sampling_mode(config).live_samples(sum(g.num_generations for g in groups), parks=scheduling.chunk_tokens is not None)
    return sum(blocks_for(g.prompt_len, bs) for g in groups) + live * blocks_for(max_new + lookahead, bs)


@dataclass
class RolloutCall:
    """One `generate` call: its scheduling side and its executor (see the module docstring). `hidden_predictor`: the
    predictor the executor delivers the hidden state at completion token k to (None: the call's policy wants none)."""

    mode: SamplingMode
    scheduler: Scheduler
    predictor: LengthPredictor
    hidden_predictor: LengthPredictor | None
    stats: RolloutStats
    executor: Executor | None = None

    @classmethod
    def build(cls, config: EngineConfig, groups: list[Group], allocator: BlockAllocator, predictor: LengthPredictor,
              make_executor: ExecutorFactory, cache_completions: bool = False) -> RolloutCall:
        """`make_executor(call)`: the call's executor, made once the rest of the call is built;
        `cache_completions`: the scheduler's completion caching (`Scheduler`); the allocator carries the prefix
        cache itself, if any."""
        scheduling = config.scheduling
        mode = sampling_mode(config)
        policy = SCHEDULERS.build(scheduling.scheduler, scheduling, predictor, mode.slot_limit)
        admission = BATCH_POLICIES.build(scheduling.batch_policy, scheduling)
        samples = [s for g in groups for s in g.samples]
        stats = RolloutStats(num_samples=len(samples))
        scheduler = Scheduler(allocator, policy, admission, mode, scheduling.chunk_tokens, stats, cache_completions)
        scheduler.submit(groups, samples)
        uses = getattr(policy, "predictor", None) is predictor and predictor.wants_hidden
        call = cls(mode, scheduler, predictor, predictor if uses else None, stats)
        call.executor = make_executor(call)
        return call

    def run(self, on_finished: Callable[[Sequence], None] | None = None,
            on_decode_step: StepTimer | None = None) -> RolloutStats:
        """The one drive loop: schedule -> execute -> postprocess until every sample has finished; then the stats
        also hold the block and prediction counters. Counts `decode_steps` (steps with a decode forward) and
        `tail_decode_steps`, and the host time of scheduling and postprocessing (`host_time_s`). Every finished
        sample goes to `on_finished` while the next step runs (at the latest when the loop ends), on this thread."""
        scheduler, executor, stats, clock = self.scheduler, self.executor, self.stats, time.perf_counter
        total = scheduler.num_samples
        done: list[Sequence] = []  # finished in the last step, not yet reported
        while scheduler.has_unfinished():
            t0 = clock()
            batch = scheduler.schedule(lookahead=executor.lookahead(len(scheduler.running)))
            start = clock()
            complete = executor.launch(batch)
            for seq in done if on_finished is not None else ():
                on_finished(seq)
            out = complete()
            seconds = clock() - start
            stats.host_time_s += start - t0
            if batch.decode:
                stats.decode_steps += 1
                if len(scheduler.finished) >= TAIL_FRACTION * total:
                    stats.tail_decode_steps += 1
                scheduler.admission.on_step_time(len(batch.decode), executor.step_seconds(batch, seconds))
                if on_decode_step is not None:
                    on_decode_step(batch, seconds)
            done_before = len(scheduler.finished)
            t0 = clock()
            scheduler.postprocess(batch, out)
            executor.after_step(batch)
            stats.host_time_s += clock() - t0
            done = scheduler.finished[done_before:]
        for seq in done if on_finished is not None else ():
            on_finished(seq)
        allocator = scheduler.allocator
        stats.generated_tokens = sum(s.num_generated for s in scheduler.finished)
        stats.peak_kv_blocks = allocator.peak_used
        stats.num_kv_blocks = allocator.num_blocks
        stats.kv_utilization = allocator.mean_utilization
        stats.prediction_errors = list(self.predictor.scores.call)
        baseline = getattr(self.predictor, "baseline", None)  # the constant-mean predictor's (history chain)
        stats.constant_errors = list(baseline.call) if baseline is not None else []
        return stats
