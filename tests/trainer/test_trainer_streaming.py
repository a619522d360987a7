"""Streamed rewards: scored in chunks between decode steps on the training thread (so `signal.alarm` works), read
by TRL's own `_calculate_rewards` (its all-None warning, its logger, `log_extra` in row order)."""

import asyncio
import inspect
import signal
import threading
from pathlib import Path

import pytest
from test_trainer_train import make_trainer
from trainer_helpers import token_sum_reward

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
                           per_device_train_batch_size=8)
    trainer.train()
    assert sum(n for _, n, _ in calls) == 8  # every completion scored exactly once
    assert all(n <= 3 for _, n, _ in calls) and len(calls) >= 3  # chunks of at most g
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
                           rollout_reward_executor="thread")
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
                           per_device_train_batch_size=8)
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
                           rollout_max_active_sequences=2)
    trainer.train()
    assert sum(seen) == 4 and len(seen) >= 2
    lengths = trainer._logs["rewards"]["async_reward"]
    assert len(lengths) == 4 and all(1 <= v <= 8 for v in lengths)  # completion lengths (max_completion_length 8)
