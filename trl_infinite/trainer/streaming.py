"""Streamed rewards: reward functions score completions while the engine keeps decoding (paper §3.4).

As samples finish, the engine's `on_sample_finished` hook hands them to `StreamingRewards`; every `chunk_size` of
them are scored in a worker thread (off the decode loop) and the per-completion rewards cached. The group-wide
normalisation is TRL's own and runs once, after all G samples of every group are in (`_calculate_rewards` returns
the cached matrix). A reward function that raises surfaces as `RewardFunctionError` naming the prompt.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class RewardFunctionError(RuntimeError):
    """A reward function raised; names the function, the prompt index in the local batch and the rows."""

    def __init__(self, func_name: str, prompt_index: int, rows: list[int], prompt, cause: BaseException):
        self.func_name, self.prompt_index, self.rows, self.prompt = func_name, prompt_index, rows, prompt
        text = repr(prompt)
        text = text if len(text) <= 200 else text[:200] + "..."
        super().__init__(
            f"reward function {func_name!r} raised {type(cause).__name__}: {cause} -- on prompt {prompt_index} of "
            f"this process's batch (completion rows {rows[0]}..{rows[-1]}); prompt: {text}"
        )


# score(rows) -> (rewards [len(rows), F], {column: values} logged through `log_extra`)
ScoreFn = Callable[[list[int]], tuple[torch.Tensor, dict[str, list]]]


class StreamingRewards:
    """Caches rewards of finished rows; scoring runs on one background thread, `chunk_size` rows at a time."""

    def __init__(self, num_rows: int, num_funcs: int, score: ScoreFn, chunk_size: int, executor: ThreadPoolExecutor):
        self.num_rows, self.score, self.chunk_size, self.executor = num_rows, score, max(1, chunk_size), executor
        self.completion_ids: list[list[int] | None] = [None] * num_rows
        self.rewards = torch.full((num_rows, num_funcs), float("nan"))  # [N, F]
        self.scored = torch.zeros(num_rows, dtype=torch.bool)
        self.extra: dict[str, dict[int, object]] = defaultdict(dict)
        self._pending: list[int] = []
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def add(self, row: int, completion_ids: list[int]) -> None:
        """Called from the decode loop as each sample finishes; never blocks on scoring."""
        self._raise_failed()
        self.completion_ids[row] = list(completion_ids)
        self._pending.append(row)
        if len(self._pending) >= self.chunk_size:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            rows, self._pending = self._pending, []
            self._futures.append(self.executor.submit(self._score_chunk, rows))

    def _score_chunk(self, rows: list[int]) -> None:
        rewards, extra = self.score(rows)
        with self._lock:
            self.rewards[rows] = rewards.to(self.rewards.dtype).cpu()
            self.scored[rows] = True
            for column, values in extra.items():
                self.extra[column].update(zip(rows, values))

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def wait(self) -> None:
        """Scores what is still pending and waits for every chunk; re-raises the first reward error."""
        self.flush()
        for f in self._futures:
            f.result()

    def matches(self, completion_ids: list[list[int]]) -> list[bool]:
        """Per row: was it scored on exactly these completion ids (tool calls may have extended it since)?"""
        return [bool(self.scored[i]) and self.completion_ids[i] == list(ids) for i, ids in enumerate(completion_ids)]

    def extra_columns(self, num_rows: int) -> dict[str, list]:
        """`log_extra` columns in row order (None where a chunk did not log the column)."""
        return {c: [vals.get(i) for i in range(num_rows)] for c, vals in self.extra.items()}
