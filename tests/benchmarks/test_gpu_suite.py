"""The GPU suite's commands parse (every flag exists, at full and toy sizes), one benchmark runs at toy size, and the
suite fails loudly: a failed table (planted through its PYTHON), a failed setup or a table past the part's time
budget makes it exit 1.

The suite itself runs only on a GPU machine; `benchmarks/gpu_suite.sh --plan` prints its commands without running
them, so a typo in a flag fails here instead of on the GPU.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SUITE = BENCH / "gpu_suite.sh"
MAX_FILES = 8  # files one device call brings back from $OUT


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their `common` module by name


def plan(out: Path, *flags: str) -> list[tuple[str, list[str]]]:
    """(part, argv) of every command the suite would run."""
    done = subprocess.run(["bash", str(SUITE), str(out), "--plan", *flags], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    lines = [shlex.split(line) for line in done.stdout.splitlines()]
    assert lines and all(line[0] == "PLAN" for line in lines), done.stdout
    return [(line[1], line[2:]) for line in lines]


def test_scripts_are_valid_bash():
    for script in (SUITE, BENCH / "prepare_gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("flags", [(), ("--dry-run",)], ids=["gpu", "dry_run"])
def test_every_command_parses(tmp_path, flags):
    commands = plan(tmp_path, *flags)
    assert sorted({part for part, _ in commands}) == ["1", "2", "3"]
    outputs = []
    for part, argv in commands:
        assert argv[0] == "python3"
        if argv[1:3] == ["-m", "pytest"]:
            tests = [a for a in argv if a.endswith(".py")]
            assert tests and all((ROOT / t).is_file() for t in tests)
            continue
        script = Path(argv[1])
        assert script.parent == Path("benchmarks") and (ROOT / script).is_file()
        args = importlib.import_module(script.stem).parse_args(argv[2:])  # argparse exits on an unknown flag
        assert args.json and Path(args.json).parent == tmp_path
        outputs.append((part, Path(args.json).name))
    names = [name for _, name in outputs]
    assert len(names) == len(set(names)) == 7  # every table has its own JSON (and .md)
    for part in "123":  # JSON + markdown per table and the part's log must come back from one device call
        assert 2 * sum(p == part for p, _ in outputs) + 1 <= MAX_FILES


def test_bad_part_is_refused(tmp_path):
    done = subprocess.run(["bash", str(SUITE), str(tmp_path), "--part", "4"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_decode_step_toy_run(tmp_path):
    """The decode-step benchmark end to end on a tiny model: every decode step is counted, JSON and markdown out."""
    decode_step = importlib.import_module("decode_step")
    out = tmp_path / "decode_step.json"
    decode_step.main(["--model", "tiny", "--device", "cpu", "--active", "2", "--prompt-len", "8", "--new-tokens", "4",
                      "--eager-active", "--kv-cache-gb", "0.001", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["active"], r["sharing"]) for r in result["rows"]] == [(2, "cascade"), (2, "no_share")]
    # 4 tokens per sample: the first comes from the prefill, then 3 decode steps with both samples
    assert all(r["steps"] == 3 and r["step_ms"] > 0 for r in result["rows"])
    assert result["rows"][0]["kv_GB"] == result["rows"][1]["kv_GB"]  # torch backend on CPU: nothing shared
    assert "| tiny | 2 | 8 | cascade |" in out.with_suffix(".md").read_text()
    assert result["device"].startswith("CPU") and result["commit"]


def test_commit_without_git_reads_the_stamp(monkeypatch, tmp_path):
    common = importlib.import_module("common")
    monkeypatch.setattr(common, "REPO", tmp_path)  # no .git there
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert common.git_commit() == "unknown"
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "COMMIT").write_text("abc1234\n")
    assert common.git_commit() == "abc1234 (from .whl/COMMIT)"
    monkeypatch.setenv("BENCH_COMMIT", "def5678")
    assert common.git_commit() == "def5678"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An interpreter for the suite (its PYTHON): the version report (`python3 - <<EOF`) succeeds without importing
    anything, `body` (bash, "$*" = the arguments) runs for every table command."""
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = - ]; then cat >/dev/null; echo fake; exit 0; fi\n{body}\n')
    fake.chmod(0o755)
    return fake


def _suite(tmp_path: Path, fake: Path, *flags: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUITE), str(tmp_path / "out"), "--dry-run", *flags], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHON": str(fake), **env}, timeout=300)


def test_suite_fails_loudly_on_a_planted_failure(tmp_path):
    """One table of part 1 fails (a planted exit 3): the other tables still run, the summary names the failure, the
    other parts run, and the suite exits 1 (it used to exit 0 whatever happened)."""
    fake = _fake_python(tmp_path, 'case "$*" in *attention_bench.py*) echo planted >&2; exit 3 ;; esac\nexit 0')
    done = _suite(tmp_path, fake)
    assert done.returncode == 1, done.stdout[-2000:]
    log = (tmp_path / "out" / "part1.log").read_text()
    assert "attention        FAILED rc=3" in log and "kernels          ok" in log and "decode_step      ok" in log
    assert "gpu_suite part 1: 1 of 3 tables FAILED" in log
    assert "part 1 FAILED" in done.stderr and "part 2 FAILED" not in done.stderr
    assert "gpu_suite part 3: all 3 tables ok" in (tmp_path / "out" / "part3.log").read_text()


def test_suite_exits_0_when_every_table_passes(tmp_path):
    done = _suite(tmp_path, _fake_python(tmp_path, "exit 0"), "--part", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "gpu_suite part 2: all 2 tables ok" in (tmp_path / "out" / "part2.log").read_text()


def test_suite_stops_a_part_whose_setup_fails(tmp_path):
    """set -e: the version report fails (no torch, say): the part stops before any table, and the suite fails."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/usr/bin/env bash\nexit 7\n")
    fake.chmod(0o755)
    done = _suite(tmp_path, fake, "--part", "1")
    assert done.returncode == 1 and "part 1 FAILED (exit 7)" in done.stderr
    assert "=== kernels" not in (tmp_path / "out" / "part1.log").read_text()


def test_tables_past_the_part_budget_are_skipped_and_fail(tmp_path):
    """A part keeps under PART_BUDGET seconds (530 by default: 9 minutes with margin): tables with less than 30 s
    left are skipped, and a skip fails the suite."""
    done = _suite(tmp_path, _fake_python(tmp_path, "exit 0"), "--part", "3", PART_BUDGET="40")
    assert done.returncode == 1
    log = (tmp_path / "out" / "part3.log").read_text()
    assert log.count("SKIPPED (part budget spent)") == 3 and "3 of 3 tables FAILED" in log


def test_full_size_limits_fit_the_part_budget():
    text = SUITE.read_text()
    limits = [int(x) for x in text.split("LIMITS=(")[1].split(")")[0].split()]
    parts = {"1": limits[0:3], "2": limits[3:5], "3": limits[5:8]}
    budget = int(text.split("PART_BUDGET=${PART_BUDGET:-")[1].split("}")[0])
    assert budget < 540 and all(sum(v) + 30 <= budget for v in parts.values()), parts
