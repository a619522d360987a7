"""The GRPO step's cost against the work (issue 43): `grpo_step.py`'s workers (each trainer in its own process, the
same config, prompts and seed) at forced identical completion lengths, over G and over the completion length.

Points (`--points G@L`, one prompt per step, every completion exactly L tokens: `--lengths forced` with log-normal
mean 2L and sigma 0, clipped to L): by default G = 8, 16, 32, 64 at 256 new tokens and 256 / 1,024 / 4,096 new tokens
at G = 8 (8@256 is shared), run in the order of their completion tokens (the largest last), ours first at each
point, so a run cut short loses the largest points of `GRPOTrainer` first.

Columns (per point and trainer, the measured steps after the warm-up):
- `tokens`: completion tokens per step (G x L); `step_s`: the step's time (CPU seconds on CPU, synchronised wall on
  CUDA, as `grpo_step.py`'s phase clock); `ms_per_token` = step_s / tokens x 1000; `x_g8` = ms_per_token over the
  same trainer's at the sweep's first point of the same axis (1.0 = flat as the work grows);
- `peak_GB`: peak RSS of the measured step on CPU (VmHWM), peak CUDA memory (`max_memory_allocated`) on CUDA;
- `x_trl_time`, `x_trl_mem`: ours over `GRPOTrainer`'s at the same point; `x_floor`: step time over the step's floor
  (`floor_table.py`); `run_s`: wall seconds of the whole worker (load, the steps, the floor's GEMM timing).
A second table (`memory_terms.py`) splits our measured phase peaks into the terms that explain them (KV, the host
cache, gradients, one backward slice, the log-prob tiles). The PNG (`--png`, matplotlib) plots ms per completion
token and peak memory against G and against L, both trainers.

A worker runs `--steps` steps (default 2), the first a warm-up; `--warmup-length N` (grpo_step's) makes the warm-up
step's completions N tokens, so a long point pays one full-size step, not two.

    python benchmarks/grpo_scaling.py --json /tmp/scaling.json --png benchmarks/grpo_scaling.png   # CPU: hours
    python benchmarks/grpo_scaling.py --points 8@256 8@1024 8@4096 --warmup-length 16 --json /tmp/length.json
    python benchmarks/grpo_scaling.py --model tiny --points 2@4 4@4 2@8 --prompt-len 8 --png /tmp/s.png   # smoke
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpo_step
from common import Table, pick_device, save_json, write_results
from floor_table import floor_rows, machine_memory_bytes
from memory_terms import COLUMNS as MEMORY_COLUMNS
from memory_terms import memory_rows

DEFAULT_POINTS = ("8@256", "16@256", "32@256", "64@256", "8@1024", "8@4096")
COLUMNS = ["G", "L", "trainer", "tokens", "step_s", "ms_per_token", "x_first", "peak_GB", "x_trl_time", "x_trl_mem",
           "x_floor", "run_s", "note"]


def parse_point(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)@(\d+)", text)
    if m is None or int(m.group(1)) < 2 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"a point is G@L with G >= 2, L >= 1 (e.g. 8@256), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", nargs="+", type=parse_point, default=[parse_point(x) for x in DEFAULT_POINTS])
    p.add_argument("--trainers", nargs="+", default=["infinite", "trl"], choices=list(grpo_step.TRAINERS))
    p.add_argument("--png", default=None, help="write the plot here (matplotlib)")
    p.add_argument("--json", default=None, help="write the rows as JSON (and the table as .md) here")
    a, rest = p.parse_known_args(argv)  # the rest goes to grpo_step (--model, --steps, --threads, --rollout, ...)
    return a, rest


def ordered(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each point once, by completion tokens (G x L), the largest last."""
    return sorted(dict.fromkeys(points), key=lambda p: (p[0] * p[1], p[1]))


def step_args(rest: list[str], G: int, L: int) -> argparse.Namespace:
    """grpo_step's arguments of one point: one prompt per step, every completion exactly L tokens."""
    return grpo_step.parse_args([*rest, "--sizes", f"{G}x1@{L}", "--lengths", "forced", "--mean", str(2 * L),
                                 "--sigma", "0"])


def scaling_row(G: int, L: int, kind: str, data: dict, clock: str, budget: float, run_s: float) -> dict:
    size = grpo_step.Size(G, 1, L)
    row = grpo_step.make_row(size, kind, data, clock, None)
    out = {"G": G, "L": L, "trainer": grpo_step.TRAINERS[kind], "tokens": G * L, "run_s": run_s}
    if row.get("failed"):
        return {**out, "note": row["note"], "failed": True}
    floor_rows(size.name, out["trainer"], data, row, clock, budget)
    step_s = row["cpu_s" if clock == "cpu" else "wall_s"]
    peak = row["peak_cuda_GB"] if row.get("peak_cuda_GB") is not None else row["peak_rss_GB"]
    if row["mean_len"] is not None and abs(row["mean_len"] - L) > 1e-6:
        raise RuntimeError(f"{G}@{L} {out['trainer']}: mean length {row['mean_len']}, forced {L}")
    return {**out, "step_s": step_s, "ms_per_token": 1000 * step_s / (G * L), "peak_GB": peak,
            "x_floor": row.get("x_floor"), "cpu_s": row["cpu_s"], "wall_s": row["wall_s"],
            "peak_rss_GB": row["peak_rss_GB"], "peak_cuda_GB": row.get("peak_cuda_GB"), "floor_data": row.get("floor_data"),
            "all_steps": row.get("all_steps")}


def add_relative(rows: list[dict]) -> None:
    """`x_first` against the same trainer's first point on each axis (G at the smallest L, L at the smallest G);
    `x_trl_*` against GRPOTrainer's row of the same point."""
    ok = [r for r in rows if not r.get("failed")]
    for r in ok:
        base = next((b for b in ok if b["G"] == r["G"] and b["L"] == r["L"] and b["trainer"] == "GRPOTrainer"), None)
        if base is not None:
            r["x_trl_time"] = r["step_s"] / base["step_s"]
            r["x_trl_mem"] = r["peak_GB"] / base["peak_GB"] if base["peak_GB"] else None
        same = [b for b in ok if b["trainer"] == r["trainer"]]
        g0, l0 = min(b["G"] for b in same), min(b["L"] for b in same)
        axis = [b for b in same if b["L"] == l0] if r["L"] == l0 else [b for b in same if b["G"] == g0]
        first = min(axis, key=lambda b: b["tokens"], default=None)
        r["x_first"] = r["ms_per_token"] / first["ms_per_token"] if first is not None else None


def plot(rows: list[dict], path: str, memory_label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("failed")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    l0 = min((r["L"] for r in ok), default=0)
    g0 = min((r["G"] for r in ok), default=0)
    for col, (axis, fixed, label) in enumerate((("G", ("L", l0), "G (completions per prompt)"),
                                                ("L", ("G", g0), "completion tokens L"))):
        for trainer in dict.fromkeys(r["trainer"] for r in ok):
            pts = sorted((r[axis], r) for r in ok if r["trainer"] == trainer and r[fixed[0]] == fixed[1])
            xs = [x for x, _ in pts]
            for row_i, key in enumerate(("ms_per_token", "peak_GB")):
                axes[row_i][col].plot(xs, [r[key] for _, r in pts], marker="o", label=trainer)
        for row_i, ylabel in enumerate(("ms per completion token", memory_label)):
            ax = axes[row_i][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"{label} ({fixed[0]} = {fixed[1]})")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle("GRPO step cost against the work (forced identical lengths)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    a, rest = parse_args(argv)
    signal.signal(signal.SIGTERM, grpo_step._stop_worker)  # a stopped sweep ends its worker too
    points = ordered(a.points)
    probe = step_args(rest, *points[0])
    device = pick_device(probe.device)
    clock = probe.phase_clock if probe.phase_clock != "auto" else ("wall" if device.type == "cuda" else "cpu")
    budget = probe.floor_memory_gb * 1e9 if probe.floor_memory_gb is not None else machine_memory_bytes(device)
    if probe.model == "smollm2":
        from trl_infinite.testing.offline_models import smollm2_path

        grpo_step.gsm8k_path(probe)
        smollm2_path()
    header = grpo_step.header_for(probe, device, clock)
    header["trainers"] = ", ".join(grpo_step.TRAINERS[k] for k in dict.fromkeys(a.trainers)) + " (in this order)"
    header["points"] = " ".join(f"{g}@{n}" for g, n in points) + " (run in this order; one prompt per step)"
    header["lengths"] = "forced identical: every completion exactly L tokens (log-normal mean 2L, sigma 0, clipped)"
    header["memory"] = "peak CUDA memory (max_memory_allocated), GB" if device.type == "cuda" else "peak RSS (VmHWM), GB"
    table = Table(COLUMNS)
    env = {**os.environ, "OMP_NUM_THREADS": str(probe.threads), "MKL_NUM_THREADS": str(probe.threads),
           "PYTHONUNBUFFERED": "1"}
    failed = False
    with tempfile.TemporaryDirectory(prefix="grpo_scaling_") as tmp:
        for G, L in points:
            sa = step_args(rest, G, L)
            for kind in dict.fromkeys(a.trainers):
                result = Path(tmp) / f"{G}_{L}_{kind}.json"
                print(f"[grpo_scaling] G={G} L={L} {grpo_step.TRAINERS[kind]} ...", file=sys.stderr, flush=True)
                start = time.perf_counter()
                data = grpo_step.run_subprocess(grpo_step.worker_argv(sa, kind, sa.sizes[0], str(result)), result,
                                                env)
                row = scaling_row(G, L, kind, data, clock, budget, time.perf_counter() - start)
                failed |= bool(row.get("failed"))
                table.add(**row)
                add_relative(table.rows)
                save_json(a.json, header, table, {"floor_memory_bytes": budget})
                if a.png:
                    plot(table.rows, a.png, header["memory"])
    write_results(a.json, header, table, {"floor_memory_bytes": budget})
    terms = memory_rows(table.rows)
    if terms:  # where our peak goes, term by term (memory_terms.py)
        text = "\n## Our peak memory, term by term (benchmarks/memory_terms.py)\n\n" + Table(MEMORY_COLUMNS, terms).markdown()
        print(text, flush=True)
        if a.json:
            md = Path(a.json).with_suffix(".md")
            md.write_text(md.read_text() + text + "\n")
    if a.png:
        print(f"wrote {a.png}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
