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
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SUITE = BENCH / "gpu_suite.sh"
MAX_FILES = 8  # files one device call brings back from $OUT


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their `common` module by name


def plan_text(out: Path, *flags: str) -> str:
    done = subprocess.run(["bash", str(SUITE), str(out), "--plan", *flags], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    return done.stdout


def plan(out: Path, *flags: str) -> list[tuple[str, list[str]]]:
    """(part, argv) of every command the suite would run (the "# ..." lines are its limits and estimates)."""
    lines = [shlex.split(line) for line in plan_text(out, *flags).splitlines() if not line.startswith("#")]
    assert lines and all(line[0] == "PLAN" for line in lines), lines
    return [(line[1], line[2:]) for line in lines]


def test_scripts_are_valid_bash():
    for script in (SUITE, BENCH / "prepare_gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)


def _parse(argv: list[str], out: Path):
    """The parsed arguments of one planned command (argparse exits on an unknown flag); test files must exist."""
    if argv[0] == "env":  # env NAME=VALUE ... python3 ...
        argv = argv[next(i for i, a in enumerate(argv) if a == "python3"):]
    assert argv[0] == "python3"
    if argv[1:3] == ["-m", "pytest"]:
        tests = [a for a in argv if a.endswith(".py")]
        assert tests and all((ROOT / t).is_file() for t in tests)
        return None
    script = Path(argv[1])
    assert script.parent == Path("benchmarks") and (ROOT / script).is_file()
    args = importlib.import_module(script.stem).parse_args(argv[2:])
    assert args.json and Path(args.json).parent == out
    for test in getattr(args, "tests", []):  # parallel_pytest.py: files and node ids
        assert (ROOT / test.split("::")[0]).is_file(), test
    return args


@pytest.mark.parametrize("flags", [(), ("--dry-run",)], ids=["gpu", "dry_run"])
def test_every_command_parses(tmp_path, flags):
    commands = plan(tmp_path, "--part", "all", *flags)
    assert sorted({part for part, _ in commands}) == ["1", "2", "3"]
    outputs = []
    for part, argv in commands:
        args = _parse(argv, tmp_path)
        if args is not None:
            outputs.append((part, Path(args.json).name))
    names = [name for _, name in outputs]
    assert len(names) == len(set(names)) == 7  # every table has its own JSON (and .md)
    for part in "123":  # JSON + markdown per table and the part's log must come back from one device call
        assert 2 * sum(p == part for p, _ in outputs) + 1 <= MAX_FILES
    grpo = next(argv for _, argv in commands if "benchmarks/grpo_step.py" in argv)
    assert grpo[grpo.index("--trainers") + 1] == "infinite"  # ours first: a time limit cuts the last trainer


ONE_ORDER = ["preflight", "backends", "graphs", "decode_step", "rollout", "grpo_step", "profile"]
CPU_ONLY_TESTS = {"tests/engine/attention/test_triton_compile.py"}  # sm_90 compile without a GPU; inductor on the CPU


@pytest.mark.parametrize("flags", [(), ("--part", "one"), ("--part", "one", "--dry-run")],
                         ids=["default", "gpu", "dry_run"])
def test_one_call_plan(tmp_path, flags):
    """--part one (the default): the parts in the order that keeps what matters when a call is cut, every command
    parses, no CPU-only test file runs on the GPU, and the H100 estimates and the limits fit one 9-minute call."""
    text = plan_text(tmp_path, *flags)
    commands = plan(tmp_path, *flags)
    assert {part for part, _ in commands} == {"one"}
    heads = [line for line in text.splitlines() if line.startswith("# one ") and ": limit " in line]
    names = [line.split()[2].rstrip(":") for line in heads]
    assert names == ONE_ORDER and len(commands) == len(ONE_ORDER)
    est = [int(line.split("estimate ")[1].split()[0]) for line in heads]
    limits = [int(line.split("limit ")[1].split()[0]) for line in heads]
    assert all("on an H100 (from the two H100 runs)" in line for line in heads)
    total = next(line for line in text.splitlines() if line.startswith("# one total:"))
    assert f"estimate {sum(est)} s" in total and sum(est) <= 540
    if "--dry-run" not in flags:
        budget = int(total.split("part budget ")[1].split()[0])
        assert sum(limits) + 20 <= budget < 540 and f"limits {sum(limits)} s" in total
    argvs = dict(zip(names, (argv for _, argv in commands)))
    assert argvs["preflight"][1] == "benchmarks/preflight.py"
    rollout = argvs["rollout"]
    paths = rollout[rollout.index("--paths") + 1:]
    assert paths.index("engine") < paths.index("trl_generate")  # the engine row first
    grpo = argvs["grpo_step"]
    trainers = grpo[grpo.index("--trainers") + 1:grpo.index("--trainers") + 3]
    assert trainers == ["infinite", "trl"]
    profile = argvs["profile"]  # ours, at the grpo_step part's model and size
    assert profile[profile.index("--trainers") + 1:profile.index("--trainers") + 2] == ["infinite"]
    for flag in ("--model", "--sizes"):
        assert profile[profile.index(flag) + 1] == grpo[grpo.index(flag) + 1]
    tests = set()
    for name, argv in argvs.items():
        args = _parse(argv, tmp_path)
        tests |= {t.split("::")[0] for t in getattr(args, "tests", [])}
        if name == "graphs":
            assert args.collect_only == ("--dry-run" in flags) and args.no_skips
    assert tests == {"tests/engine/decode/test_cuda_graphs_gpu.py", "tests/engine/decode/test_static_decode.py"}
    assert not tests & CPU_ONLY_TESTS
    for _, argv in commands:  # a whole CPU-only file must not slip in through a node id either
        assert not any(a.split("::")[0] in CPU_ONLY_TESTS for a in argv)
    graphs = argvs["graphs"]
    assert "tests/engine/decode/test_static_decode.py::test_cuda_graphs_on_and_off_are_token_identical" in graphs


def test_bad_part_is_refused(tmp_path):
    for part in ("4", "two"):
        done = subprocess.run(["bash", str(SUITE), str(tmp_path), "--part", part], capture_output=True, text=True)
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
    done = _suite(tmp_path, fake, "--part", "all")
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


# a table command that writes its JSON and markdown (the --json argument), then runs `body`; "python3 -" (the suite's
# own folding of the outputs) runs the real interpreter
_WRITES = """if [ "$1" = - ]; then exec PYTHON_EXE "$@"; fi
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    if [ "${args[i]}" = --json ]; then
        j=${args[i + 1]}; s=$(basename "$j" .json)
        echo "{\\"table\\": \\"$s\\"}" > "$j"; printf '| table |\\n|---|\\n| %s |\\n' "$s" > "${j%.json}.md"
    fi
done
""".replace("PYTHON_EXE", shlex.quote(sys.executable))


def _writing_python(tmp_path: Path, body: str) -> Path:
    fake = tmp_path / "fake_python"
    fake.write_text("#!/usr/bin/env bash\n" + _WRITES + body + "\n")
    fake.chmod(0o755)
    return fake


def test_one_call_folds_each_part_as_it_ends(tmp_path):
    """--part one: each part's JSON goes into results.json and its markdown into tables.md as soon as it ends, so a
    later failure keeps the earlier tables, and OUTDIR holds 3 files (a device call returns at most 8)."""
    fake = _writing_python(tmp_path, 'case "$*" in *rollout_bench.py*) exit 5 ;; esac\nexit 0')
    done = _suite(tmp_path, fake, "--part", "one")
    assert done.returncode == 1, done.stdout[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["partone.log", "results.json", "tables.md"]
    results = json.loads((out / "results.json").read_text())
    assert list(results) == ONE_ORDER and all(results[k] == {"table": k} for k in ONE_ORDER)
    tables = (out / "tables.md").read_text()
    heads = [line.split()[1] for line in tables.splitlines() if line.startswith("## ")]
    assert heads == ONE_ORDER and "## rollout (FAILED rc=5," in tables and "| decode_step |" in tables
    log = (out / "partone.log").read_text()
    assert "rollout          FAILED rc=5" in log and "profile          ok" in log
    assert "gpu_suite part one: 1 of 7 tables FAILED" in log and "part one FAILED" in done.stderr


def test_one_call_stops_after_a_failed_preflight(tmp_path):
    """A preflight that fails (no CUDA, a Triton that cannot compile, ...) ends the call at once: nothing else runs,
    the summary says why, the suite fails."""
    fake = _writing_python(tmp_path, 'case "$*" in *preflight.py*) exit 1 ;; esac\necho ran "$*" >> ' +
                           shlex.quote(str(tmp_path / "ran")) + "\nexit 0")
    done = _suite(tmp_path, fake)  # --part one is the default
    assert done.returncode == 1
    assert not (tmp_path / "ran").exists()  # no table command ran
    log = (tmp_path / "out" / "partone.log").read_text()
    assert "preflight        FAILED rc=1" in log and log.count("NOT RUN (preflight failed)") == 6
    assert "preflight FAILED (exit 1)" in log and "=== graphs" not in log
    assert "## preflight (FAILED rc=1" in (tmp_path / "out" / "tables.md").read_text()


def test_one_call_goes_on_when_only_some_tables_miss_a_module(tmp_path):
    """Preflight exit 3 (trl, datasets or pytest missing): the other parts still run; the suite still fails."""
    fake = _writing_python(tmp_path, 'case "$*" in *preflight.py*) exit 3 ;; esac\nexit 0')
    done = _suite(tmp_path, fake, "--part", "one")
    assert done.returncode == 1
    log = (tmp_path / "out" / "partone.log").read_text()
    assert "preflight        FAILED rc=3" in log and "NOT RUN" not in log and "profile          ok" in log
    assert "1 of 7 tables FAILED" in log


def test_one_call_limits_shrink_to_the_budget(tmp_path):
    """A slow part eats the budget: the next parts get what is left, and those with under 30 s are skipped (62 s of
    budget - 20 s of margin - 15 s of graphs leaves at most 27 s after it; bash counts whole seconds)."""
    fake = _writing_python(tmp_path, 'case "$*" in *graphs.json*) sleep 15 ;; esac\nexit 0')
    done = _suite(tmp_path, fake, "--part", "one", PART_BUDGET="62")
    assert done.returncode == 1
    log = (tmp_path / "out" / "partone.log").read_text()
    assert "graphs           ok" in log and log.count("SKIPPED (part budget spent)") == 4


def test_preflight_reports_what_is_missing(tmp_path):
    """The preflight on the CPU (the dry run's): a missing module some tables need is exit 3 with the tables named;
    a missing module every table needs is exit 1."""
    for module, rc in (("trl", 3), ("triton", 1)):
        shadow = tmp_path / module
        shadow.mkdir(parents=True)
        (shadow / f"{module}.py").write_text("raise ImportError('planted: not installed')\n")
        out = tmp_path / f"{module}.json"
        env = {**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{ROOT}", "TRITON_INTERPRET": "1"}
        done = subprocess.run([sys.executable, str(BENCH / "preflight.py"), "--device", "cpu", "--json", str(out)],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == rc, done.stdout[-3000:] + done.stderr[-3000:]
        rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
        assert rows[f"import {module}"]["status"] == "FAILED" and "planted" in rows[f"import {module}"]["detail"]
        if module == "trl":
            assert "grpo_step" in rows["import trl"]["detail"]
            assert rows["triton kernel"]["status"] == "ok" and rows["cuda graph"]["status"] == "skipped"
        else:
            assert "triton kernel" not in rows  # nothing runs on a machine without what every table needs


def _wheel(folder: Path, dist: str, modules: list[str]) -> Path:
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    info = f"{dist}-1.0.dist-info"
    files = {f"{m}/__init__.py": "" for m in modules}
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n"
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_carried_wheels_never_replace_an_image_package(tmp_path):
    """install_wheels.py: a wheel whose distribution the interpreter has (pytest), or whose module already imports
    under another distribution name (json), is skipped; one the interpreter lacks is installed (--no-deps)."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "pytest", ["pytest"])
    _wheel(wheels, "jsonish_dist", ["json"])
    _wheel(wheels, "trl_infinite_test_absent", ["trl_infinite_test_absent"])
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, str(BENCH / "install_wheels.py"), str(wheels), str(target)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[1].rstrip(":"): line.split()[0] for line in done.stdout.splitlines()}
    assert lines == {"jsonish_dist-1.0-py3-none-any.whl": "skip", "pytest-1.0-py3-none-any.whl": "skip",
                     "trl_infinite_test_absent-1.0-py3-none-any.whl": "install"}, done.stdout
    assert (target / "trl_infinite_test_absent" / "__init__.py").is_file()
    assert not (target / "pytest").exists() and not (target / "json").exists()


def test_autotune_env_var_turns_autotuning_off():
    code = "from trl_infinite.engine.attention import triton_backend as t; print(t.AUTOTUNE)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "TRL_INFINITE_TRITON_AUTOTUNE": value, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert done.stdout.strip().splitlines()[-1] == expected, done.stderr[-2000:]


def _parallel(tmp_path: Path, source: str, *flags: str) -> tuple[int, dict]:
    (tmp_path / "test_planted.py").write_text(source)
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCH / "parallel_pytest.py"), "--jobs", "2", "--cwd", str(tmp_path),
                           "--json", str(out), *flags, "test_planted.py"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return done.returncode, json.loads(out.read_text())


def test_parallel_pytest_counts_and_fails(tmp_path):
    """parallel_pytest.py: the tests are dealt over the processes, every outcome is counted, a failure, a crashed
    process or (with --no-skips) a skip fails the run, and --collect-only runs nothing."""
    passing = "import os\nimport pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n"
    skip = "\ndef test_d():\n    pytest.skip('no GPU')\n"
    rc, result = _parallel(tmp_path, passing + skip)
    assert rc == 0 and result["result"].startswith("ok: 4 tests, 3 passed, 0 failed, 0 errors, 1 skipped")
    assert sorted(r["tests"] for r in result["rows"]) == [2, 2] and len(result["collected"]) == 4
    rc, result = _parallel(tmp_path, passing + skip, "--no-skips")
    assert rc == 1 and "skips not allowed" in result["result"]
    # ids a, b, c, e, f: shard 0 runs a, c, f (f kills its process: no report), shard 1 runs b, e (e fails)
    bad = passing + "\ndef test_e():\n    assert 1 == 2\n\ndef test_f():\n    os._exit(3)\n"
    rc, result = _parallel(tmp_path, bad)
    assert rc == 1 and [(r["failed"], r["errors"]) for r in result["rows"]] == [(0, 1), (1, 0)]
    assert "test_e" in result["rows"][1]["first_failure"] and "exited 3" in result["rows"][0]["first_failure"]
    rc, result = _parallel(tmp_path, bad, "--collect-only")
    assert rc == 0 and result["result"] == "collected only (dry run)" and len(result["collected"]) == 5
