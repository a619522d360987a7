"""Reward functions as TRL's `_calculate_rewards` sees them: the values streamed during the rollout, when there are.

`InfiniteGRPOTrainer` wraps each reward *function* (reward models, and functions with the attribute
`reward_chunks = "batch"`, stay TRL's: they run once, on the whole batch, after the rollout) in a `CachedRewardFunc`. TRL's own `_calculate_rewards` calls it on the whole batch as usual; when every row
was already scored on exactly these completion ids, it returns those values and replays their `log_extra` columns
in row order; otherwise (no stream: tool calls, `rollout_func`, TRL's generation path, a direct call) it calls the
function itself. TRL keeps everything else: the None -> NaN rule, the length check, the all-None warning (its text,
its logger), the cross-process gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from trl.trainer.utils import is_async_callable

from trl_infinite.trainer.streaming import REWARD_CHUNKS, StreamSlot


class CachedRewardFunc:
    """A synchronous reward function reading the current stream's cache first."""

    def __init__(self, func: Callable, index: int, slot: StreamSlot):
        functools.update_wrapper(self, func)  # __name__, __doc__, __wrapped__: looks like the user's function
        self.func, self.index, self.slot = func, index, slot

    def _cached(self, kwargs: dict) -> list | None:
        stream = self.slot.get()
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
