"""Streamed rewards (`trainer/streamed_rewards.py`, `trainer/reward_scoring.py`): scored in chunks between decode steps
on the training thread (so `signal.alarm` works), read by TRL's own `_calculate_rewards` (its all-None warning, its
logger, `log_extra` in row order)."""

import asyncio
import inspect
import signal
import threading
from collections import defaultdict
from pathlib import Path

import pytest
from test_trainer_train import make_trainer
from trainer_helpers import cpu_args, token_sum_reward

from trl_infinite.trainer import InfiniteGRPOConfig
from trl_infinite.trainer.streamed_rewards import ChunkScores, StreamingRewards

ENGINE_FILE = str(Path(__file__).resolve().parents[2] / "trl_infinite" / "engine" / "engine.py")


def inside_engine_generate() -> bool:
    return any(f.function == "generate" and f.filename == ENGINE_FILE for f in inspect.stack())


def test_rewards_score_in_chunks_on_the_main_thread_while_decoding(tmp_path, tokenizer, dataset):
    calls = []

    def recording_reward(completion_ids, **kwargs):
        calls.append((threading.current_thread() is threading.main_thread(), len(completion_ids),
                      inside_engine_generate()))
        return token_sum_reward(completion_ids)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=recording_reward, rollout_max_active_sequences=3,
                           per_device_train_batch_size=8, num_generations=2)
    trainer.train()
    assert sum(n for _, n, _ in calls) == 8  # every completion scored exactly once
    assert all(n % 2 == 0 for _, n, _ in calls) and len(calls) >= 2  # whole groups of 2, at least 3 rows a chunk
    assert all(n >= 3 for _, n, _ in calls[:-1])
    assert all(main for main, _, _ in calls)
    assert any(during for _, _, during in calls)  # some chunks scored while the engine was still decoding
    logged = trainer._logs["rewards"]["recording_reward"]
    assert trainer.state.log_history[0]["reward"] == pytest.approx(sum(logged) / len(logged))


def test_thread_executor_scores_off_the_main_thread(tmp_path, tokenizer, dataset):
    names = []

    def recording_reward(completion_ids, **kwargs):
        names.append(threading.current_thread().name)
        return token_sum_reward(completion_ids)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=recording_reward, rollout_max_active_sequences=2,
                           rollout_reward_executor="thread", num_generations=2)
    trainer.train()
    assert len(names) >= 2 and all(n.startswith("trl-infinite-rewards") for n in names)


def test_signal_alarm_reward_trains(tmp_path, tokenizer, dataset):
    """The usual sandbox timeout pattern: `signal.alarm` only works on the main thread."""
    armed = []

    def timed_reward(completion_ids, **kwargs):
        def on_timeout(signum, frame):
            raise TimeoutError("reward timed out")

        previous = signal.signal(signal.SIGALRM, on_timeout)
        signal.alarm(5)
        try:
            armed.append(len(completion_ids))
            return token_sum_reward(completion_ids)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=timed_reward, rollout_max_active_sequences=2,
                           max_steps=2)
    trainer.train()
    assert sum(armed) == 8 and len([h for h in trainer.state.log_history if "loss" in h]) == 2


def test_all_none_rewards_give_trls_warning_on_trls_logger(tmp_path, tokenizer, dataset, caplog):
    def always_none(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=always_none, rollout_max_active_sequences=2)
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
        trainer.train()
    records = [r for r in caplog.records if "All reward functions returned None for the following kwargs:" in r.message]
    assert records and all(r.name == "trl.trainer.grpo_trainer" for r in records)


def test_log_extra_columns_stay_in_row_order(tmp_path, tokenizer, dataset):
    def echo_reward(completions, completion_ids, log_extra, **kwargs):
        log_extra("echo", list(completions))
        return token_sum_reward(completion_ids)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=echo_reward, rollout_max_active_sequences=3,
                           per_device_train_batch_size=8, num_generations=2)
    trainer.train()
    assert trainer._logs["extra"]["echo"] == trainer._logs["completion"]
    assert len(trainer._logs["completion"]) == 8


def test_async_and_sync_reward_functions_stream_together(tmp_path, tokenizer, dataset):
    seen = []

    async def async_reward(completion_ids, **kwargs):
        await asyncio.sleep(0)
        seen.append(len(completion_ids))
        return [float(len(ids)) for ids in completion_ids]

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=[token_sum_reward, async_reward],
                           rollout_max_active_sequences=2, num_generations=2)
    trainer.train()
    assert sum(seen) == 4 and len(seen) >= 2
    lengths = trainer._logs["rewards"]["async_reward"]
    assert len(lengths) == 4 and all(1 <= v <= 8 for v in lengths)  # completion lengths (max_completion_length 8)


def group_centred(prompts, completion_ids):
    """A group-relative reward (like Kimi k1.5's length penalty over a prompt's samples): each completion's token
    sum minus the mean over the samples of its prompt in the call."""
    sums = defaultdict(list)
    for p, ids in zip(prompts, completion_ids):
        sums[str(p)].append(sum(ids))
    return [sum(ids) - sum(sums[str(p)]) / len(sums[str(p)]) for p, ids in zip(prompts, completion_ids)]


def test_streamed_calls_hold_whole_groups(tmp_path, tokenizer, dataset):
    """Chunks of 3 rows, groups of 4: every call holds whole groups, so the group-relative reward gets its
    whole-batch value for every completion (chunks that split groups gave 17 of 48 values off)."""
    calls = []

    def centred_reward(prompts, completion_ids, **kwargs):
        values = group_centred(prompts, completion_ids)
        calls.append((list(prompts), [list(i) for i in completion_ids], values))
        return values

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=centred_reward, rollout_max_active_sequences=3,
                           per_device_train_batch_size=8, num_generations=4, max_steps=2)
    trainer.train()
    assert len(calls) >= 2 and sum(len(p) for p, _, _ in calls) == 16
    for prompts, _, _ in calls:
        assert all(prompts.count(p) == 4 for p in prompts)  # whole groups of 4
    total, steps = 0, [[], []]  # the calls of each step (8 rows each)
    for c in calls:
        steps[total >= 8].append(c)
        total += len(c[0])
    for batch in steps:  # each value is the function's value on the whole batch of its step
        prompts = [p for c in batch for p in c[0]]
        ids = [i for c in batch for i in c[1]]
        assert [v for c in batch for v in c[2]] == group_centred(prompts, ids)


def test_reward_chunks_batch_scores_the_whole_batch_once(tmp_path, tokenizer, dataset):
    sizes = []

    def reward(completion_ids, **kwargs):
        sizes.append(len(completion_ids))
        return token_sum_reward(completion_ids)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=reward, rollout_max_active_sequences=2,
                           per_device_train_batch_size=8, num_generations=2, rollout_reward_chunks="batch")
    trainer.train()
    assert sizes == [8]


def test_a_function_can_ask_for_the_whole_batch(tmp_path, tokenizer, dataset):
    """`reward_chunks = "batch"` on one function: TRL calls it on the whole batch after the rollout; the others
    still stream."""
    seen = {"batch": [], "streamed": []}

    def whole(completion_ids, **kwargs):
        seen["batch"].append((len(completion_ids), inside_engine_generate()))
        return token_sum_reward(completion_ids)

    whole.reward_chunks = "batch"

    def streamed(completion_ids, **kwargs):
        seen["streamed"].append(len(completion_ids))
        return token_sum_reward(completion_ids)

    trainer = make_trainer(tmp_path, tokenizer, dataset, reward_funcs=[whole, streamed],
                           rollout_max_active_sequences=2, per_device_train_batch_size=8, num_generations=2)
    trainer.train()
    assert seen["batch"] == [(8, False)]
    assert sum(seen["streamed"]) == 8 and len(seen["streamed"]) >= 2
    whole.reward_chunks = "rows"
    with pytest.raises(ValueError, match="reward_chunks"):
        make_trainer(tmp_path, tokenizer, dataset, reward_funcs=[whole])


def test_reward_chunks_is_validated(tmp_path):
    with pytest.raises(ValueError, match="`rollout_reward_chunks` must be one of"):
        cpu_args(tmp_path, cls=InfiniteGRPOConfig, rollout_reward_chunks="rows")


def test_stream_scores_complete_groups_only():
    """Rows finishing out of group order: a chunk is scored once at least `chunk_size` rows of complete groups wait;
    a group with an unfinished row is never scored."""
    chunks = []

    def score(rows, ids):
        chunks.append(rows)
        return ChunkScores(values={0: [0.0] * len(rows)})

    stream = StreamingRewards(10, score, 3, group_sizes=[4, 4, 2])
    for row in (0, 4, 5, 8, 1, 2, 6, 3, 9):  # row 7 never finishes
        stream.add(row, [row])
    stream.wait()
    assert chunks == [[0, 1, 2, 3], [8, 9]]
    assert stream.cached(0, [[r] for r in range(10)]) is None  # TRL's call then scores the whole batch
