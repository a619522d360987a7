"""`benchmarks/grpo_step.py` on a tiny random model: the worker's measurements are complete and consistent, forced
lengths reach every trainer's rollout and a missed one is an error, a killed worker becomes a failed row."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
TOL_S = 1e-3  # clock reads at the phase boundaries vs the step's (process_time resolution is ~1 us)
ARGS = ["--model", "tiny", "--sizes", "4x2@12", "--prompt-len", "8", "--steps", "2", "--mean", "6", "--device", "cpu",
        "--num-prompts", "8", "--rollout", "cpu_decode_kernel=False", "--rollout", "kv_cache_tokens=1024"]


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their `common` module by name


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left():
    """The in-process workers count FLOPs under a dispatch mode: a worker that raised left it on, and every later
    `torch.compile` in the test process found no frame to compile."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    yield
    assert _get_current_dispatch_mode() is None, "a FLOP counter's dispatch mode was left on"


def worker(kind: str, *extra: str) -> tuple[dict, object]:
    grpo_step = importlib.import_module("grpo_step")
    a = grpo_step.parse_args([*ARGS, *extra])
    return grpo_step.run_worker(a, kind, a.sizes[0]), a


def check_steps(result: dict, steps: int = 2) -> None:
    probes = importlib.import_module("grpo_probes")
    assert len(result["steps"]) == steps
    for s in result["steps"]:
        assert s["cpu_s"] > 0 and s["wall_s"] > 0
        for clock, total in (("phases_cpu", s["cpu_s"]), ("phases_wall", s["wall_s"])):
            phases = s[clock]
            assert set(phases) == set(probes.PHASES)
            assert all(v >= 0 for v in phases.values()), phases
            assert sum(phases.values()) <= total + TOL_S, (phases, total)
        # every phase ran: a rollout, a reward call, the loss forward, a backward, an optimizer step
        assert all(s["phases_cpu"][p] > 0 or s["phases_wall"][p] > 0 for p in probes.PHASES), s["phases_wall"]
        gen = s["inclusive_wall"]["_generate_and_score_completions"]
        assert s["phases_wall"]["rollout"] <= gen + TOL_S <= s["wall_s"] + 2 * TOL_S
        assert 0 < s["peak_rss_bytes"] <= result["process_peak_rss_bytes"]
        # the step's peak is the highest of its phases' peaks (the clock resets the mark at each boundary)
        assert set(s["phase_peak_rss"]) <= {*probes.PHASES, "other"}
        assert s["peak_rss_bytes"] == max(s["phase_peak_rss"].values())
        assert s["peak_cuda_bytes"] is None
    assert result["config"]["loss_type"] == "dapo" and result["config"]["beta"] == 0.0
    assert result["config"]["gradient_checkpointing"] is True and result["config"]["bf16"] is False


@pytest.mark.parametrize("kind, hook", [("trl", "generate"), ("infinite", "engine")])
def test_forced_lengths_reach_the_rollout(kind, hook):
    grpo_step = importlib.import_module("grpo_step")
    result, a = worker(kind, "--lengths", "forced")
    check_steps(result)
    assert result["forced_hooks"] == [hook]
    calls, _ = grpo_step.forced_calls(a, a.sizes[0])
    assert len(calls) == 2 and all(len(c) == 2 and all(len(g) == 4 for g in c) for c in calls)
    lengths = [n for c in calls for g in c for n in g]
    assert min(lengths) < max(lengths) <= 12  # drawn, clipped to max_completion_length
    for step, call in zip(result["steps"], calls):
        assert step["mean_len"] == pytest.approx(sum(map(sum, call)) / 8)
    row = grpo_step.make_row(a.sizes[0], kind, result, "cpu", None)
    named = sum(row[c] for c in grpo_step.PHASE_COLUMNS.values())
    assert row["other_s"] >= -TOL_S and row["cpu_s"] == pytest.approx(named + row["other_s"])
    assert row["peak_rss_GB"] > 0 and row["mean_len"] == result["steps"][1]["mean_len"]
    if kind == "infinite":
        assert row["engine"] == "yes"


def test_a_short_warm_up_step_leaves_the_measured_steps_at_their_length():
    grpo_step = importlib.import_module("grpo_step")
    result, a = worker("infinite", "--lengths", "forced", "--sigma", "0", "--mean", "24", "--warmup-length", "3")
    calls, source = grpo_step.forced_calls(a, a.sizes[0])
    assert calls[0] == [[3] * 4, [3] * 4] and calls[1] == [[12] * 4, [12] * 4] and "warm-up" in source
    assert [s["mean_len"] for s in result["steps"]] == [3, 12]
    row = grpo_step.make_row(a.sizes[0], "infinite", result, "cpu", None)
    assert row["mean_len"] == 12  # the row is the measured step's
    argv = grpo_step.worker_argv(a, "infinite", a.sizes[0], "/tmp/r.json")
    assert grpo_step.parse_args(argv[2:]).warmup_length == 3
    for bad in (["--warmup-length", "3"], ["--lengths", "forced", "--warmup-length", "0"]):
        with pytest.raises(SystemExit):
            grpo_step.parse_args([*ARGS, *bad])
    with pytest.raises(ValueError, match="exceeds"):
        grpo_step.forced_calls(grpo_step.parse_args([*ARGS, "--lengths", "forced", "--warmup-length", "13"]),
                               a.sizes[0])


def test_missed_forced_length_is_an_error(monkeypatch):
    probes = importlib.import_module("grpo_probes")
    monkeypatch.setattr(probes.ForcedLengths, "generate", lambda self, original: original)  # never forces
    with pytest.raises(RuntimeError, match="do not have their forced length"):
        worker("trl", "--lengths", "forced")


def test_rss_high_water_resets():
    probes = importlib.import_module("grpo_probes")
    if not probes.reset_rss_high_water():
        pytest.skip("/proc/self/clear_refs is not writable here")
    block = bytearray(300_000_000)  # touched: zero-filled by the allocator or the kernel on first write
    block[::4096] = b"x" * len(block[::4096])
    high = probes.rss_high_water_bytes()
    del block
    assert probes.reset_rss_high_water()
    assert probes.rss_high_water_bytes() < high - 200_000_000  # the mark now starts from the current RSS


def test_killed_worker_is_a_failed_row(tmp_path):
    grpo_step = importlib.import_module("grpo_step")
    argv = [sys.executable, "-c", "import os, signal; print('loading'); os.kill(os.getpid(), signal.SIGKILL)"]
    data = grpo_step.run_subprocess(argv, tmp_path / "none.json")
    assert data == {"error": "worker killed by SIGKILL (out of memory?)"}
    size = grpo_step.Size.parse("8x2@128")
    row = grpo_step.make_row(size, "infinite", data, "cpu", None)
    assert row["failed"] and row["note"].startswith("FAILED: worker killed by SIGKILL")
    result = tmp_path / "r.json"
    argv = [sys.executable, "-c", f"import json; open({str(result)!r}, 'w').write(json.dumps({{'error': 'boom'}})); "
            "raise SystemExit(1)"]
    assert grpo_step.run_subprocess(argv, result) == {"error": "boom"}
    argv = [sys.executable, "-c", "print('last words'); raise SystemExit(3)"]
    assert grpo_step.run_subprocess(argv, tmp_path / "none.json") == {
        "error": "worker exited with status 3: last words"}


def test_sizes_and_flags():
    grpo_step = importlib.import_module("grpo_step")
    a = grpo_step.parse_args([])
    assert [s.name for s in a.sizes] == ["8x2@128", "16x1@256", "32x1@256"]
    assert a.model == "smollm2" and a.trainers == ["trl", "trl_cb", "infinite"] and a.steps == 2 and a.threads == 1
    for bad in (["--sizes", "8x2"], ["--sizes", "1x2@128"], ["--steps", "1"], ["--trace", "t.jsonl"],
                ["--rollout", "max_active_sequences"], ["--option", "backward_token_budget"]):
        with pytest.raises(SystemExit):
            grpo_step.parse_args(bad)
    setup = importlib.import_module("grpo_setup")
    assert setup.parse_rollout_options(["max_active_sequences=8", "rollout_sampling_mode=fixed_slot"]) == {
        "rollout_max_active_sequences": 8, "rollout_sampling_mode": "fixed_slot"}
    assert setup.parse_rollout_options(["backward_token_budget=2048", "shared_prefix_training=False"], prefix="") == {
        "backward_token_budget": 2048, "shared_prefix_training": False}
    # the worker command carries every setting of the run
    a = grpo_step.parse_args([*ARGS, "--lengths", "forced", "--trace", "t.jsonl", "--cb-memory-percent", "0.1",
                              "--option", "backward_token_budget=64"])
    argv = grpo_step.worker_argv(a, "trl_cb", a.sizes[0], "/tmp/r.json")
    w = grpo_step.parse_args(argv[2:])
    same = ("model", "sizes", "steps", "lengths", "trace", "mean", "sigma", "prompt_len", "num_prompts", "device",
            "bf16", "weights_dtype", "threads", "seed", "cb_memory_percent", "rollout", "option", "phase_clock")
    assert all(getattr(w, k) == getattr(a, k) for k in same) and w.worker == "trl_cb"


def test_worker_writes_its_error(tmp_path, monkeypatch):
    grpo_step = importlib.import_module("grpo_step")
    result = tmp_path / "r.json"
    a = grpo_step.parse_args([*ARGS, "--worker", "trl", "--result", str(result)])
    monkeypatch.setattr(grpo_step, "run_worker", lambda *args: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(SystemExit):
        grpo_step.worker_main(a)
    assert json.loads(result.read_text())["error"] == "MemoryError: no room"


def test_trainers_run_in_the_order_given(tmp_path, monkeypatch):
    """`--trainers infinite trl` runs ours first (a time limit that cuts the run cuts GRPOTrainer, not ours), and our
    row still gets its ratios to GRPOTrainer once that row arrives; the JSON and markdown exist after the first row."""
    grpo_step = importlib.import_module("grpo_step")
    probes = importlib.import_module("grpo_probes")
    ran, seen_files = [], []
    cpu = {"infinite": 2.0, "trl": 8.0}

    def fake_worker(argv, result, env=None, tail=25):
        kind = argv[argv.index("--worker") + 1]
        seen_files.append((tmp_path / "g.json").exists() and (tmp_path / "g.md").exists())
        ran.append(kind)
        phases = dict.fromkeys(probes.PHASES, 0.1)
        step = {"cpu_s": cpu[kind], "wall_s": cpu[kind] / 2, "phases_cpu": phases, "phases_wall": phases,
                "inclusive_cpu": {}, "inclusive_wall": {}, "peak_rss_bytes": cpu[kind] * 1e9, "phase_peak_rss": {},
                "peak_cuda_bytes": None, "rss_end_bytes": 0, "mean_len": 6.0}
        return {"steps": [step, step], "process_peak_rss_bytes": 1e10, "uses_engine": kind == "infinite",
                "config": {}}

    monkeypatch.setattr(grpo_step, "run_subprocess", fake_worker)
    grpo_step.main([*ARGS, "--trainers", "infinite", "trl", "--json", str(tmp_path / "g.json")])
    assert ran == ["infinite", "trl"] and seen_files == [False, True]
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert [r["trainer"] for r in rows] == ["InfiniteGRPOTrainer", "GRPOTrainer"]
    assert rows[0]["x_trl_cpu"] == pytest.approx(0.25) and rows[0]["x_trl_wall"] == pytest.approx(0.25)
    assert rows[0]["x_trl_rss"] == pytest.approx(0.25) and rows[1]["x_trl_cpu"] == 1.0
    assert "| 4x2@12 | InfiniteGRPOTrainer |" in (tmp_path / "g.md").read_text()
    assert grpo_step.run_order(["trl", "infinite", "trl"]) == ["trl", "infinite"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
