"""`benchmarks/learning_curve.py`, smoke version (issue 44): a few steps of a tiny random model, one seed per trainer.
Checks what is logged and that the table and the plot are produced, not the learning. The comparison's statistics
are checked on hand-made curves (`curve_stats.py`)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their `common` module by name


def test_both_trainers_log_every_step_and_the_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    cmd = [sys.executable, str(BENCH / "learning_curve.py"), "--task", "tiny", "--steps", "3", "--seeds", "0",
           "--num-prompts", "16", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["trainer"], r["seed"]) for r in data["runs"]] == [("trl", 0), ("infinite", 0)]
    for run in data["runs"]:
        assert [s["step"] for s in run["steps"]] == [1, 2, 3]
        for s in run["steps"]:
            assert s["cpu_s"] > 0 and s["wall_s"] > 0
            assert {"reward", "completions/mean_length", "entropy"} <= s.keys()
            assert {"rewards/length_mod/mean", "rewards/even_first/mean"} <= s.keys()
            # the total is the sum of the two functions' means (TRL's weights are 1)
            assert s["reward"] == pytest.approx(s["rewards/length_mod/mean"] + s["rewards/even_first/mean"], abs=1e-5)
    assert data["runs"][1]["uses_engine"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = out.with_suffix(".md").read_text()
    assert "| GRPOTrainer | 1 |" in table and "| InfiniteGRPOTrainer | 1 |" in table
    assert "final reward: too few seeds" in table  # one seed per trainer: no interval is claimed
    # a second seed later, the first run's kept: both seeds compared and plotted
    merged = tmp_path / "merged.json"
    cmd2 = [*cmd[:cmd.index("--seeds")], "--seeds", "1", "--num-prompts", "16", "--json", str(merged), "--plot",
            str(png), "--merge", str(out)]
    proc = subprocess.run(cmd2, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(merged.read_text())
    assert [(r["trainer"], r["seed"]) for r in data["runs"]] == [("trl", 0), ("infinite", 0), ("trl", 1),
                                                                 ("infinite", 1)]
    assert str(out) in data["merged"] and "| GRPOTrainer | 2 |" in merged.with_suffix(".md").read_text()


def test_merge_refuses_other_settings_and_repeated_seeds(tmp_path):
    lc = importlib.import_module("learning_curve")
    earlier = tmp_path / "earlier.json"
    a = lc.parse_args(["--task", "tiny", "--steps", "3", "--seeds", "0"])
    earlier.write_text(json.dumps({"args": vars(a), "runs": [{"trainer": t, "seed": 0, "steps": []}
                                                             for t in ("trl", "infinite")],
                                   "commit": "abc", "date": "today"}))
    with pytest.raises(SystemExit, match="seeds \\[0\\] are already"):
        lc.merged_runs(lc.parse_args(["--task", "tiny", "--steps", "3", "--seeds", "0", "--merge", str(earlier)]))
    with pytest.raises(SystemExit, match="steps=3"):
        lc.merged_runs(lc.parse_args(["--task", "tiny", "--steps", "4", "--seeds", "1", "--merge", str(earlier)]))
    runs, lines = lc.merged_runs(lc.parse_args(["--task", "tiny", "--steps", "3", "--seeds", "1", "--merge",
                                                str(earlier)]))
    assert [r["seed"] for r in runs] == [0, 0] and "commit abc" in lines[0]


def test_merge_only_keeps_seeds_with_every_trainers_run(tmp_path):
    """`--seeds` with no seed only compares the merged files; a seed whose file lacks one trainer's run (written
    while the runs went on) is left out and named."""
    lc = importlib.import_module("learning_curve")
    a = lc.parse_args(["--task", "tiny", "--steps", "3", "--seeds", "0"])
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"args": vars(a), "commit": "abc", "date": "today", "runs": [
        {"trainer": "trl", "seed": 0, "steps": []}, {"trainer": "infinite", "seed": 0, "steps": []},
        {"trainer": "trl", "seed": 1, "steps": []}]}))
    merge_only = lc.parse_args(["--task", "tiny", "--steps", "3", "--seeds", "--merge", str(part)])
    runs, lines = lc.merged_runs(merge_only)
    assert sorted((r["seed"], r["trainer"]) for r in runs) == [(0, "infinite"), (0, "trl")]
    assert "seeds [0]" in lines[0] and "left out, a trainer's run missing: [1]" in lines[0]
    with pytest.raises(SystemExit):
        lc.parse_args(["--task", "tiny", "--seeds"])


def run(trainer: str, seed: int, rewards: list[float], step_s: float = 1.0, lengths: list[float] | None = None) -> dict:
    steps = [{"step": i + 1, "reward": r, "wall_s": step_s, "cpu_s": step_s / 2} for i, r in enumerate(rewards)]
    for s, n in zip(steps, lengths or []):
        s["completions/mean_length"] = n
    return {"trainer": trainer, "seed": seed, "steps": steps}


def test_completion_lengths_are_compared_by_blocks_of_steps():
    stats = importlib.import_module("curve_stats")
    # 6 steps, blocks: step 1, steps 2-4, steps 5-6; ours 10 tokens shorter from step 2 on, same at step 1
    runs = [run("trl", s, [0.0] * 6, lengths=[50 + d, 50, 50, 50 + d, 40, 40 - d]) for s, d in enumerate((0, 2, -2))]
    runs += [run("infinite", s, [0.0] * 6, lengths=[50 - d, 40, 40, 40 + d, 30, 30]) for s, d in enumerate((1, 0, -1))]
    report = stats.compare_runs(runs, final_window=3, smooth=1, level=0.5, tolerance=0.15)
    blocks = report.data["length_blocks"]
    assert [b["steps"] for b in blocks] == ["1", "2-4", "5-6"]
    assert blocks[0]["trl"][0] == pytest.approx(50) and blocks[0]["infinite"][0] == pytest.approx(50)
    low, high = blocks[0]["welch95"][1:]
    assert low < 0 < high  # the same at step 1
    assert blocks[1]["welch95"][0] == pytest.approx(-10) and blocks[1]["welch95"][2] < 0  # shorter, and it shows
    assert "| 2-4 | 50.0 ± " in report.markdown and "| -10.0 |" in report.markdown
    # runs that logged no lengths: no table, no error
    report = stats.compare_runs([run("trl", 0, [0.0, 1.0]), run("infinite", 0, [0.0, 1.0])], 1, 1, 0.5, 0.15)
    assert report.data["length_blocks"] == [] and "completion length" not in report.markdown


def test_verdicts_and_time_to_level_on_known_curves():
    stats = importlib.import_module("curve_stats")
    # the same curves, ours twice as fast per step: equivalent, time ratio 0.5
    same = [run("trl", s, [0.0, 0.2 + d, 0.6 + d, 1.0 + d]) for s, d in enumerate((0.0, 0.02, -0.02))]
    same += [run("infinite", s, [0.0, 0.2 + d, 0.6 + d, 1.0 + d], 0.5) for s, d in enumerate((0.01, -0.01, 0.0))]
    report = stats.compare_runs(same, final_window=1, smooth=1, level=0.5, tolerance=0.15)
    assert report.data["final reward_verdict"]["verdict"] == "equivalent"
    # the level 0.5 is first reached at step 3 by every seed: 3 s for TRL, 1.5 s for ours
    assert report.data["wall_to_level_ratio"] == pytest.approx(0.5)
    assert report.data["trainers"]["trl"]["wall_to_level"] == [3.0, 3.0, 3.0]
    # ours learns nothing: different
    flat = [r for r in same if r["trainer"] == "trl"]
    flat += [run("infinite", s, [0.0, 0.0 + d, 0.01, 0.0 - d]) for s, d in enumerate((0.01, -0.01, 0.02))]
    report = stats.compare_runs(flat, final_window=1, smooth=1, level=0.5, tolerance=0.15)
    assert report.data["final reward_verdict"]["verdict"] == "different"
    assert report.data["trainers"]["infinite"]["wall_to_level"] == [None, None, None]
    assert report.data["wall_to_level_ratio"] is None
    # noisy seeds whose difference may or may not exceed the tolerance: inconclusive
    noisy = [run("trl", s, [0.0, v]) for s, v in enumerate((0.2, 0.9, 0.5))]
    noisy += [run("infinite", s, [0.0, v]) for s, v in enumerate((0.3, 1.0, 0.4))]
    report = stats.compare_runs(noisy, final_window=1, smooth=1, level=0.5, tolerance=0.15)
    assert report.data["final reward_verdict"]["verdict"] == "inconclusive"
    # a difference shown at 95% yet inside the tolerance: equivalent, and the line says the 95% interval excludes 0
    shifted = [run("trl", s, [0.0, v]) for s, v in enumerate((0.50, 0.52, 0.48, 0.51, 0.49))]
    shifted += [run("infinite", s, [0.0, v + 0.05]) for s, v in enumerate((0.50, 0.52, 0.48, 0.51, 0.49))]
    report = stats.compare_runs(shifted, final_window=1, smooth=1, level=0.5, tolerance=0.15)
    found = report.data["final reward_verdict"]
    assert found["verdict"] == "equivalent" and found["welch95"][1] > 0 and found["welch90"] == found["interval"]
    assert "95% interval excludes 0" in report.markdown
