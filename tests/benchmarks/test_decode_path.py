"""`benchmarks/decode_path.py`: the frames one decode step walks between `RolloutEngine.generate` and the model's
forward, per path (issue 41: at most 8 for a decode step). On main before the decode-step protocol: static 9, eager
8, speculative 11, graph capture 14."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MOST = {"static": 7, "eager": 7, "speculative": 8, "graphs": 12}  # graphs: the step capturing a bucket's graph


@pytest.fixture(scope="module")
def measured():
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        bench = importlib.import_module("decode_path")
        return {name: bench.summary(bench.decode_path(name)) for name in MOST}
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("name", list(MOST))
def test_decode_step_frames(measured, name):
    s = measured[name]
    assert s["frames"] <= MOST[name], "\n".join(s["path"])
    assert s["path"][-1].startswith("run (") and "model_runner" in s["path"][-1]  # the runner calls the model


def test_static_step_path_is_launch_step_forward(measured):
    """Below the executor: the static step's launch, the step function and the runner (no dispatch frame)."""
    assert [p.split(" ")[0] for p in measured["static"]["path"][-4:]] == ["launch", "launch", "_step", "run"]
