"""`benchmarks/step_profile.py`: operators are charged to the innermost phase they start in, a phase's time is
exclusive of the phases inside it, and the classes of a single-threaded CPU profile add up to the phase's time; one
profiled step of a tiny model has every phase, with matrix products in the training phases."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
ARGS = ["--model", "tiny", "--sizes", "4x2@12", "--prompt-len", "8", "--steps", "2", "--mean", "6", "--device", "cpu",
        "--num-prompts", "8", "--lengths", "forced", "--rollout", "kv_cache_tokens=1024"]
REL = 0.02  # classes against the phase time in a real profile: the profiler's own events between ranges


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their `common` module by name


def test_attribution_is_exclusive_and_innermost():
    sp = importlib.import_module("step_profile")
    E = sp.Event
    events = [
        E("phase::other", 0, 100, 5),  # the step: 100 us, 40 of it in the rollout range
        E("phase::rollout", 10, 50, 4),  # 40 us, 10 of it in a reward range inside it
        E("phase::reward", 20, 30, 2),
        E("aten::mm", 12, 18, 6),  # rollout
        E("aten::linear", 11, 19, 2),  # rollout (its mm is counted by itself)
        E("aten::add", 22, 25, 3),  # reward
        E("aten::_scaled_dot_product_flash_attention_for_cpu", 31, 40, 9),  # rollout again, after the reward
        E("Optimizer.step#AdamW.step", 60, 70, 7),  # a user range: host time of `other`
        E("aten::mul", 61, 64, 3),  # other
        E("autograd::engine::evaluate_function: MmBackward0", 80, 90, 1),  # the autograd engine: host
        E("sm90_xmma_gemm_bf16", 13, 17, 0, device=True),  # a kernel in the rollout
        E("elementwise_kernel", 62, 63, 0, device=True),
    ]
    phases, tops = sp.attribute(events, top=1)
    assert phases["other"]["time_s"] == pytest.approx(60e-6)
    assert phases["rollout"]["time_s"] == pytest.approx(30e-6)
    assert phases["reward"]["time_s"] == pytest.approx(10e-6)
    assert phases["rollout"]["gemm_s"] == pytest.approx(8e-6)
    assert phases["rollout"]["attention_s"] == pytest.approx(9e-6)
    assert phases["rollout"]["host_s"] == pytest.approx(4e-6)
    assert phases["reward"]["other_ops_s"] == pytest.approx(3e-6)
    assert phases["other"]["host_s"] == pytest.approx((5 + 7 + 1) * 1e-6)
    assert phases["other"]["other_ops_s"] == pytest.approx(3e-6)
    assert phases["rollout"]["gpu_gemm_s"] == pytest.approx(4e-6)
    assert phases["rollout"]["gpu_idle_s"] == pytest.approx(26e-6)
    assert phases["other"]["gpu_other_s"] == pytest.approx(1e-6)
    # one operator per phase and place (cpu, gpu), the largest
    assert [(t["where"], t["op"]) for t in tops["rollout"]] == [
        ("cpu", "aten::_scaled_dot_product_flash_attention_for_cpu"), ("gpu", "sm90_xmma_gemm_bf16")]
    assert tops["rollout"][0]["share"] == pytest.approx(9 / 30)


def test_self_times_subtract_the_calls_directly_inside():
    sp = importlib.import_module("step_profile")
    # a [0, 10] holds b [1, 6] (which holds c [2, 3]) and d [6, 9]; e [12, 13] stands alone; f equals d's span
    spans = [(0, 10), (1, 6), (2, 3), (6, 9), (12, 13), (6, 9)]
    assert sp.self_times(spans) == [10 - 5 - 3, 5 - 1, 1, 3 - 3, 1, 3]


def test_op_classes():
    sp = importlib.import_module("step_profile")
    assert sp.op_class("aten::addmm") == "gemm"
    assert sp.op_class("aten::_scaled_dot_product_efficient_attention_backward") == "attention"
    assert sp.op_class("aten::silu") == "other"
    assert sp.op_class("nvjet_tst_128x64_64x6_1x1_v_bz_coopA_TNT", device=True) == "gemm"
    assert sp.op_class("flash_fwd_kernel<...>", device=True) == "attention"
    assert sp.op_class("vectorized_elementwise_kernel<4, ...>", device=True) == "other"
    assert sp.op_class("cutlass3x_sm90_tensorop_s64x128x16gemm_bf16_bf16", device=True) == "gemm"
    assert sp.op_class("gemv2T_kernel_val<int, int, float, float, 128, 16>", device=True) == "gemm"
    assert sp.op_class("sm90_reduce_kernel<float>", device=True) == "other"  # an architecture prefix alone


@pytest.mark.parametrize("only", [None, ("forward", "backward")])
def test_one_profiled_step_of_a_tiny_model(only):
    sp = importlib.import_module("step_profile")
    a = sp.parse_args(ARGS)
    a.top, a.phases = 3, only
    result = sp.run_worker(a, "infinite", a.sizes[0])
    phases = result["phases"]
    want = {"rollout", "reward", "forward", "backward", "optim", "other"} if only is None else set(only)
    assert set(phases) - {"outside"} == want
    assert phases.get("outside", {}).get("time_s", 0.0) == 0.0  # no phase range: no time of its own
    assert result["uses_engine"] is True
    for name, row in phases.items():
        if name == "outside":
            continue
        parts = sum(row.get(c, 0.0) for c in sp.CLASS_COLUMNS)
        assert row["time_s"] > 0 and parts == pytest.approx(row["time_s"], rel=REL, abs=2e-4), (name, row)
    for name in want & {"rollout", "forward", "backward"}:
        assert phases[name]["gemm_s"] > 0, name
        assert 0 < len(result["tops"][name]) <= 3


def test_the_script_profiles_each_trainer_in_its_own_process(tmp_path):
    """The parent runs one worker per trainer (here ours, only two phases) and writes both tables."""
    import json
    import subprocess
    import sys

    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(BENCH / "step_profile.py"), *ARGS, "--trainers", "infinite",
                           "--phases", "forward", "backward", "--top", "2", "--json", str(out)],
                          capture_output=True, text=True, cwd=BENCH, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["phase"] for r in data["rows"]] == ["forward", "backward"]
    assert all(r["trainer"] == "InfiniteGRPOTrainer" and r["gemm_s"] > 0 for r in data["rows"])
    assert {t["phase"] for t in data["top"]} == {"forward", "backward"} and len(data["top"]) == 4
    assert "phases forward, backward only" in data["profiled"]
    assert "## Top operators" in out.with_suffix(".md").read_text()
