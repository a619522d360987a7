"""From TRL's `_generate_single_turn` inputs to engine calls and back (`engine_rollout`).

TRL hands the hook one row per completion, each prompt repeated G times in a row (`num_generations`, TRL's
`RepeatSampler` layout). `trl_groups` turns that layout into the groups of this process's rows (a group may continue on
the neighbouring process), `generate_rows` calls the engine once per distinct group size (once in practice) with
`num_generations` = that size, and puts the completions back in TRL's row order. The engine runs on the trained
weights, unwrapped as TRL unwraps them for `generate` (`generation_model`), with the `GenerationConfig` `generate`
would use (`generation_config.py`), a seed derived from checkpointed state (`rollout_seed`), and the rows' rewards
streamed as they finish (`reward_scoring.start_stream`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from trl_infinite.engine import RolloutEngine, RolloutStats, SamplingParams
from trl_infinite.trainer.generation_config import effective_generation_config, engine_sampling_params
from trl_infinite.trainer.reward_scoring import start_stream


@dataclass
class PromptRun:
    """`length` consecutive rows starting at row `start` that hold the same prompt."""

    start: int
    length: int


def trl_groups(num_rows: int, num_generations: int, first_row: int = 0) -> list[PromptRun]:
    """The prompt groups of `num_rows` rows in TRL's layout: the global generation batch holds each prompt
    `num_generations` times in a row, and this process's rows start at global row `first_row` (each process takes an
    equal contiguous slice), so its first and last group may be the part of a group split between two processes."""
    runs: list[PromptRun] = []
    row = 0
    while row < num_rows:
        length = min(num_generations - (first_row + row) % num_generations, num_rows - row)
        runs.append(PromptRun(row, length))
        row += length
    return runs


def check_groups(prompt_ids: list[list[int]], runs: list[PromptRun]) -> None:
    """`ValueError` unless every group's rows hold one prompt (the rows do not follow TRL's layout otherwise)."""
    for run in runs:
        first = list(prompt_ids[run.start])
        if any(list(prompt_ids[r]) != first for r in range(run.start + 1, run.start + run.length)):
            raise ValueError(f"rows {run.start}..{run.start + run.length - 1} should hold one prompt repeated "
                             "(TRL's layout: each prompt `num_generations` times in a row) but hold several.")


@dataclass(frozen=True)
class RolloutKey:
    """Where a rollout happens in training, from state a checkpoint restores: the optimizer step
    (`state.global_step`), the micro step inside it (TRL's `_step` modulo the gradient accumulation steps), train or
    eval, the process, and the engine call within that micro step (the tool loop and evaluation batches call the
    engine several times per micro step)."""

    global_step: int
    micro_step: int
    mode: str
    process_index: int
    call: int = 0


def rollout_seed(base_seed: int, key: RolloutKey) -> int:
    """The engine's sampling seed for one rollout: a hash of the run's seed and `key`, in [0, 2**63). The engine's
    randomness is a pure function of (seed, prompt, sample, position), so a seed derived from checkpointed state
    makes a resumed run sample exactly what the uninterrupted run sampled; distinct keys get distinct seeds (a
    repeated seed would repeat a batch's samples)."""
    text = f"{base_seed}/{key.mode}/{key.global_step}/{key.micro_step}/{key.process_index}/{key.call}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class RolloutSeeds:
    """Counts the engine calls of each (global step, micro step, mode) to give each its `RolloutKey`; keeps only
    the current step's count (bounded)."""

    def __init__(self) -> None:
        self._step: tuple | None = None
        self._calls = 0

    def next_key(self, global_step: int, micro_step: int, mode: str, process_index: int) -> RolloutKey:
        step = (global_step, micro_step, mode)
        if step != self._step:
            self._step, self._calls = step, 0
        key = RolloutKey(global_step, micro_step, mode, process_index, self._calls)
        self._calls += 1
        return key


RowCallback = Callable[[int, list[int]], None]  # (row index in TRL's order, completion ids)


def generate_rows(
    engine: RolloutEngine,
    prompt_ids: list[list[int]],
    sampling: SamplingParams,
    runs: list[PromptRun],
    on_row_finished: RowCallback | None = None,
    keep_pool: bool = False,
) -> tuple[list[list[int]], list[list[float]], list[RolloutStats]]:
    """Completions and sampling log-probs for every row of `prompt_ids` (TRL's order), and the stats of each call;
    `runs`: the rows' prompt groups (`trl_groups`). The log-probs are the engine's raw ones when `sampling` asks for
    them (`raw_logprobs_temperature`: TRL's convention), else those of the processed distribution. `keep_pool`:
    the engine keeps its pool and prefix cache for a next call of the same rollout (`RolloutEngine.generate`)."""
    check_groups(prompt_ids, runs)
    completions: list[list[int] | None] = [None] * len(prompt_ids)
    logprobs: list[list[float] | None] = [None] * len(prompt_ids)
    stats = []
    for length in sorted({r.length for r in runs}):
        chosen = [r for r in runs if r.length == length]
        callback = None
        if on_row_finished is not None:
            def callback(prompt_idx: int, sample_idx: int, ids: list[int], _chosen=chosen) -> None:
                on_row_finished(_chosen[prompt_idx].start + sample_idx, ids)
        result = engine.generate(
            [list(prompt_ids[r.start]) for r in chosen], length, sampling, on_sample_finished=callback,
            keep_pool=keep_pool,
        )
        chosen_lps = result.raw_logprobs if result.raw_logprobs is not None else result.logprobs
        for k, (ids, lps) in enumerate(zip(result.completion_ids, chosen_lps)):
            row = chosen[k // length].start + k % length
            completions[row], logprobs[row] = list(ids), list(lps)
        stats.append(result.stats)
    return completions, logprobs, stats


# the `rollout/<name>` metrics of one engine call, in logging order (`*_gb`: the stat `*_bytes` in GB)
_METRICS = ("tokens_per_second", "decode_steps", "peak_kv_gb", "weight_copy_gb", "peak_active_sequences",
            "prefill_tokens", "prefix_cache_hit_tokens", "generated_tokens", "preemptions", "wall_time_s",
            "mean_active_sequences", "kv_utilization", "tail_decode_steps", "offloaded_blocks", "parks", "graph_captures")
_SPEC_METRICS = ("mean_acceptance_length", "draft_tokens", "accepted_tokens", "verify_steps")  # speculative decoding


def rollout_metrics(stats: RolloutStats) -> dict[str, float]:
    """The `rollout/*` metrics of one engine call, i.e. of one turn of a tool loop (plus every numeric
    `stats.extra` counter)."""
    names = _METRICS + (_SPEC_METRICS if stats.verify_steps else ())
    out = {f"rollout/{n}": (getattr(stats, n[:-3] + "_bytes") / 1e9 if n.endswith("_gb") else float(getattr(stats, n)))
           for n in names}
    for key, value in stats.extra.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"rollout/{key}"] = float(value)
    return out


def turn_metrics(stats: RolloutStats, turn: int) -> dict[str, float]:
    """Prefill work of turn `turn` (0: the first) of a multi-turn rollout, under its own keys."""
    return {f"rollout/turn_{turn}/prefill_tokens": float(stats.prefill_tokens),
            f"rollout/turn_{turn}/prefix_cache_hit_tokens": float(stats.prefix_cache_hit_tokens)}


def engine_rollout(trainer, prompt_ids: list, num_generations: int) -> tuple[list[list[int]], list[list[float]]]:
    """`InfiniteGRPOTrainer._generate_single_turn` on the engine: (completion ids cut after the first EOS, sampling
    log-probs in TRL's convention), both in row order; the `rollout/*` metrics logged. Raises the engine's
    `UnsupportedModelError` where the full support contract fails (the trainer then falls back)."""
    groups = trl_groups(len(prompt_ids), num_generations, trainer.accelerator.process_index * len(prompt_ids))
    turn_based = _turn_based(trainer)
    stream = None if turn_based else start_stream(trainer, prompt_ids, groups)
    mode = "train" if trainer.model.training else "eval"
    args = trainer.args
    key = trainer._rollout_seeds.next_key(trainer.state.global_step, trainer._step % args.gradient_accumulation_steps,
                                          mode, trainer.accelerator.process_index)
    bar = tqdm(total=len(prompt_ids), desc="rollout", unit="sample", leave=False,
               disable=args.disable_tqdm or not trainer.accelerator.is_local_main_process)

    def on_row_finished(row: int, ids: list[int]) -> None:  # on this thread, between two engine steps
        bar.update(1)
        if stream is not None:
            stream.add(row, ids)

    multi_turn = turn_based and getattr(trainer, "_rollout_turn", None) is not None
    try:
        # under the autocast of TRL's training forwards (`accelerator.autocast()`: bf16 / fp16 mixed precision,
        # which the prepared model's `forward` also enters): the engine is built, checked and run under it
        with (profiling_context(trainer, "rollout_engine.generate"), generation_model(trainer) as model,
              trainer.accelerator.autocast()):
            config = effective_generation_config(model, trainer.generation_config)
            sampling = engine_sampling_params(config, trainer.max_completion_length, trainer.eos_token_ids,
                                              rollout_seed(args.seed, key), logprobs_temperature=trainer.temperature)
            engine = trainer._get_engine(model)
            completions, logprobs, stats = generate_rows(engine, prompt_ids, sampling, groups, on_row_finished,
                                                         keep_pool=multi_turn)
    finally:
        bar.close()
    if stream is not None:
        stream.flush()
    for s in stats:
        metrics = rollout_metrics(s)
        if multi_turn:
            metrics.update(turn_metrics(s, trainer._rollout_turn))
        for name, value in metrics.items():
            trainer._metrics[mode][name].append(value)
    if trainer._rollout_turn is not None:
        trainer._rollout_turn += 1
    return completions, logprobs


def _turn_based(trainer) -> bool:
    """A rollout that may call the engine again with conversations continuing this call's (TRL's tool loop,
    `environment_factory`, a `rollout_func`): inside one, the engine keeps its pool and caches the completions, and
    the rewards are scored after the rollout."""
    return (bool(trainer.tools) or trainer.rollout_func is not None
            or getattr(trainer, "environment_factories", None) is not None)


@contextmanager
def generation_model(trainer):
    """The trained model, unwrapped (ZeRO-3 parameters gathered) exactly as TRL does for `generate`, in eval mode (no
    dropout) for the duration of the rollout. Under FSDP the trainer gathered every parameter for the whole rollout
    already (`full_weights.rollout_weights`, in `InfiniteGRPOTrainer._generate`)."""
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
    ):
        was_training = model.training
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)
