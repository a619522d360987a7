"""GPU suite preflight (`benchmarks/gpu_suite.sh --part one`, first): checks in well under a minute that the machine
can run the rest, so that a broken image stops the device call before its minutes are spent.

Checks, each a row (status ok / FAILED / skipped, seconds, detail):
- imports and versions: torch, triton, transformers, accelerate, trl, datasets, pytest, numpy, huggingface_hub,
  peft, trl_infinite and its trainer (InfiniteGRPOTrainer: trl on this transformers), with where each was imported
  from (the image or the carried wheels in /tmp/site);
- CUDA: the device, its memory and SM count;
- Triton JIT: a small kernel (y = 2x + 1) compiled and run on the device, compared with torch;
- CUDA graph: `y = x @ w + 1` captured once, replayed on new inputs, compared with eager;
- KV addresses: the KV pool's reserved address range backed, given back and backed again at the same address (not
  critical: the engine falls back to a per-call pool);
- the engine's Triton attention backend imports (its kernels compile later, in the tables).

Exit status 1 when a check that every later table needs failed (torch, triton, transformers, accelerate, numpy,
huggingface_hub, trl_infinite, the device, the Triton kernel, the CUDA graph, the engine's Triton backend): the suite
then stops the call. Exit status 3 when only a module some tables need is missing (trl, datasets, pytest: the row
says which tables): the suite goes on, and those tables fail on their own. `--device cpu` (the suite's dry run): the
Triton kernel runs under Triton's interpreter (`TRITON_INTERPRET=1` must be set before this starts) and the graph
row is skipped.

    python benchmarks/preflight.py --json OUT/preflight.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODULES = {  # module -> the suite's tables that need it ("all": every table)
    "torch": "all", "triton": "all", "transformers": "all", "accelerate": "all", "numpy": "all",
    "huggingface_hub": "all", "trl_infinite": "all",
    "trl": "rollout (TRL generate), grpo_step", "datasets": "grpo_step", "trl_infinite.trainer": "grpo_step",
    "pytest": "graphs, kernels",
    "peft": "none (reported only)",
}
COLUMNS = ["check", "status", "seconds", "detail"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda if available, else cpu (cpu: no graph, Triton interpreted)")
    p.add_argument("--json", default=None, help="write the rows as JSON (and the table as .md) here")
    return p.parse_args(argv)


def check_imports() -> list[dict]:
    rows = []
    for name, needed_by in MODULES.items():
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(name)
            version = getattr(module, "__version__", "?")
            rows.append({"check": f"import {name}", "status": "ok", "detail": f"{version} ({module.__file__})"})
        except Exception as err:  # noqa: BLE001 - any failure to import is the finding
            status = "FAILED" if needed_by != "none (reported only)" else "missing"
            rows.append({"check": f"import {name}", "status": status,
                         "detail": f"{type(err).__name__}: {err} (needed by: {needed_by})"[:300]})
        rows[-1]["seconds"] = time.perf_counter() - t0
        rows[-1]["critical"] = needed_by == "all"
    return rows


def check_device(device) -> dict:
    import torch

    if device.type != "cuda":
        return {"check": "device", "status": "ok", "detail": f"{device} (dry run: no CUDA)"}
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    p = torch.cuda.get_device_properties(device)
    return {"check": "device", "status": "ok",
            "detail": f"{p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability "
                      f"{p.major}.{p.minor}, CUDA {torch.version.cuda}"}


def check_triton(device) -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _affine(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, 2.0 * x + 1.0, mask=mask)

    n = 4096 if device.type == "cuda" else 100
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    _affine[(triton.cdiv(n, 256),)](x, y, n, BLOCK=256)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not torch.allclose(y, 2.0 * x + 1.0, rtol=1e-6, atol=1e-6):  # a fused multiply-add may round differently
        raise RuntimeError(f"Triton kernel output differs from torch (max error {(y - (2 * x + 1)).abs().max():.3g})")
    mode = "compiled for the device" if device.type == "cuda" else "interpreted (TRITON_INTERPRET=1)"
    return {"check": "triton kernel", "status": "ok", "detail": f"{n} elements, {mode}, equal to torch within 1e-6"}


def check_graph(device) -> dict:
    import torch

    if device.type != "cuda":
        return {"check": "cuda graph", "status": "skipped", "detail": "no CUDA (dry run)"}
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 256, device=device, generator=gen)
    x = torch.randn(64, 256, device=device, generator=gen)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph's documentation asks
        for _ in range(2):
            x @ w + 1.0
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x @ w + 1.0
    for k in range(3):
        x.copy_(torch.randn(64, 256, device=device, generator=gen))
        graph.replay()
        torch.cuda.synchronize(device)
        if not torch.allclose(y, x @ w + 1.0, atol=1e-3, rtol=1e-3):
            raise RuntimeError(f"replay {k} differs from eager")
    return {"check": "cuda graph", "status": "ok", "detail": "captured once, 3 replays on new inputs equal eager"}


def check_kv_addresses(device) -> dict:
    """The KV pool's fixed addresses (`engine/runner/kv_memory.py`; on CUDA the driver's virtual memory management through
    ctypes): reserve, back, write, give back, back again; the tensors keep their address and read zeros anew. Not
    critical: where it fails the engine allocates the pool per call (graphs captured again per call, counted)."""
    import torch

    from trl_infinite.engine.runner.kv_memory import reserve_range

    mib = 1 << 20
    region = reserve_range([64 * mib, 8 * mib], device)
    if region is None:
        raise RuntimeError("reserve_range declined (see the warning above)")
    a = region.tensor(0, torch.bfloat16, (32 * mib,))
    address = a.data_ptr()
    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    region.map([48 * mib, 4 * mib])
    a[: 24 * mib].fill_(1.0)
    held = free_before - torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else region.mapped_bytes
    region.unmap()
    freed = torch.cuda.mem_get_info(device)[0] - (free_before - held) if device.type == "cuda" else 0
    region.map([64 * mib, 8 * mib])
    if a.data_ptr() != address or a[: 24 * mib].any() or a.numel() != 32 * mib:
        raise RuntimeError("the tensor moved, or did not read zeros after being backed anew")
    a.fill_(2.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    region.unmap()
    return {"check": "kv addresses", "status": "ok",
            "detail": f"granularity {region.granularity} B; 48 MiB backed ({held / mib:.0f} MiB held), given back "
                      f"({freed / mib:.0f} MiB freed), backed again at the same address, zeros"}


def check_backend(device) -> dict:
    from trl_infinite.engine.attention import triton_backend

    return {"check": "triton backend", "status": "ok",
            "detail": f"imported; AUTOTUNE={triton_backend.AUTOTUNE} (TRL_INFINITE_TRITON_AUTOTUNE="
                      f"{os.environ.get('TRL_INFINITE_TRITON_AUTOTUNE', 'unset')})"}


def main(argv=None) -> int:
    a = parse_args(argv)
    rows = check_imports()
    critical_missing = any(r["critical"] and r["status"] != "ok" for r in rows)
    if not critical_missing:
        import torch

        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        for check in (check_device, check_triton, check_graph, check_kv_addresses, check_backend):
            t0 = time.perf_counter()
            try:
                row = check(device)
            except Exception as err:  # noqa: BLE001 - the failure is the finding
                name = {"check_triton": "triton kernel", "check_graph": "cuda graph"}.get(check.__name__)
                row = {"check": name or check.__name__.removeprefix("check_").replace("_", " "), "status": "FAILED",
                       "detail": f"{type(err).__name__}: {err}"[:500]}
            row.update(seconds=time.perf_counter() - t0, critical=check is not check_kv_addresses)
            rows.append(row)
            if row["status"] == "FAILED" and check is check_device:
                break  # nothing else can run on a device that is not there
    failed = [r for r in rows if r["status"] == "FAILED"]
    header = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(),
              "command": "python " + " ".join(sys.argv), "python": sys.version.split()[0],
              "result": "ok" if not failed else "FAILED: " + ", ".join(r["check"] for r in failed)}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        seconds = f"{r['seconds']:.2f}" if r.get("seconds") is not None else "-"
        lines.append(f"| {r['check']} | {r['status']} | {seconds} | {str(r.get('detail', '')).replace('|', '/')} |")
    text = "\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + "\n".join(lines) + "\n"
    print(text, flush=True)
    if a.json:  # written without the benchmarks' `common` (it imports torch, which may be what is missing)
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({**header, "rows": rows}, indent=1))
        Path(a.json).with_suffix(".md").write_text(text)
    return 1 if any(r["critical"] for r in failed) else 3 if failed else 0


def _commit() -> str:
    try:
        from common import git_commit

        return git_commit()
    except Exception:  # noqa: BLE001 - no torch: the stamp the wheels carry, if any
        stamp = Path(__file__).resolve().parents[1] / ".whl" / "COMMIT"
        return stamp.read_text().strip() + " (from .whl/COMMIT)" if stamp.is_file() else "unknown"


if __name__ == "__main__":
    sys.exit(main())
