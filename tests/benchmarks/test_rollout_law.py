"""`benchmarks/rollout_law.py`: the two trainers' rollouts compared sample by sample (smoke run on a tiny random
model; the tests themselves on hand-made samples whose law is known)."""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def draw(rng: random.Random, n: int, p_eos: float, max_len: int = 32, eos: int = 0) -> list[list[int]]:
    """n completions: each token EOS with probability p_eos (then the completion ends), else a token in 1..20."""
    out = []
    for _ in range(n):
        c = []
        while len(c) < max_len:
            c.append(eos if rng.random() < p_eos else rng.randint(1, 20))
            if c[-1] == eos:
                break
        out.append(c)
    return out


def test_same_law_passes_and_a_shifted_law_is_found():
    law = importlib.import_module("rollout_law")
    a = law.parse_args(["--prompts", "2", "--samples", "400", "--batch", "40"])
    rng = random.Random(0)
    same = {"infinite": {"samples": [draw(rng, 400, 0.05) for _ in range(2)]},
            "trl": {"samples": [draw(rng, 400, 0.05) for _ in range(2)], "eos": [0]}}
    _, data = law.report(a, same)
    assert data["differs"] == [] and data["threshold"] == pytest.approx(0.01 / 8)
    low, high = data["pooled_length_diff"][1:]
    assert low < 0 < high
    # EOS twice as likely on prompt 1: shorter completions, fewer cut at the maximum
    shifted = {"infinite": {"samples": [same["infinite"]["samples"][0], draw(rng, 400, 0.10)]}, "trl": same["trl"]}
    markdown, data = law.report(a, shifted)
    assert {k for i, k in data["differs"] if i == 1} >= {"length_welch", "cut_fisher"}
    assert all(i == 1 for i, _ in data["differs"]) and "different: prompt 1" in markdown


def test_bad_arguments_are_refused():
    law = importlib.import_module("rollout_law")
    for bad in (["--samples", "30", "--batch", "16"], ["--prompts", "0"], ["--alpha", "1"]):
        with pytest.raises(SystemExit):
            law.parse_args(bad)


def test_smoke_run_writes_the_table(tmp_path):
    out = tmp_path / "law.json"
    cmd = [sys.executable, str(BENCH / "rollout_law.py"), "--task", "tiny", "--prompts", "1", "--samples", "32",
           "--batch", "16", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [len(data["samples"][k][0]) for k in ("trl", "infinite")] == [32, 32]
    assert data["samples"]["trl"][0] != data["samples"]["infinite"][0]  # two samplers, not one result twice
    assert "| 0 |" in out.with_suffix(".md").read_text() and "verdict at family-wise 0.01" in proc.stdout
