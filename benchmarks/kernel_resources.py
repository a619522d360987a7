"""Registers, spills and shared memory of every Triton decode-kernel configuration, compiled for sm_90 and sm_80
without a GPU (`engine/attention/triton_compile.py`: `triton.compile` with an explicit `GPUTarget`, the wheel's
own ptxas), at head dims 64, 128, 256 and MLA's 576 / 512, in bf16 and fp16, every layer feature on.

    python benchmarks/kernel_resources.py [--arch 90 80] [--dtype bf16 fp16] [--geometry 64 128 256 mla]
                                          [--candidates all|first] [--jobs 2] [--json OUT.json]

Prints one markdown row per configuration; `problems` lists what exceeds the hardware limits (registers, shared
memory per block) and any spill. Exits 1 if any configuration has a problem. Must run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=[90, 80])
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    p.add_argument("--geometry", nargs="+", default=["64", "128", "256", "mla"], choices=["64", "128", "256", "mla"])
    p.add_argument("--candidates", default="all", choices=["all", "first"])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _one(job):
    from trl_infinite.engine.attention.triton_compile import GEOMETRIES, kernel_resources

    arch, dtype, name, candidates = job
    dk, dv, gqa = GEOMETRIES[name]
    return [(name, r) for r in kernel_resources(arch, dtype, dk, dv, gqa, candidates)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces compilation")
    jobs = [(a, d, g, args.candidates) for a in args.arch for d in args.dtype for g in args.geometry]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = [row for rows in pool.map(_one, jobs) for row in rows]
    cols = ["arch", "dtype", "head dims", "kernel", "BLOCK_M x BLOCK_N", "warps", "stages", "registers",
            "spill st/ld B", "stack B", "shared KB", "async copies", "problems"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    bad = 0
    rows = []
    for name, r in results:
        t = r.tiles
        problems = r.problems()
        bad += bool(problems)
        dims = "576/512 (MLA)" if name == "mla" else f"{r.head_dims[0] or '(V)'}/{r.head_dims[1]}"
        print(f"| sm_{r.arch} | {r.dtype} | {dims} | {r.kernel.strip('_')} | "
              f"{f'{t.block_m} x {t.block_n}' if t else '-'} | {t.num_warps if t else 4} | {t.num_stages if t else '-'} | "
              f"{r.registers} | {r.spill_stores}/{r.spill_loads} | {r.stack} | {r.shared / 1024:.1f} | "
              f"{'yes' if r.pipelined else 'no'} | {'; '.join(problems) or '-'} |")
        rows.append({**asdict(r), "geometry": name, "problems": problems})
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"\n{len(results)} configurations, {bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
