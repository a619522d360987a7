"""Scores some rows of a batch with the trainer's reward functions, called exactly as TRL's `_calculate_rewards`
calls them (same keyword arguments, dataset columns, `trainer_state`, `log_extra`, `log_metric`, `environments`;
async functions gathered on TRL's event loop), only on fewer rows; and the start of a rollout's stream
(`start_stream`: where the batch can be scored while it decodes, `streamed_rewards.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from trl.chat_template_utils import parse_response
from trl.data_utils import is_conversational
from trl.extras.profiling import profiling_context

from trl_infinite.trainer.streamed_rewards import ChunkScores, StreamingRewards, streamed_funcs

if TYPE_CHECKING:
    from trl_infinite.trainer.rollout import PromptRun

_RESERVED = ("prompt", "completion", "completion_ids")


class ChunkScorer:
    """`score(rows, completion_ids) -> ChunkScores` for the streamed (non-model) reward functions of a trainer.

    `decode(row, ids)` turns completion ids into what TRL passes as `completions` (text or messages); `groups`: the
    rows' prompt groups in TRL's layout (`rollout.trl_groups`)."""

    def __init__(self, trainer, inputs: list[dict], prompts: list, decode: Callable[[int, list[int]], object],
                 groups: list[PromptRun]):
        self.trainer, self.inputs, self.prompts, self.decode = trainer, inputs, prompts, decode
        self.funcs = streamed_funcs(trainer.reward_funcs)
        self.names = trainer.reward_func_names
        self.prompt_of_row = [k for k, g in enumerate(groups) for _ in range(g.length)]  # row -> its group

    def score(self, rows: list[int], completion_ids: list[list[int]]) -> ChunkScores:
        completions = [self.decode(r, ids) for r, ids in zip(rows, completion_ids)]
        out = ChunkScores(values={})
        pending = []
        for f, func, is_async in self.funcs:
            extra: dict[str, list] = {}
            kwargs = self._kwargs(rows, completions, completion_ids, extra)
            if is_async:
                pending.append((f, func, kwargs, extra))
                continue
            out.values[f] = self._checked(f, rows, self._guarded(f, func, rows, kwargs))
            out.extra[f] = extra
        if pending:  # like TRL: every async function of the chunk runs concurrently on the trainer's event loop
            results = self._run_async(pending, rows)
            for (f, _, _, extra), values in zip(pending, results):
                out.values[f] = self._checked(f, rows, values)
                out.extra[f] = extra
        return out

    # -- one function on some rows
    def _kwargs(self, rows: list[int], completions: list, completion_ids: list, extra: dict[str, list]) -> dict:
        t = self.trainer
        keys = [k for k in self.inputs[0] if k not in _RESERVED]
        kwargs = {k: [self.inputs[r][k] for r in rows] for k in keys}
        kwargs["prompts"] = [self.prompts[r] for r in rows]
        kwargs["completions"] = completions
        kwargs["completion_ids"] = completion_ids
        kwargs["trainer_state"] = t.state

        def log_extra(column: str, values: list) -> None:  # kept per row, replayed in row order by TRL's call
            extra[column] = list(values)

        kwargs["log_extra"] = log_extra
        kwargs["log_metric"] = t._log_metric
        if getattr(t, "environments", None) is not None:
            kwargs["environments"] = [t.environments[r] for r in rows]
        return kwargs

    def _guarded(self, f: int, func, rows: list[int], kwargs: dict) -> list:
        try:
            with profiling_context(self.trainer, self.names[f]):
                return func(**kwargs)
        except Exception as err:
            self._annotate(f, rows, err)
            raise

    def _run_async(self, pending: list, rows: list[int]) -> list[list]:
        async def one(f, func, kwargs):
            with profiling_context(self.trainer, self.names[f]):
                return await func(**kwargs)

        async def gather():
            return await asyncio.gather(*(one(f, func, kw) for f, func, kw, _ in pending), return_exceptions=True)

        results = asyncio.run_coroutine_threadsafe(gather(), self.trainer.async_loop).result()
        for (f, _, _, _), result in zip(pending, results):
            if isinstance(result, BaseException):
                self._annotate(f, rows, result)
                raise result
        return results

    def _checked(self, f: int, rows: list[int], values) -> list:
        """The function's values as returned (TRL turns None into NaN), after TRL's length check."""
        values = list(values)
        if len(values) != len(rows):
            raise ValueError(
                f"The reward function '{self.names[f]}' returned {len(values)} rewards, but {len(rows)} were expected "
                "(one per prompt-completion pair). Make sure the reward function returns exactly one reward per "
                "completion."
            )
        return values

    def _annotate(self, f: int, rows: list[int], err: BaseException) -> None:
        """Add where the error happened as a note (the exception itself, its type and traceback, stay the user's:
        the function is called once, as TRL calls it)."""
        if not hasattr(err, "add_note"):  # Python < 3.11
            return
        prompts = sorted({self.prompt_of_row[r] for r in rows})
        err.add_note(f"InfiniteGRPOTrainer: raised by reward function {self.names[f]!r}, scored while the rollout ran, "
                     f"on completion rows {rows[0]}..{rows[-1]} of this process's batch (prompts {prompts[0]}.."
                     f"{prompts[-1]}); first prompt: {_short(self.prompts[rows[0]])}")


def _short(prompt) -> str:
    text = repr(prompt)
    return text if len(text) <= 200 else text[:200] + "..."


def start_stream(trainer, prompt_ids: list, groups: list[PromptRun]) -> StreamingRewards | None:
    """The stream scoring this engine call's rows as they finish, opened in the trainer's `StreamSlot`; None where
    the batch is scored after generation (a tool-loop re-entry, no streamed function; the caller leaves out
    rollouts of several turns)."""
    slot = trainer._stream_slot
    if (slot.inputs is None or slot.prompts is None or len(prompt_ids) != len(slot.prompts)
            or slot.stream is not None  # the first turn only; tool-loop re-entries are scored at the end
            or not streamed_funcs(trainer.reward_funcs)):
        return None
    prompts = slot.prompts

    def decode(row: int, ids: list[int]):
        return decode_completion(trainer, prompts[row], prompt_ids[row], ids)

    scorer = ChunkScorer(trainer, slot.inputs, prompts, decode, groups)
    chunk = trainer.engine_config.scheduling.max_active_sequences or trainer.num_generations
    if getattr(trainer.args, "rollout_reward_chunks", "groups") == "batch":
        chunk = len(prompt_ids)
    stream = StreamingRewards(len(prompt_ids), scorer.score, chunk, slot.executor,
                              group_sizes=[g.length for g in groups])
    slot.stream = stream
    return stream


def decode_completion(trainer, prompt, prompt_ids: list[int], ids: list[int]):
    """One completion as TRL's `_generate` decodes it (text, or an assistant message for chat prompts)."""
    if not is_conversational({"prompt": prompt}):
        return trainer.processing_class.decode(ids, skip_special_tokens=True)
    tok = trainer._tokenizer
    if getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None:
        return [parse_response(tok, ids, prefix=prompt_ids, tools=trainer.tools)]
    return [{"role": "assistant", "content": trainer.processing_class.decode(ids, skip_special_tokens=True)}]
