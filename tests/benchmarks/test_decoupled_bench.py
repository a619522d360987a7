"""`benchmarks/decoupled.py`'s modes: the planned ones and the forced ones of `--forced-windows` map to the engine
configurations they name (a forced mode speculates at every step with its own window, whatever the timings)."""

from __future__ import annotations

import importlib
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ARGS = Namespace(drafter="suffix", num_tokens=5, kv_tokens=4096)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their `common` module by name
    return importlib.import_module("decoupled")


def spec(cfg):
    s = cfg.speculative
    return None if s is None else (s.method, s.decoupled, s.adaptive, s.num_tokens, s.draft_window)


def test_planned_modes_use_the_adaptive_controller_and_the_plan(bench):
    assert spec(bench.engine_config(ARGS, "none", 8, None)) == (None, False, True, 5, None)
    assert spec(bench.engine_config(ARGS, "coupled", 8, None)) == ("suffix", False, True, 5, None)
    assert spec(bench.engine_config(ARGS, "decoupled", 8, None)) == ("suffix", True, True, 5, None)


@pytest.mark.parametrize("window", [1, 3])
def test_a_forced_mode_speculates_at_every_step_with_its_own_window(bench, window):
    assert bench.forced_mode(f"coupled-w{window}") == ("coupled", window)
    assert bench.forced_mode("decoupled") == ("decoupled", None)
    assert spec(bench.engine_config(ARGS, f"coupled-w{window}", 64, None)) == ("suffix", False, False, window, None)
    assert spec(bench.engine_config(ARGS, f"decoupled-w{window}", 64, None)) == \
        ("suffix", True, False, window, window)


def test_forced_keeps_the_num_tokens_window_for_the_lossless_check(bench):
    cfg = bench.engine_config(ARGS, "decoupled", 8, None, forced=True)  # `decoupled_lossless.py`
    assert spec(cfg) == ("suffix", True, False, 5, 5)


def test_paired_ratio_is_the_median_of_the_per_repetition_ratios(bench):
    assert bench.paired_ratio([2.0, 3.0, 4.0], [2.0, 2.0, 2.0]).startswith("1.500 [1.000, 2.000]")
