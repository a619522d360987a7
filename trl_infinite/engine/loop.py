"""The one drive loop of a rollout: schedule -> execute -> postprocess, until every sample has finished.

The engine runs it with the model-backed executor (`engine/executor.py`); the trace simulator runs it with an
executor that replays recorded lengths (`sim/replay.py`). Everything else (admission, block accounting, preemption,
divided rollout, the policies, the step and tail counts) is this loop and the `Scheduler`, shared by both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import ScheduledBatch, StepOutput
from trl_infinite.engine.sched.scheduler import Scheduler
from trl_infinite.engine.sched.sequence import Sequence

TAIL_FRACTION = 0.9  # decode steps taken once this fraction of the samples has finished count as tail steps


class Executor(Protocol):
    """Runs one `ScheduledBatch`: prefills the batch's prompts (first tokens), then one decode forward over
    `batch.decode` (if any). Must not change scheduler state: the tokens go back through `StepOutput`."""

    def lookahead(self, num_running: int) -> int:
        """Extra KV slots per running sample the next step may write (speculative drafts), 0 otherwise."""
        ...

    def launch(self, batch: ScheduledBatch) -> Callable[[], StepOutput]:
        """Start the step; the returned function waits for it. The loop runs the previous step's finish callbacks
        in between, so on a GPU they overlap the running decode step."""
        ...

    def after_step(self, batch: ScheduledBatch) -> None:
        """Called once the step's tokens were appended (and finished samples freed)."""
        ...

    def step_seconds(self, batch: ScheduledBatch, measured: float) -> float:
        """The decode step's duration the admission policy learns from (`batch_policy="sla"`): the measured wall
        time for the model, a step-time model's for the simulator."""
        ...


StepTimer = Callable[[ScheduledBatch, float], None]  # (batch, seconds from launch to completion), decode steps


def drive(
    scheduler: Scheduler,
    executor: Executor,
    stats: RolloutStats,
    on_finished: Callable[[Sequence], None] | None = None,
    on_decode_step: StepTimer | None = None,
) -> None:
    """Run the scheduler to completion. Counts `decode_steps` (steps with a decode forward) and
    `tail_decode_steps` in `stats`, and the host time of scheduling and postprocessing (`host_time_s`). Every
    finished sample goes to `on_finished` while the next step runs (at the latest when the loop ends), on this
    thread."""
    total = scheduler.num_samples
    clock = time.perf_counter
    done: list[Sequence] = []  # finished in the last step, not yet reported
    while scheduler.has_unfinished():
        t0 = clock()
        batch = scheduler.schedule(lookahead=executor.lookahead(len(scheduler.running)))
        start = clock()
        complete = executor.launch(batch)
        if on_finished is not None:
            for seq in done:
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
    if on_finished is not None:
        for seq in done:
            on_finished(seq)
