"""Streamed reward scoring (paper §3.4): completions are scored in chunks while the rest of the batch decodes.

The engine calls `on_sample_finished` from its drive loop, between decode steps, on the calling thread. A reward
function sees whole groups only (a group-relative reward, e.g. Kimi k1.5's length penalty, gets its whole-batch
value): a row waits until every row of its prompt group has finished, and once at least `chunk_size` rows of
complete groups wait they are scored right there (so `signal.alarm` timeouts and TRL's `accuracy_reward` work as
they do in `GRPOTrainer`), or, with `rollout_reward_executor="thread"`, on one background thread. With
`rollout_reward_chunks="batch"` (`REWARD_CHUNKS`) the chunk is the whole batch: one call, once every row finished.
Rows of a group that never finished are never scored here (TRL's call then scores the whole batch). How a chunk is
scored: `reward_scoring.py`.

TRL's own `_calculate_rewards` then runs once on the whole batch and reads these values: `InfiniteGRPOTrainer` wraps
each reward *function* in a `CachedRewardFunc` (reward models, and functions with the attribute
`reward_chunks = "batch"`, stay TRL's: they run once, on the whole batch, after the rollout). When every row was
already scored on exactly these completion ids, it returns those values and replays their `log_extra` columns in row
order; otherwise (no stream: tool calls, `rollout_func`, TRL's generation path, a direct call) it calls the function
itself. TRL keeps everything else: the None -> NaN rule, the length check, the all-None warning (its text, its
logger), the cross-process gather, the group normalisation.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from trl.trainer.utils import is_async_callable

REWARD_EXECUTORS = ("main_thread", "thread")
REWARD_CHUNKS = ("groups", "batch")  # what a streamed reward call holds: whole prompt groups, or the whole batch


@dataclass
class ChunkScores:
    """What scoring some rows gave: per reward-function index, the function's values (one per row, as returned);
    per function index and `log_extra` column, one value per row."""

    values: dict[int, list]
    extra: dict[int, dict[str, list]] = field(default_factory=dict)


# score(rows, completion ids of those rows) -> ChunkScores
ScoreFn = Callable[[list[int], list[list[int]]], ChunkScores]


class StreamingRewards:
    """Cached rewards of one batch's rows, scored in chunks of whole groups (at least `chunk_size` rows, but the
    last) as they finish. `group_sizes`: the rows of each prompt group, consecutive, in row order (default: one
    group per row)."""

    def __init__(self, num_rows: int, score: ScoreFn, chunk_size: int, executor: ThreadPoolExecutor | None = None,
                 group_sizes: list[int] | None = None):
        self.num_rows, self.score, self.chunk_size, self.executor = num_rows, score, max(1, chunk_size), executor
        sizes = group_sizes if group_sizes is not None else [1] * num_rows
        if sum(sizes) != num_rows or any(n < 1 for n in sizes):
            raise ValueError(f"`group_sizes` {sizes} do not partition the {num_rows} rows into groups.")
        self._group_of = [g for g, n in enumerate(sizes) for _ in range(n)]
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        self._group_rows = [range(a, a + n) for a, n in zip(starts, sizes)]
        self._missing = list(sizes)  # per group: rows not finished yet
        self.completion_ids: list[list[int] | None] = [None] * num_rows
        self.values: dict[int, dict[int, object]] = defaultdict(dict)  # func index -> row -> value
        self.extra: dict[int, dict[str, dict[int, object]]] = defaultdict(lambda: defaultdict(dict))
        self._pending: list[int] = []
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def add(self, row: int, completion_ids: list[int]) -> None:
        """One finished row (called from the engine's drive loop); once its group is complete, its rows wait, and a
        chunk is scored once `chunk_size` rows wait."""
        self._raise_failed()
        if self.completion_ids[row] is not None:
            raise RuntimeError(f"row {row} finished twice")
        self.completion_ids[row] = list(completion_ids)
        g = self._group_of[row]
        self._missing[g] -= 1
        if self._missing[g]:
            return
        self._pending.extend(self._group_rows[g])
        if len(self._pending) >= self.chunk_size:
            self.flush()

    def flush(self) -> None:
        """Scores the waiting rows (whole groups, in row order) now, or hands them to the background thread."""
        if not self._pending:
            return
        rows, self._pending = sorted(self._pending), []
        if self.executor is None:
            self._score_chunk(rows)
        else:
            self._futures.append(self.executor.submit(self._score_chunk, rows))

    def _score_chunk(self, rows: list[int]) -> None:
        scores = self.score(rows, [self.completion_ids[r] for r in rows])
        with self._lock:
            for f, values in scores.values.items():
                self.values[f].update(zip(rows, values))
            for f, columns in scores.extra.items():
                for column, values in columns.items():
                    self.extra[f][column].update(zip(rows, values))

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def wait(self) -> None:
        """Scores what is still waiting and waits for every chunk; re-raises the first reward error."""
        self.flush()
        for f in self._futures:
            f.result()

    def cached(self, func_index: int, completion_ids: list[list[int]]) -> tuple[list, dict[str, list]] | None:
        """The values (and `log_extra` columns) of one function for every row, if every row was scored on exactly
        these completion ids; None otherwise (the caller then scores the batch itself)."""
        values = self.values.get(func_index)
        if values is None or len(completion_ids) != self.num_rows or len(values) != self.num_rows:
            return None
        if any(self.completion_ids[i] != list(ids) for i, ids in enumerate(completion_ids)):
            return None
        extra = {c: [v.get(i) for i in range(self.num_rows)] for c, v in self.extra[func_index].items()}
        return [values[i] for i in range(self.num_rows)], extra


@dataclass
class StreamSlot:
    """The batch being generated, shared by the trainer and the cached reward functions: TRL's inputs and prompts
    (while `_generate_and_score_completions` runs), its stream once an engine call opened one (at most one at a
    time), and the executor of `rollout_reward_executor` (None: the calling thread)."""

    executor: ThreadPoolExecutor | None = None
    inputs: list[dict] | None = None
    prompts: list | None = None
    stream: StreamingRewards | None = None

    def close(self) -> None:
        self.inputs = self.prompts = self.stream = None


class CachedRewardFunc:
    """A synchronous reward function reading the current stream's cache first."""

    def __init__(self, func: Callable, index: int, slot: StreamSlot):
        functools.update_wrapper(self, func)  # __name__, __doc__, __wrapped__: looks like the user's function
        self.func, self.index, self.slot = func, index, slot

    def _cached(self, kwargs: dict) -> list | None:
        stream = self.slot.stream
        ids = kwargs.get("completion_ids")
        if stream is None or ids is None:
            return None
        stream.wait()
        hit = stream.cached(self.index, ids)
        if hit is None:
            return None
        values, extra = hit
        log_extra = kwargs.get("log_extra")
        if log_extra is not None:
            for column, column_values in extra.items():
                log_extra(column, column_values)
        return values

    def __call__(self, *args, **kwargs):
        values = self._cached(kwargs)
        return values if values is not None else self.func(*args, **kwargs)


class AsyncCachedRewardFunc(CachedRewardFunc):
    """The same for an `async` reward function (TRL awaits it with the others on its event loop)."""

    async def __call__(self, *args, **kwargs):
        values = self._cached(kwargs)
        return values if values is not None else await self.func(*args, **kwargs)


def wants_whole_batch(func) -> bool:
    """A reward function's own `reward_chunks` attribute: "batch" (called by TRL on the whole batch after the
    rollout, never streamed) or "groups" / absent (streamed in chunks of whole groups); ValueError otherwise."""
    value = getattr(func, "reward_chunks", None)
    if value is not None and value not in REWARD_CHUNKS:
        raise ValueError(f"The reward function {getattr(func, '__name__', func)!r} has `reward_chunks={value!r}`; it "
                         f"must be one of {list(REWARD_CHUNKS)}.")
    return value == "batch"


def wrap_reward_funcs(reward_funcs: list, slot: StreamSlot) -> list:
    """Every reward function wrapped (modules, i.e. reward models, and functions that want the whole batch left as
    they are)."""
    from torch import nn

    out = []
    for i, func in enumerate(reward_funcs):
        if isinstance(func, nn.Module) or isinstance(func, CachedRewardFunc) or wants_whole_batch(func):
            out.append(func)
        else:
            out.append((AsyncCachedRewardFunc if is_async_callable(func) else CachedRewardFunc)(func, i, slot))
    return out


def streamed_funcs(reward_funcs: list) -> list[tuple[int, Callable, bool]]:
    """(index, user function, is async) of every wrapped reward function: those scored while the rollout runs."""
    return [
        (i, f.func, isinstance(f, AsyncCachedRewardFunc)) for i, f in enumerate(reward_funcs)
        if isinstance(f, CachedRewardFunc)
    ]
