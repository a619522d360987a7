"""`benchmarks/weight_copy.py` on the tiny model: both modes measured, the copy's row runs on a copy, the same tokens."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_weight_copy_bench_rows(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its `common` module by name
    bench = importlib.import_module("weight_copy")
    out = tmp_path / "wc.json"
    bench.main(["--model", "tiny", "--active", "2", "--new-tokens", "4", "--repeats", "1", "--json", str(out)])
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"off", "auto"}
    assert rows["off"]["copy_MB"] == 0 and rows["auto"]["copy_MB"] > 0
    assert all(r["same_tokens"] and r["steps"] == 3 for r in rows.values())
