"""`grpo_step.py`'s floor table (issue 43), built in the parent from a worker's `floor` JSON (`flop_floor.py` has the
formula): one row per (size, trainer, phase) for the rollout, the training forward, the backward and the whole step.

Columns:
- `counted_GFLOP`: `FlopCounterMode`'s count of the phase in the warm-up step (step 1, untimed); `req1_GFLOP`: the
  required FLOPs of that same step by the formula; `x_req` = counted / required: padding, recomputation, work done
  twice and the counter's dense attention, as one factor (1.0 = nothing beyond the floor's work).
- `GFLOP`: the required FLOPs of the measured steps (mean); `GB_moved`: the rollout's bytes read (weights + KV);
  `rate_GFLOPs`: the measured GEMM rate the phase's floor uses; `time_s`: the phase's time (the phase clock's:
  CPU seconds on CPU, synchronised wall on CUDA); `floor_s` = max(GFLOP / rate, GB_moved / bandwidth);
  `x_floor` = time / floor (1.0 = at the limit). The `step` row: the whole step's time over the sum of the three
  phases' floors (reward, optimizer and other work have no floor of their own: they count against the step).
- `recompute`: whether the floor includes recomputation (one sample's activations over the memory budget).
"""

from __future__ import annotations

import os

import torch
from flop_floor import FLOOR_PHASES, ModelShape, Required, required_flops

FLOOR_COLUMNS = ["size", "trainer", "phase", "counted_GFLOP", "req1_GFLOP", "x_req", "GFLOP", "GB_moved",
                 "rate_GFLOPs", "time_s", "floor_s", "x_floor", "recompute"]
TIME_COLUMNS = {"rollout": "rollout_s", "forward": "forward_s", "backward": "backward_s"}


def machine_memory_bytes(device: torch.device) -> float:
    """The default memory budget of the floor: the GPU's memory on CUDA, the host's RAM elsewhere."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _shape(floor: dict) -> ModelShape:
    s = dict(floor["shape"])
    s["body"] = tuple(tuple(x) for x in s["body"])
    s["head"] = tuple(s["head"])
    return ModelShape(**s)


def _required(shape: ModelShape, step: dict, budget: float) -> Required | None:
    if step.get("completions") is None:
        return None
    return required_flops(shape, step["prompt_lens"], step["completions"], budget)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def floor_rows(size: str, trainer: str, data: dict, row: dict, clock: str, budget: float) -> list[dict]:
    """The floor table's rows of one worker (none when it failed or measured no floor); also sets `row["x_floor"]`."""
    floor = data.get("floor") if "error" not in data else None
    if not floor or not floor.get("steps"):
        return []
    shape = _shape(floor)
    rates = floor["rates"]
    first = _required(shape, floor["steps"][0], budget)
    measured = [r for r in (_required(shape, s, budget) for s in floor["steps"][1:]) if r is not None]
    if not measured:
        return []
    counted = floor["steps"][0].get("counted") or {}
    out, floors = [], 0.0
    for phase in FLOOR_PHASES:
        gflop = _mean(getattr(r, phase) for r in measured) / 1e9
        moved = _mean(r.rollout_bytes for r in measured) / 1e9 if phase == "rollout" else None
        rate = rates[phase] / 1e9
        floor_s = max(gflop / rate, (moved or 0.0) / (rates["bandwidth"] / 1e9))
        floors += floor_s
        time_s = row.get(TIME_COLUMNS[phase])
        c = counted.get(phase)
        req1 = getattr(first, phase) / 1e9 if first is not None else None
        out.append({"size": size, "trainer": trainer, "phase": phase,
                    "counted_GFLOP": c / 1e9 if c is not None else None, "req1_GFLOP": req1,
                    "x_req": c / 1e9 / req1 if c is not None and req1 else None, "GFLOP": gflop, "GB_moved": moved,
                    "rate_GFLOPs": rate, "time_s": time_s, "floor_s": floor_s,
                    "x_floor": time_s / floor_s if time_s is not None else None,
                    "recompute": "yes" if phase == "backward" and measured[0].recompute else "-"})
    total = row.get("cpu_s" if clock == "cpu" else "wall_s")
    known = [counted.get(p) for p in FLOOR_PHASES]
    c_step = sum(known) / 1e9 if known and None not in known else None
    req1 = first.step / 1e9 if first is not None else None
    out.append({"size": size, "trainer": trainer, "phase": "step", "counted_GFLOP": c_step, "req1_GFLOP": req1,
                "x_req": c_step / req1 if c_step is not None and req1 else None,
                "GFLOP": _mean(r.step for r in measured) / 1e9, "GB_moved": out[0]["GB_moved"], "rate_GFLOPs": None,
                "time_s": total, "floor_s": floors, "x_floor": total / floors if total is not None else None,
                "recompute": out[2]["recompute"]})
    row["x_floor"] = out[-1]["x_floor"]
    return out


def floor_header(floor_data: dict | None, budget: float) -> dict:
    """Header lines of the floor: the rates and the formula's settings (from one worker's floor JSON)."""
    if not floor_data:
        return {}
    r = floor_data["rates"]
    return {"floor": (f"required FLOPs by the formula of benchmarks/flop_floor.py (no padding, prompt once per group, "
                      f"each completion token once, backward = 2x forward, recomputation only when one sample's "
                      f"activations exceed {budget / 1e9:.1f} GB); counted with FlopCounterMode in a warm-up step, "
                      f"{floor_data.get('counted_in', 'in the measuring worker')}"),
            "GEMM rate": (f"{r['rollout'] / 1e9:.1f} GFLOP/s at {r['rollout_rows']} rows (rollout), "
                          f"{r['forward'] / 1e9:.1f} forward / {r['backward'] / 1e9:.1f} backward GFLOP/s at "
                          f"{r['train_rows']} rows, {r['dtype']}, the model's linear shapes, in the worker "
                          f"(first worker's figures; each worker's floor uses its own)"),
            "copy bandwidth": f"{r['bandwidth'] / 1e9:.1f} GB/s (Tensor.copy_, read + write)"}


def best_rates(rows: list[dict]) -> dict:
    """Per rollout row count, the fastest rates any worker of the run measured (each rate and the bandwidth on its
    own): on a shared machine one worker's measurement can catch a slow moment, and the floor is what the machine
    can reach."""
    measured = [r["floor_data"]["rates"] for r in rows if (r.get("floor_data") or {}).get("rates")]
    best: dict = {}
    for rates in measured:
        key = rates["rollout_rows"]
        if key in best:
            best[key] = {k: max(v, rates[k]) if k in ("rollout", "bandwidth") else v for k, v in best[key].items()}
        else:
            best[key] = dict(rates)
    for k in ("forward", "backward"):  # training rates (at TRAIN_ROWS) do not depend on the rollout's rows
        fastest = max(r[k] for r in measured)
        for rates in best.values():
            rates[k] = fastest
    return best


def rebuild(path: str, remeasure: bool, threads: int, out: str | None, best: bool = False) -> list[dict]:
    """The floor table of a `grpo_step.py` / `grpo_scaling.py` JSON rebuilt from its rows' `floor_data`; with
    `remeasure`, the GEMM rates and bandwidth measured again in this process (`threads` torch threads, CPU) instead
    of the workers' own; with `best`, every row's floor uses the fastest rates any of the run's workers measured
    (`best_rates`); stated in the output."""
    import json
    from pathlib import Path

    from flop_floor import measure_rates

    data = json.loads(Path(path).read_text())
    clock = "wall" if "wall" in str(data.get("phase clock", "cpu")) else "cpu"
    budget = float(data.get("floor_memory_bytes") or machine_memory_bytes(torch.device("cpu")))
    torch.set_num_threads(threads)
    cache: dict = best_rates(data["rows"]) if best and not remeasure else {}
    rows = []
    for row in data["rows"]:
        floor = row.get("floor_data")
        if not floor:
            continue
        if cache and not remeasure:
            floor = {**floor, "rates": cache[floor["rates"]["rollout_rows"]]}
        elif remeasure:
            key = floor["rates"]["rollout_rows"]
            if key not in cache:
                shape = _shape(floor)
                dtype = getattr(torch, floor["rates"]["dtype"])
                cache[key] = vars(measure_rates(shape, key, torch.device("cpu"), dtype))
            floor = {**floor, "rates": cache[key]}
        size = row.get("size") or f"{row['G']}x1@{row['L']}"
        row = dict(row)
        measured = (row.get("all_steps") or [])[1:]
        for phase, column in TIME_COLUMNS.items():  # grpo_scaling rows keep the phases only per step
            if column not in row and measured:
                row[column] = _mean(s["phases_" + clock][phase] for s in measured)
        rows += floor_rows(size, row["trainer"], {"floor": floor}, row, clock, budget)
    if out:
        Path(out).write_text(json.dumps({"source": path, "remeasured": remeasure, "best": best, "threads": threads,
                                         "rates": cache, "floor_rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    import argparse

    from common import Table

    p = argparse.ArgumentParser(description=rebuild.__doc__)
    p.add_argument("json")
    p.add_argument("--remeasure", action="store_true")
    p.add_argument("--best", action="store_true", help="the fastest rates any worker of the run measured")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    t = Table(FLOOR_COLUMNS, rebuild(a.json, a.remeasure, a.threads, a.out, a.best))
    print(t.markdown())
