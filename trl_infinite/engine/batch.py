"""What passes between the scheduler and an executor each step (`ScheduledBatch` out, `StepOutput` back), and the
scheduler's counters. Pure Python: the engine and the trace simulator share them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Group, Sequence


@dataclass
class ScheduledBatch:
    """One step of work. `decode` holds every running sample that has a token to feed (all but those whose prompt
    is prefilled in this very step: they get their first token from it and decode from the next step)."""

    prefill_groups: list[Group] = field(default_factory=list)  # prompts to prefill (blocks already allocated)
    recompute: list[Sequence] = field(default_factory=list)  # re-run prompt + output_ids[:-1] into the cache
    decode: list[Sequence] = field(default_factory=list)
    grown: list[Sequence] = field(default_factory=list)  # running samples whose own block list grew in this step
    lookahead: int = 0  # extra KV slots reserved per sample (speculative drafts)
    # divided rollout's host tier: copy these blocks' KV out to host (before anything runs), then back in
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)

    @property
    def rebuilt(self) -> list[Sequence]:
        """Samples whose KV this step puts into new blocks (recompute, copy back from the host tier)."""
        return [*self.recompute, *(seq for seq, _ in self.swap_in)]


@dataclass
class StepOutput:
    """What an executor returns for one `ScheduledBatch`.

    `first_tokens[i]` / `first_logprobs[i]`: the first token of every sample of `batch.prefill_groups[i]` that has
    none yet (in sample order); `tokens[r]` / `logprobs[r]`: the tokens emitted by decode row r (`batch.decode`
    order; several with speculative decoding; the scheduler keeps them up to the sample's end)."""

    first_tokens: list[list[int]] = field(default_factory=list)
    first_logprobs: list[list[float]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    prompt_evictions: int = 0
    peak_running: int = 0
    running_sum: int = 0
    steps: int = 0
    parks: int = 0  # divided rollout: a sample returned to the queue with its KV kept
    offloaded_blocks: int = 0  # blocks of parked samples moved to the host tier (and later back, no re-prefill)

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0
