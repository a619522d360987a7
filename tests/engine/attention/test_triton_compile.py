"""Every Triton decode kernel compiles for sm_90 (H100) and sm_80 (A100) without a GPU, within the hardware limits.

`benchmarks/kernel_resources.py` compiles the prefix, suffix and merge kernels with `triton.compile` and an explicit
`GPUTarget` (the triton wheel's own ptxas), in bf16 and fp16, at head dims 64, 128, 256 and MLA's 576 / 512, every
layer feature on (soft-cap, sinks, window, chunk), at the tiles that run untuned (the first candidate of each list
in `triton_tiles`; the full candidate table is in benchmarks/RESULTS-history.md). Asserted: registers <= 255 per thread and
<= 65,536 per block, shared memory per block under the architecture's maximum (227 KB / 163 KB), no spills, and the
attention kernels' loads software-pipelined (asynchronous copies into shared memory). The compiler is stricter than
the CPU interpreter the other tests use, so this also catches code only the interpreter accepts. Runs in a
subprocess: this session's Triton is in interpreter mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")


def _takes_constexprs() -> bool:
    """Triton's `ASTSource` as `triton_compile.py` calls it (`constexprs=`, Triton 3.3+; 3.2 names it `constants`)."""
    import inspect

    from triton.compiler import ASTSource

    return "constexprs" in inspect.signature(ASTSource.__init__).parameters

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not _takes_constexprs(), reason=f"the offline compile (`triton_compile.py`) uses Triton 3.3+'s "
                    f"`ASTSource(constexprs=...)`; this is Triton {triton.__version__} (the interpreter tests of the "
                    "kernels still run)")
def test_kernels_compile_for_sm90_and_sm80_within_limits(tmp_path):
    out = tmp_path / "resources.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--candidates", "first",
                           "--jobs", "2", "--json", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    print(proc.stdout)
    # 2 archs x 2 dtypes x 4 geometries x (prefix, suffix, merge)
    assert len(rows) == 48
    assert {(r["arch"], r["dtype"], r["geometry"]) for r in rows} == {
        (a, d, g) for a in (90, 80) for d in ("bf16", "fp16") for g in ("64", "128", "256", "mla")}
    for r in rows:
        threads = 32 * (r["tiles"]["num_warps"] if r["tiles"] else 4)
        assert r["registers"] <= 255 and r["registers"] * threads <= 65536, r
        assert r["shared"] <= (232448 if r["arch"] == 90 else 166912), r
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert r["pipelined"] or r["kernel"] == "_merge_kernel", r
    assert proc.returncode == 0, proc.stdout[-3000:]
