"""Scores any subset of a batch's rows with the trainer's reward functions (TRL's `_calculate_rewards` without the
cross-process gather, so it can run on a worker thread, chunk by chunk)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import torch
from torch import nn
from transformers import Trainer
from trl.data_utils import apply_chat_template, is_conversational
from trl.extras.profiling import profiling_context
from trl.trainer.utils import is_async_callable

from .streaming import RewardFunctionError

_RESERVED = ("prompt", "completion", "completion_ids")


def prompt_index_of_rows(prompts: list) -> list[int]:
    """Index of each row's prompt among the batch's distinct prompts (consecutive equal prompts = one group)."""
    out, k = [], -1
    for i, p in enumerate(prompts):
        if i == 0 or p != prompts[i - 1]:
            k += 1
        out.append(k)
    return out


class BatchScorer:
    """Rewards of chosen rows of one batch: `score(rows) -> (rewards [len(rows), F] float32, log_extra columns)`."""

    def __init__(self, trainer, inputs: list[dict], prompts: list, decode):
        self.trainer, self.inputs, self.prompts, self.decode = trainer, inputs, prompts, decode
        self.prompt_of_row = prompt_index_of_rows(prompts)
        self.completion_ids: dict[int, list[int]] = {}  # filled by the caller before scoring
        self.completions: dict[int, object] = {}

    def score(self, rows: list[int]) -> tuple[torch.Tensor, dict[str, list]]:
        t = self.trainer
        for r in rows:
            if r not in self.completions:
                self.completions[r] = self.decode(r, self.completion_ids[r])
        out = torch.full((len(rows), len(t.reward_funcs)), float("nan"))  # [n, F]
        extra: dict[str, list] = defaultdict(lambda: [None] * len(rows))
        for f, (func, proc, name) in enumerate(zip(t.reward_funcs, t.reward_processing_classes, t.reward_func_names)):
            try:
                values = self._call(func, proc, name, rows, extra)
            except RewardFunctionError:
                raise
            except Exception as err:
                raise self._pinpoint(func, proc, name, rows, err) from err
            out[:, f] = torch.tensor(values, dtype=torch.float32)
        return out, dict(extra)

    # -- one reward function on some rows
    def _call(self, func, proc, name: str, rows: list[int], extra: dict | None) -> list[float]:
        t = self.trainer
        prompts = [self.prompts[r] for r in rows]
        completions = [self.completions[r] for r in rows]
        if isinstance(func, nn.Module):
            return self._call_model(func, proc, name, prompts, completions)
        kwargs = self._kwargs(rows, extra)
        ids = [self.completion_ids[r] for r in rows]
        with profiling_context(t, name):
            if is_async_callable(func):
                coro = func(prompts=prompts, completions=completions, completion_ids=ids, **kwargs)
                values = asyncio.run_coroutine_threadsafe(coro, t.async_loop).result()
            else:
                values = func(prompts=prompts, completions=completions, completion_ids=ids, **kwargs)
        values = [float("nan") if v is None else float(v) for v in values]
        if len(values) != len(rows):
            raise ValueError(
                f"The reward function '{name}' returned {len(values)} rewards, but {len(rows)} were expected (one per "
                "prompt-completion pair)."
            )
        return values

    def _kwargs(self, rows: list[int], extra: dict | None) -> dict:
        t = self.trainer
        keys = [k for k in self.inputs[0] if k not in _RESERVED]
        kwargs = {k: [self.inputs[r][k] for r in rows] for k in keys}
        kwargs["trainer_state"] = t.state
        kwargs["log_metric"] = t._log_metric

        def log_extra(column: str, values: list) -> None:  # one value per row of this call, kept in row order
            if extra is not None:
                for i, v in enumerate(values):
                    extra[column][i] = v

        kwargs["log_extra"] = log_extra
        if getattr(t, "environments", None) is not None:
            kwargs["environments"] = [t.environments[r] for r in rows]
        return kwargs

    def _call_model(self, func, proc, name: str, prompts: list, completions: list) -> list[float]:
        t = self.trainer
        with profiling_context(t, name):
            if is_conversational({"prompt": prompts[0]}):
                msgs = [{"messages": p + c} for p, c in zip(prompts, completions)]
                texts = [apply_chat_template(x, proc, **t.chat_template_kwargs)["text"] for x in msgs]
            else:
                texts = [p + c for p, c in zip(prompts, completions)]
            enc = proc(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
            enc = Trainer._prepare_inputs(t, enc)
            with torch.inference_mode():
                return func(**enc).logits[:, 0].float().cpu().tolist()

    def _pinpoint(self, func, proc, name: str, rows: list[int], err: BaseException) -> RewardFunctionError:
        """Re-runs the failing function prompt by prompt to name the prompt that makes it raise."""
        groups: dict[int, list[int]] = defaultdict(list)
        for r in rows:
            groups[self.prompt_of_row[r]].append(r)
        if len(groups) > 1:
            for p, group_rows in groups.items():
                try:
                    self._call(func, proc, name, group_rows, None)
                except Exception as sub:  # noqa: BLE001 - reported below with its prompt
                    return RewardFunctionError(name, p, group_rows, self.prompts[group_rows[0]], sub)
        p, group_rows = next(iter(groups.items()))
        return RewardFunctionError(name, p, group_rows, self.prompts[group_rows[0]], err)
