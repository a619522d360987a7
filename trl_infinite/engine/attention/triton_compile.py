"""Compile the Triton decode kernels for a GPU architecture without a GPU, and read their resource use.

`triton.compile` with an explicit `GPUTarget` lowers a kernel to PTX and to a cubin with the `ptxas` that ships in
the triton wheel; `ptxas -v` on the same PTX reports registers, spill stores / loads and the stack frame, and the
kernel's metadata its dynamic shared memory. `kernel_resources` does this for every launch configuration the
backend can pick (`triton_tiles`: each tile candidate of the prefix and suffix kernels, and the merge kernel) at a
given head geometry and pool dtype, with every layer feature on (soft-cap, sinks, window, chunk: the most registers).
`LIMITS` holds the hardware limits the results are checked against (`check`).

Run in a process where `TRITON_INTERPRET` is off (the interpreter replaces compilation). Used by the CI test
(`tests/engine/attention/test_triton_compile.py`) and `benchmarks/kernel_resources.py` (the table in RESULTS.md).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from trl_infinite.engine.attention import triton_tiles as tiles

# per architecture: registers per thread, registers per multiprocessor, shared memory per block (opt-in maximum)
LIMITS = {90: dict(regs=255, regs_per_sm=65536, shared=232448),  # H100: 227 KB
          80: dict(regs=255, regs_per_sm=65536, shared=166912)}  # A100: 163 KB
DTYPES = {"bf16": "*bf16", "fp16": "*fp16"}


@dataclass(frozen=True)
class Resources:
    """One compiled kernel configuration."""

    kernel: str
    arch: int
    dtype: str
    head_dims: tuple[int, int]
    tiles: tiles.Tiles | None
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack: int  # bytes per thread (spills and local arrays)
    shared: int  # bytes per block (dynamic + static)
    pipelined: bool  # global loads issued as asynchronous copies into shared memory (software pipelining)

    @property
    def threads(self) -> int:
        return 32 * (self.tiles.num_warps if self.tiles else 4)

    def problems(self) -> list[str]:
        """Hardware limits exceeded, and spills (what the tile lists must avoid)."""
        lim = LIMITS[self.arch]
        out = []
        if self.registers > lim["regs"]:
            out.append(f"{self.registers} registers > {lim['regs']}")
        if self.registers * self.threads > lim["regs_per_sm"]:
            out.append(f"{self.registers} x {self.threads} threads > {lim['regs_per_sm']} registers")
        if self.shared > lim["shared"]:
            out.append(f"{self.shared} B shared > {lim['shared']}")
        if self.spill_stores or self.spill_loads:
            out.append(f"spills ({self.spill_stores} B stores, {self.spill_loads} B loads)")
        return out


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for `arch` (its knob; the wheel's bin/ptxas on Triton versions without it)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except (ImportError, TypeError, AttributeError):
        import triton

        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run([_ptxas(arch), f"-arch={sm}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    used = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    smem = re.search(r"(\d+) bytes smem", text)
    return dict(registers=int(used[1]), stack=int(frame[1]), spill_stores=int(frame[2]), spill_loads=int(frame[3]),
                static_shared=int(smem[1]) if smem else 0)


# arguments the JIT specialises as multiples of 16 at production shapes (tensor pointers from PyTorch's allocator;
# strides that are multiples of a head dim >= 64): the compiler then knows the head-dim rows are 16-byte aligned and
# vectorises their loads. Table strides, positions and window sizes are not assumed to be.
ALIGNED_STRIDES = ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_outt",
                   "stride_outh")


def _aligned(fn, constexprs: dict) -> dict:
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(inspect.signature(fn.fn).parameters)
            if n not in constexprs and (n.endswith("_ptr") or n in ALIGNED_STRIDES)}


def _signature(fn, constexprs: dict, dtype: str) -> dict[str, str]:
    floats = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "out_ptr": dtype}
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in floats:
            sig[name] = floats[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name.startswith(("o_", "pre_", "lse", "part", "sinks")) else "*i64"
        else:
            sig[name] = "fp32" if name in ("scale", "softcap") else "i64"
    return sig


def compile_one(fn, constexprs: dict, dtype: str, arch: int, config: tiles.Tiles | None) -> Resources:
    """Compile `fn` with `constexprs` for sm_`arch` and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    options = {}
    if config is not None:
        constexprs.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    source = ASTSource(fn, _signature(fn, constexprs, DTYPES[dtype]), constexprs=constexprs,
                       attrs=_aligned(fn, constexprs))
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    report = _ptxas_report(kernel.asm["ptx"], arch)
    return Resources(fn.fn.__name__, arch, dtype, (constexprs.get("HEAD_DIM_K", 0), constexprs["HEAD_DIM_V"]), config,
                     report["registers"], report["spill_stores"], report["spill_loads"], report["stack"],
                     kernel.metadata.shared + report["static_shared"], "async_copy_global_to_local" in kernel.asm["ttgir"])


def kernel_resources(arch: int, dtype: str, head_dim_k: int, head_dim_v: int, gqa: int,
                     candidates: str = "all") -> list[Resources]:
    """Every configuration the backend can launch at this geometry (`candidates="first"`: the untuned defaults)."""
    from trl_infinite.engine.attention.triton_kernels import _merge_kernel, _prefix_kernel, _suffix_kernel

    block_dk, chunks = tiles.key_chunks(head_dim_k)
    num_heads = gqa * 2
    common = dict(HEAD_DIM_K=head_dim_k, BLOCK_DK=block_dk, DK_CHUNKS=chunks, HEAD_DIM_V=head_dim_v,
                  BLOCK_DV=tiles.value_block(head_dim_v), NUM_HEADS=num_heads, GQA=gqa, PAGE=16, PRECISION="tf32",
                  CAST=0, SOFTCAP=True, HAS_WINDOW=True, HAS_CHUNK=True)
    pick = (lambda xs: xs[:1]) if candidates == "first" else (lambda xs: xs)
    out = [compile_one(_prefix_kernel, {**common, "KV_SPLITS": 4, "HAS_SINKS": True}, dtype, arch, t)
           for t in pick(tiles.prefix_tiles(head_dim_k, head_dim_v))]
    _, head_tiles = tiles.suffix_rows(gqa, head_dim_v)
    out += [compile_one(_suffix_kernel, {**common, "HEAD_TILES": head_tiles, "PREFIX_SPLITS": 4, "SPLITS": 4},
                        dtype, arch, t) for t in pick(tiles.suffix_tiles(gqa, head_dim_k, head_dim_v))]
    merge = dict(HEAD_DIM_V=head_dim_v, BLOCK_DV=tiles.value_block(head_dim_v), SPLITS=16)
    out.append(compile_one(_merge_kernel, merge, dtype, arch, None))
    return out


GEOMETRIES = {"64": (64, 64, 4), "128": (128, 128, 4), "256": (256, 256, 2), "mla": (576, 512, 16)}
