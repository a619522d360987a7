"""One rollout call, built the same way by the engine and the simulator: they differ only by the executor factory.

    need = call_blocks(config, groups, max_new, lookahead)      # the KV blocks the call can use
    allocator = ...  # the engine: its pool opened with `pool_size(need)` blocks (never above the budget);
                     # the simulator: a `BlockAllocator` of the same size
    call = RolloutCall.build(config, groups, allocator, predictor, make_executor)
    stats = call.run(...)                                        # the drive loop (`loop.py`)

`build` makes the call's sampling mode, ordering and admission policies (by name, from `config.scheduling`), its
scheduler and its executor (`make_executor(call)`: the engine's model executor, `engine.py`; the simulator's trace
replayer, `sim/replay.py`); `run` drives it and fills the call's `RolloutStats`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.config.registry import BATCH_POLICIES, SAMPLING_MODES, SCHEDULERS
from trl_infinite.engine.loop import Executor, StepTimer, drive
from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for
from trl_infinite.engine.sched.predictors.base import LengthPredictor
from trl_infinite.engine.sched.scheduler import Scheduler
from trl_infinite.engine.sched.sequence import Group, Sequence
from trl_infinite.engine.sched.slot_modes import SamplingMode

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
        """Drive the call to its end; the stats then also hold the block and prediction counters."""
        drive(self.scheduler, self.executor, self.stats, on_finished, on_decode_step)
        allocator, stats = self.scheduler.allocator, self.stats
        stats.generated_tokens = sum(s.num_generated for s in self.scheduler.finished)
        stats.peak_kv_blocks = allocator.peak_used
        stats.num_kv_blocks = allocator.num_blocks
        stats.kv_utilization = allocator.mean_utilization
        stats.prediction_errors = list(self.predictor.scores.call)
        baseline = getattr(self.predictor, "baseline", None)  # the constant-mean predictor's (history chain)
        stats.constant_errors = list(baseline.call) if baseline is not None else []
        return stats
