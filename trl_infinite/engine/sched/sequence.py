"""Requests of a rollout: a `Group` is one distinct prompt, a `Sequence` is one of its G samples.

Pure Python (no torch): the scheduler and the trace simulator share these classes.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # never started, or preempted (its KV was freed, its tokens are kept)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Group:
    """One distinct prompt and the bookkeeping of its shared prompt KV blocks."""

    group_id: int
    prompt_ids: list[int]
    num_generations: int
    prompt_blocks: list[int] = field(default_factory=list)  # empty while the prompt is not resident
    num_cached: int = 0  # leading prompt tokens found in the prefix cache when its blocks were last allocated
    samples: list[Sequence] = field(default_factory=list)  # its G samples, in sample order

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def resident(self) -> bool:
        return bool(self.prompt_blocks)

    # samples per status, kept by `Sequence.set_status` (the only way a status changes): O(1) for groups of any G
    status_counts: dict[SeqStatus, int] = field(default_factory=lambda: dict.fromkeys(SeqStatus, 0), init=False,
                                                 repr=False)

    @property
    def num_running(self) -> int:
        return self.status_counts[SeqStatus.RUNNING]

    @property
    def num_finished(self) -> int:
        return self.status_counts[SeqStatus.FINISHED]

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_generations

    def pending_first(self) -> list[Sequence]:
        """Samples still without a token: they take their first one from this prompt's prefill."""
        return [s for s in self.samples if not s.output_ids]


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample of a group. Its KV = the group's prompt blocks + its own completion blocks (`blocks`).

    The fields are the scheduler's; plug-ins (policies, predictors, drafters) keep their per-sample state in their
    own tables keyed by `seq_id`.

    Every sample gets its first token when its prompt is prefilled (all G at once, from the prompt's last logits),
    so a decoding sample always has at least one output token: the last one is the next decode input, at position
    `num_tokens - 1`, and its KV is not cached yet. `append_token` is the one stop rule.
    """

    group: Group
    sample_idx: int
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    forced_length: int | None = None  # simulator / benchmarks: the sample ends after exactly this many tokens
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)  # only when the call asks for them
    blocks: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    admit_order: int = -1
    num_preemptions: int = 0
    finish_reason: str | None = None
    chunk_start: int = 0  # output length when this sample was last (re)admitted: divided rollout counts from here
    host_blocks: int = 0  # divided rollout: leading blocks of its KV parked in host memory (0: none)

    def __post_init__(self) -> None:
        self.group.status_counts[self.status] += 1

    def set_status(self, status: SeqStatus) -> None:
        """Move to `status`, keeping the group's per-status counts."""
        counts = self.group.status_counts
        counts[self.status] -= 1
        counts[status] += 1
        self.status = status

    @property
    def group_id(self) -> int:
        return self.group.group_id

    @property
    def prompt_len(self) -> int:
        return self.group.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def length_limit(self) -> int:
        return self.max_new_tokens if self.forced_length is None else min(self.forced_length, self.max_new_tokens)

    def append_token(self, token: int, logprob: float = 0.0, raw_logprob: float | None = None) -> bool:
        """Append one sampled token; returns True when this token finishes the sample."""
        self.output_ids.append(int(token))
        self.logprobs.append(float(logprob))
        if raw_logprob is not None:
            self.raw_logprobs.append(float(raw_logprob))
        if self.forced_length is None and token in self.eos_token_ids:
            self.finish_reason = "stop"
            return True
        if len(self.output_ids) >= self.length_limit:
            self.finish_reason = "stop" if self.forced_length is not None else "length"
            return True
        return False


def make_group(group_id: int, prompt_ids: list[int], num_generations: int, max_new_tokens: int,
               eos_token_ids: frozenset[int] = frozenset(), forced_lengths: list[int] | None = None) -> Group:
    """A prompt and its G samples (`forced_lengths[j]` fixes sample j's length, EOS ignored)."""
    group = Group(group_id=group_id, prompt_ids=list(prompt_ids), num_generations=num_generations)
    for j in range(num_generations):
        forced = forced_lengths[j] if forced_lengths is not None else None
        group.samples.append(Sequence(group, j, max_new_tokens, eos_token_ids, forced_length=forced))
    return group
