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
    num_finished: int = 0
    num_running: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def resident(self) -> bool:
        return bool(self.prompt_blocks)

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_generations


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample of a group. Its KV = the group's prompt blocks + its own completion blocks (`blocks`).

    Invariant while RUNNING: the KV of `output_ids[:num_cached]` is in `blocks`; the last output token (if any) is
    the next decode input and is not cached yet.
    """

    group: Group
    sample_idx: int
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    forced_length: int | None = None  # simulator / benchmarks: the sample ends after exactly this many tokens
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: SeqStatus = SeqStatus.WAITING
    admit_order: int = -1
    num_preemptions: int = 0
    finish_reason: str | None = None
    chunk_start: int = 0  # output length when this sample was last (re)admitted: divided rollout counts from here
    extra: dict = field(default_factory=dict)  # per-policy scratch (predictions, drafter state, ...)

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
    def is_fresh(self) -> bool:
        """Not started yet: its first token is sampled from the group's prompt logits."""
        return not self.output_ids

    @property
    def length_limit(self) -> int:
        return self.max_new_tokens if self.forced_length is None else min(self.forced_length, self.max_new_tokens)

    def ends_with_first(self, token: int) -> bool:
        """Whether `token`, as this fresh sample's first completion token, would finish it (no decode row needed)."""
        if self.forced_length is None and token in self.eos_token_ids:
            return True
        return self.length_limit <= 1

    def append_token(self, token: int, logprob: float = 0.0) -> bool:
        """Append one sampled token; returns True when this token finishes the sample."""
        self.output_ids.append(int(token))
        self.logprobs.append(float(logprob))
        if self.forced_length is None and token in self.eos_token_ids:
            self.finish_reason = "stop"
            return True
        if len(self.output_ids) >= self.length_limit:
            self.finish_reason = "stop" if self.forced_length is not None else "length"
            return True
        return False
