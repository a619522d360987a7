"""How `grpo_step.py`'s parent runs a worker process and reads its JSON back (a failed or killed worker is a reason,
never a crash of the parent)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

_CURRENT: list[subprocess.Popen] = []  # the running worker, ended if this process is told to stop


def run_subprocess(argv: list[str], result: Path, env: dict | None = None, tail: int = 25) -> dict:
    """Runs one worker, relaying its output to stderr; returns its JSON, or {"error": reason} when it failed."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            errors="replace")
    _CURRENT.append(proc)
    last = deque(maxlen=tail)
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            last.append(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        _CURRENT.remove(proc)
    data = None
    if result.is_file() and result.stat().st_size:
        try:
            data = json.loads(result.read_text())
        except json.JSONDecodeError:
            data = None
    if rc == 0 and data is not None and "error" not in data:
        return data
    if data is not None and "error" in data:
        return {"error": data["error"]}
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (out of memory?)" if -rc == signal.SIGKILL else ""
        return {"error": f"worker killed by {name}{hint}"}
    reason = next((x for x in reversed(last) if x.strip()), "no output")
    return {"error": f"worker exited with status {rc}: {reason}"}


def _stop_worker(signum, frame):
    for proc in list(_CURRENT):
        proc.kill()
    raise SystemExit(128 + signum)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None
