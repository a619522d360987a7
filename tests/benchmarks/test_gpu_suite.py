"""The GPU suite's commands parse (every flag exists, at full and toy sizes) and one benchmark runs at toy size.

The suite itself runs only on a GPU machine; `benchmarks/gpu_suite.sh --plan` prints its commands without running
them, so a typo in a flag fails here instead of on the GPU.
"""

from __future__ import annotations

import importlib
import json
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
