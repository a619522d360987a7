"""CUDA graphs of the static decode step: what the decoder needs from a graph implementation, and the CUDA one.

`StaticDecoder` (`static.py`) captures one graph per batch bucket through a `GraphRuntime`:
- `warmup(fn)` runs `fn` for real before its first capture (Triton JIT and autotuning, cuBLAS workspaces,
  `torch.compile`), on the runtime's side stream;
- `capture(fn)` records `fn` into a graph whose memory comes from the runtime's one private pool (shared by every
  bucket's graph; they never run concurrently) and returns `(graph, outputs)`; `graph.replay()` re-runs the recorded
  work on the same buffers, refreshing `outputs` in place;
- `pool_memory()` is the pool's own size (`PoolMemory`), read from the allocator, not from a before/after delta.

`CudaGraphs` is the CUDA implementation (as vLLM's and SGLang's graph runners: one side stream for every warm-up
and capture, one pool). `cpu_graphs.GraphEmulator` is a CPU stand-in with the same interface that refuses what
a capture refuses, so every capture/replay rule of the decoder runs in CI; `graph_runtime(device)` picks the one to
use (the emulator only while `cpu_graphs.emulate_cuda_graphs()` is active).

A capture fails with `CaptureError` (the emulator) or a CUDA `RuntimeError` mentioning the capture; `is_capture_error`
tells both apart from other failures, so the decoder can fall back to uncaptured steps with a warning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trl_infinite.engine.decode.compiled import StepCompileError


class CaptureError(RuntimeError):
    """Something a graph cannot record ran inside a capture; `kind` names the rule (see `cpu_graphs`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


# CUDA's own messages for work a stream capture does not permit (host syncs, pageable copies, ...) and for a capture
# invalidated by such work
_CUDA_CAPTURE_MESSAGES = ("stream is capturing", "cudaErrorStreamCapture", "during capture", "capture failed",
                          "during CUDA graph capture")


def is_capture_error(err: BaseException) -> bool:
    """Whether `err` says a capture could not record the step (rather than the step itself failing). A step that
    could not be compiled (`StepCompileError`) is one only where what made the compilation fail is (a backend that
    compiled inside a capture): a graph break, whatever its message, is raised, not given up on."""
    if isinstance(err, StepCompileError):
        return err.origin is not None and is_capture_error(err.origin)
    return isinstance(err, CaptureError) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in _CUDA_CAPTURE_MESSAGES))


@dataclass(frozen=True)
class PoolMemory:
    """Bytes of the graphs' private pool: `reserved` (what the pool holds from the device) and `allocated` (live
    tensors in it: the graphs' static outputs). Replays reuse the pool without allocating, so a peak read from
    `torch.cuda.max_memory_allocated` misses `reserved - allocated` of it."""

    reserved: int = 0
    allocated: int = 0

    @property
    def unaccounted(self) -> int:
        return self.reserved - self.allocated


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphRuntime(Protocol):
    def warmup(self, fn: Callable[[], Any]) -> Any: ...

    def capture(self, fn: Callable[[], Any]) -> tuple[Graph, Any]: ...

    def pool_memory(self) -> PoolMemory: ...


class CudaGraphs:
    """`GraphRuntime` on a CUDA device: one side stream and one memory pool for the decoder's whole life."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.num_graphs = 0

    def warmup(self, fn: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        graph = torch.cuda.CUDAGraph()
        # the same stream for every capture into the shared pool (what lets the captures reuse its memory)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.num_graphs += 1
        return graph, out

    def pool_memory(self) -> PoolMemory:
        if not self.num_graphs:
            return PoolMemory()
        try:
            segments = torch.cuda.memory_snapshot(mempool_id=self.pool, include_traces=False)
        except TypeError:  # older torch: the whole snapshot, filtered by pool
            segments = [s for s in torch.cuda.memory_snapshot()
                        if tuple(s.get("segment_pool_id", ())) == tuple(self.pool)]
        return PoolMemory(sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments))


# Held by a capture (its warm-ups included) and by work another thread of the engine launches meanwhile (the
# decoupled drafter's forward): a CUDA stream capture in torch's default "global" mode forbids the other threads'
# allocations and synchronising copies (the capture fails, or their call does), and the emulator records whatever
# runs. Captures happen on a bucket's first use, so in steady state the lock is never contended.
capture_lock = threading.Lock()

_emulator: GraphRuntime | None = None  # set by `cpu_graphs.emulate_cuda_graphs` for its block


def set_emulator(runtime: GraphRuntime | None) -> GraphRuntime | None:
    """Install (or remove, None) the runtime `graph_runtime` returns off CUDA; returns the previous one."""
    global _emulator
    previous, _emulator = _emulator, runtime
    return previous


def graphs_available(device: torch.device) -> bool:
    """Whether `graph_runtime(device)` gives a runtime (CUDA, or the emulator while it is installed)."""
    return device.type == "cuda" or _emulator is not None


def graph_runtime(device: torch.device) -> GraphRuntime | None:
    """The graph runtime for `device`: CUDA graphs on CUDA, the installed emulator elsewhere, else None."""
    if device.type == "cuda":
        return CudaGraphs(device)
    return _emulator
