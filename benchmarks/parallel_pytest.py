"""Runs pytest test files as parallel pytest processes (no pytest-xdist needed) and writes one table of the outcome:
the GPU suite's correctness parts (`gpu_suite.sh --part one`: CUDA graphs on/off identity, the kernels against the
torch reference).

The tests are collected once (`pytest --collect-only -q`), dealt round-robin into `--jobs` shards (file by file, so
each shard gets a share of every file's tests and of its compilations), and each shard runs as its own
`python -m pytest -p no:cacheprovider --junitxml=...` process. The table has one row per shard (passed, failed,
errors, skipped, seconds) and the JSON also every test's outcome and time. Exit 1 when any test failed or errored,
when nothing ran, or with `--no-skips` when any test was skipped (a GPU check that skips is a check that did not
happen). `--collect-only`: collect and shard, run nothing (the suite's dry run).

    python benchmarks/parallel_pytest.py --jobs 4 --json OUT/kernels.json tests/engine/attention/test_triton_attention.py
    python benchmarks/parallel_pytest.py --jobs 2 --no-skips --json OUT/graphs.json \
        tests/engine/decode/test_cuda_graphs_gpu.py "tests/engine/decode/test_static_decode.py::test_cuda_graphs_on_and_off_are_token_identical"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["shard", "tests", "passed", "failed", "errors", "skipped", "seconds", "first_failure"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tests", nargs="+", help="test files or node ids, as pytest takes them")
    p.add_argument("--jobs", type=int, default=4, help="parallel pytest processes")
    p.add_argument("--no-skips", action="store_true", help="a skipped test fails the run")
    p.add_argument("--collect-only", action="store_true", help="collect and shard only (dry run)")
    p.add_argument("--json", default=None, help="write the result as JSON (and the table as .md) here")
    p.add_argument("--cwd", default=str(ROOT), help="where pytest runs (default: the repository root)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for the whole run: a shard still running then is killed and reported (its output so "
                        "far printed); a test running longer than half of it dumps every thread's stack "
                        "(pytest's faulthandler_timeout), so a hang shows where it is")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error("--jobs must be >= 1")
    return a


def collect(tests: list[str], cwd: str) -> list[str]:
    """Node ids of every test `tests` selects, in pytest's order."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                          capture_output=True, text=True, cwd=cwd)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode != 0 or not ids:
        raise SystemExit(f"collection failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return ids


def shard(ids: list[str], jobs: int) -> list[list[str]]:
    """Round-robin over the ids in collection order (a file's tests are spread over every shard); no empty shard."""
    shards = [ids[k::jobs] for k in range(jobs)]
    return [s for s in shards if s]


def outcomes(junit: Path) -> list[dict]:
    """Every test case of a junit XML: node-ish name, outcome, seconds, message."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[tag]
                message = (child.get("message") or "")[:300]
                break
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
    return cases


def run_shards(shards: list[list[str]], tmp: Path, cwd: str, timeout: float | None = None) -> list[dict]:
    procs = []
    start = time.perf_counter()
    hang = ["-o", f"faulthandler_timeout={max(int(timeout / 2), 1)}"] if timeout else []
    for k, ids in enumerate(shards):
        junit, log = tmp / f"shard{k}.xml", tmp / f"shard{k}.log"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-rfEs", *hang,
                *ids]
        procs.append((k, junit, log, time.perf_counter(), subprocess.Popen(
            argv, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT)))
    rows = []
    for k, junit, log, t0, proc in procs:
        try:
            rc = proc.wait(timeout=None if timeout is None else max(timeout - (time.perf_counter() - start), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            print(f"--- shard {k} KILLED after the run's {timeout:.0f} s (its output so far below)", flush=True)
        seconds = time.perf_counter() - t0
        text = log.read_text(errors="replace")
        print(f"--- shard {k} (exit {rc}, {seconds:.1f} s)\n{text[-6000:]}", flush=True)
        cases = outcomes(junit) if junit.is_file() else []
        row = {"shard": k, "tests": len(cases), "seconds": seconds, "exit": rc, "cases": cases}
        for outcome in ("passed", "failed", "errors", "skipped"):
            row[outcome] = sum(c["outcome"] == outcome for c in cases)
        bad = [c for c in cases if c["outcome"] in ("failed", "errors")]
        row["first_failure"] = f"{bad[0]['test']}: {bad[0]['message']}"[:200] if bad else None
        if rc not in (0, 1, 5) or (rc == 1 and not bad) or not junit.is_file():  # crashed or killed, not a failure
            row["errors"] += 1
            row["first_failure"] = f"pytest exited {rc}: {text.strip().splitlines()[-1:] or 'no output'}"[:200]
        rows.append(row)
    return rows


def write(path: str | None, header: dict, rows: list[dict], extra: dict) -> None:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else ("-" if r.get(c) is None else str(r[c]))
                 for c in COLUMNS]
        lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    text = "\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**header, **extra, "rows": rows}, indent=1))
        Path(path).with_suffix(".md").write_text(text)


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    ids = collect(a.tests, a.cwd)
    shards = shard(ids, a.jobs)
    header = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": "python " + " ".join(
        sys.argv), "tests": f"{len(ids)} collected from {' '.join(a.tests)}", "shards": len(shards),
        "env": " ".join(f"{k}={os.environ[k]}" for k in ("TRL_INFINITE_TRITON_AUTOTUNE", "TRITON_INTERPRET",
                                                          "CUDA_VISIBLE_DEVICES") if k in os.environ) or "-"}
    try:
        from common import git_commit

        header["commit"] = git_commit()
    except Exception:  # noqa: BLE001 - the commit is a label, not a requirement
        header["commit"] = "unknown"
    if a.collect_only:
        rows = [{"shard": k, "tests": len(s), "passed": None, "failed": None, "errors": None, "skipped": None,
                 "seconds": None, "first_failure": None, "ids": s} for k, s in enumerate(shards)]
        header["result"] = "collected only (dry run)"
        write(a.json, header, rows, {"collected": ids})
        return 0
    with tempfile.TemporaryDirectory(prefix="parallel_pytest_") as tmp:
        rows = run_shards(shards, Path(tmp), a.cwd,
                          None if a.timeout is None else a.timeout - (time.perf_counter() - t0))  # (collection counted)
    total = {k: sum(r[k] for r in rows) for k in ("tests", "passed", "failed", "errors", "skipped")}
    bad = total["failed"] + total["errors"] > 0 or total["passed"] == 0 or (a.no_skips and total["skipped"] > 0)
    header["result"] = ("FAILED: " if bad else "ok: ") + ", ".join(f"{v} {k}" for k, v in total.items()) + \
        f" in {time.perf_counter() - t0:.0f} s" + (" (skips not allowed)" if a.no_skips and total["skipped"] else "")
    write(a.json, header, rows, {"collected": ids})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
