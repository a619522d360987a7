"""The trace simulator CLI and the prefix-predictor evaluation (no model: synthetic features)."""

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from trl_infinite.engine import EngineConfig
from trl_infinite.sim.__main__ import ROWS, main, run_table
from trl_infinite.sim.prefix_eval import evaluate_mae
from trl_infinite.sim.replay import SimConfig, _calls, simulate
from trl_infinite.sim.traces import TraceRecord, lognormal_trace, save_trace


def test_cli_table_on_a_trace(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    save_trace(lognormal_trace(3, 16, 60, 0.8, 256, seed=1), path)
    main(["--trace", str(path), "--max_active_sequences", "4", "--json", str(tmp_path / "out.json")])
    text = capsys.readouterr().out
    for name in ("micro_group", "fixed_slot", "dynamic_slot", "fptas", "sjf", "infinite", "seer", "oracle", "bound"):
        assert f"| {name} |" in text
    assert (tmp_path / "out.json").exists()


def test_cli_takes_every_engine_setting_by_its_flag(tmp_path, capsys):
    """The engine's settings are the CLI's `--<flag>` (the trainer's `rollout_<flag>`), none under another name."""
    from trl_infinite.engine.config.sections import flags

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(f"--{f.name} " in text for f in flags(EngineConfig))
    path = tmp_path / "t.jsonl"
    save_trace(lognormal_trace(2, 8, 30, 0.5, 64, seed=3), path)
    main(["--trace", str(path), "--max_active_sequences", "3", "--length_predictor", "group", "--chunk_tokens", "none",
          "--kv_cache_release", "false", "--policies", "fixed_slot", "--json", str(tmp_path / "o.json")])
    assert "g=3, predictor=group" in capsys.readouterr().out


@pytest.mark.parametrize("prompts_per_call", [1, 2])
def test_table_orders_and_bound(prompts_per_call):
    recs = lognormal_trace(4, 32, 120, 0.8, 512, seed=2)
    config = SimConfig(EngineConfig(max_active_sequences=4 * prompts_per_call), prompts_per_call=prompts_per_call)
    rows = {r["policy"]: r for r in run_table(recs, config, "oracle", rows=[r for r in ROWS if not r.divided])}
    bound = rows["bound"]["decode_steps"]
    for name, r in rows.items():
        if name != "dynamic_slot":  # dynamic_slot is not bound to g slots (as many as memory allows)
            assert r["decode_steps"] >= bound, name  # no g-slot schedule beats the lower bound
    assert rows["fixed_slot"]["decode_steps"] < rows["micro_group"]["decode_steps"]
    assert rows["oracle"]["decode_steps"] <= 1.02 * bound  # Infinite Sampling* within 2% of the bound here
    assert rows["infinite"]["decode_steps"] == rows["oracle"]["decode_steps"]  # fed the same oracle lengths


def test_prefix_mae_beats_constant_when_features_carry_length():
    rng = random.Random(0)
    recs, feats = [], {}
    for p in range(5):
        lengths = [int(math.exp(rng.uniform(2, 6))) + 1 for _ in range(16)]
        recs.append(TraceRecord(prompt_len=4, lengths=lengths, prompt_index=p, max_new_tokens=1024))
        for j, n in enumerate(lengths):  # a feature vector that encodes log-length plus noise
            feats[(p, j)] = np.array([math.log(n) + rng.gauss(0, 0.1)] + [rng.gauss(0, 1) for _ in range(3)])
    out = evaluate_mae(recs, feats, l2=0.1)
    assert out["samples"] == 80
    assert out["mae"] < 0.5 * out["baseline_mae"]


def _revisit(*groups, epochs=2):
    return [TraceRecord(prompt_len=5, lengths=list(g), prompt_index=i, max_new_tokens=64, epoch=e)
            for e in range(epochs) for i, g in enumerate(groups)]


def test_calls_never_mix_epochs():
    recs = _revisit([2], [3], [4])
    calls = _calls(recs, 2)
    assert [[r.epoch for r in c] for c in calls] == [[0, 0], [0], [1, 1], [1]]


@pytest.mark.parametrize("history_prompts,second_call", [(4096, 8), (0, 10)])
def test_second_epoch_is_scheduled_from_the_first(history_prompts, second_call):
    # costs 1,1,1 (prompt 0) and 8 (prompt 1) on 2 slots. Submission order puts the long sample last: 1 step for
    # prompt 0's first two samples, 1 in which prompt 1 is prefilled beside the third, then 8: 10 decode steps.
    # With prompt 1's length from the first epoch, `lfs` starts it first (both prompts prefilled before the first
    # decode step): 8 steps, the bound. Without history the second epoch has nothing to go on and repeats the first.
    recs = _revisit([2, 2, 2], [9])
    cfg = SimConfig(EngineConfig(scheduler="lfs", length_predictor="history", max_active_sequences=2, block_size=4,
                                 history_max_prompts=history_prompts), prompts_per_call=2)
    res = simulate(recs, cfg)
    assert [c.decode_steps for c in res.calls] == [10, second_call]
    summary = res.total({1})
    assert (res.epochs.count(1), summary.decode_steps, res.bound({1})) == (1, second_call, 8)
    if history_prompts:  # each prompt repeats its lengths
        assert summary.prediction_mae == 0 and len(summary.prediction_errors) == 4
    rows = {r["policy"]: r for r in run_table(recs, replace(cfg, engine=replace(cfg.engine, scheduler="fifo")),
                                              "history", rows=[ROWS[0], ROWS[1], ROWS[7]])}
    assert rows["fixed_slot"]["decode_steps"] == 10 and rows["lfs"]["decode_steps"] == second_call
    assert rows["bound"]["decode_steps"] == 8 and rows["oracle"]["decode_steps"] == 8


def test_random_order_row_is_the_mean_over_sample_orders():
    # one prompt x G=4, g=2: the row's Monte-Carlo mean against the exact mean over all 24 orders of the samples
    # (FIFO in the simulator); 400 draws, tolerance 3% (exact per-order steps 19 to 22, mean 20.0)
    import itertools

    from trl_infinite.sim.__main__ import random_order_steps

    lengths = [2, 3, 5, 20]
    rec = TraceRecord(prompt_len=4, lengths=lengths, max_new_tokens=64)
    cfg = SimConfig(EngineConfig(max_active_sequences=2, scheduler="fifo", length_predictor="none"))
    exact = [simulate([replace(rec, lengths=list(p))], cfg).total().decode_steps
             for p in itertools.permutations(lengths)]
    assert max(exact) > min(exact)  # the order matters, so the test can fail
    mean = random_order_steps([rec], cfg, {0}, orders=400)
    assert abs(mean - sum(exact) / len(exact)) <= 0.03 * sum(exact) / len(exact)
    # and the table row: a prompt whose samples all have one length has a single order
    same = TraceRecord(prompt_len=4, lengths=[7] * 6, max_new_tokens=64)
    rows = {r["policy"]: r for r in run_table([same], SimConfig(EngineConfig(max_active_sequences=2)), "none",
                                              rows=[ROWS[1]], random_orders=5)}
    assert rows["fifo_random_order"]["decode_steps"] == rows["fixed_slot"]["decode_steps"]


def test_random_orders_rejects_bad_counts():
    from trl_infinite.sim.__main__ import random_order_steps

    rec = TraceRecord(prompt_len=4, lengths=[2, 3], max_new_tokens=64)
    with pytest.raises(ValueError, match="--random-orders"):
        random_order_steps([rec], SimConfig(EngineConfig(max_active_sequences=1)), {0}, orders=0)
    with pytest.raises(ValueError, match="--random-orders"):
        main(["--trace", "unused.jsonl", "--random-orders", "-1"])
