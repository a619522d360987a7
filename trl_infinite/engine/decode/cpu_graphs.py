"""A CPU stand-in for `torch.cuda.graph` / `CUDAGraph`, so that every capture/replay rule of the decoder runs in CI.

`GraphEmulator` implements `cuda_graphs.GraphRuntime`. Inside `emulate_cuda_graphs()` a `RolloutEngine` built with
`cuda_graphs=True` on CPU captures and replays its decode steps through it:

- capture records the step once, at the dispatcher: every aten / custom op with its argument and output tensors,
  and every Triton launch (Triton's CPU interpreter) with its arguments. Like a CUDA capture it leaves no trace on
  the data: it runs each op to learn its outputs, then puts back every tensor that existed before the capture and
  that the step wrote to (the decode rows, the KV pool), in reverse order. Tensors the ops allocate form the
  graph's pool (kept by the graph: their addresses are its static buffers; `pool_memory` is their size);
- replay re-runs the recorded ops on the same tensors (an op's new result is copied into the tensor recorded at
  capture; views and allocations are not re-run, as a CUDA graph has no node for them). Python is not re-run: host
  values read at capture are frozen, as in a graph. A replay first checks that every tensor the graph reads from
  outside still has the storage it had at capture (`moved_storage`: a CUDA graph would read freed memory);
- a capture is refused with `CaptureError` (counted in `counts`; raised as itself also where the code in between
  reports it as another error, as inductor's C++ wrapper does) for what a CUDA stream capture refuses or gets wrong:
  `host_sync`      reading device data on the host: `.item()`, `bool()`, `int()`, `.tolist()`, `.numpy()`, ops
                   tagged `data_dependent_output`, and ops whose CUDA implementation reads its inputs on the host
                   (`aten._grouped_mm`: its offsets are copied to the host; in fp32 by ATen's fallback, and in
                   bf16 too on an H100 with torch 2.11 and transformers 5.17's grouped experts: MoE models);
  `dynamic_shape`  ops whose output shape depends on data (`nonzero`, `masked_select`, `unique`, boolean-mask
                   indexing, `repeat_interleave` without `output_size`): a graph's shapes are fixed at capture;
  `host_upload`    a tensor built from host data inside the capture (`torch.tensor([...])`): on CUDA a pageable
                   copy (not permitted while capturing), and its value would be frozen (a 0-dim one, as in
                   `x[i] = 0`, is a host scalar: a constant of the recorded op, allowed);
  `host_alloc`     pinned host memory allocated inside the capture;
  `untracked_output` a step output no recorded op produced (a kernel called outside the dispatcher, e.g.
                   inductor's C++ wrapper: replaying would skip it).

The emulator checks the rules, not the speed: a replay costs about what the eager step costs. Devices are not told
apart (everything is on the CPU), so an explicit device copy inside the step is not refused.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from trl_infinite.engine.decode.cuda_graphs import CaptureError, PoolMemory, set_emulator

aten = torch.ops.aten
_GROUPED_MM = aten._grouped_mm.default if hasattr(aten, "_grouped_mm") else None  # (older torch has none)
_HOST_SYNC_OPS = {aten.is_nonzero.default, aten.item.default, aten._local_scalar_dense.default, aten.equal.default}
_UPLOAD_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_SKIP_ON_REPLAY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                   aten.new_empty.default, aten.new_empty_strided.default}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_INDEX_PUTS = _INDEX_OPS - {aten.index.Tensor}
_HOST_METHODS = ("tolist", "numpy", "__array__")  # Tensor methods that read data without a dispatched op


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Node:
    """One recorded op (or kernel launch: no `outputs`): `run()` re-executes it on the recorded tensors."""

    __slots__ = ("func", "args", "kwargs", "outputs")

    def __init__(self, func, args, kwargs, outputs):
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        for new, old in zip(_tensors(result), _tensors(self.outputs)):
            if new.data_ptr() != old.data_ptr() or new.stride() != old.stride():
                old.copy_(new)


class EmulatedGraph:
    """A recorded step (see the module docstring); `replay()` re-runs it on the recorded buffers."""

    def __init__(self, emulator: GraphEmulator, nodes: list[_Node], external: list[tuple[torch.Tensor, int]],
                 pool: dict[int, int], inference: bool):
        self.emulator = emulator
        self.inference = inference  # captured in inference mode: its tensors are inference tensors
        self.nodes = nodes
        self.external = external  # (tensor read from outside the graph, its data_ptr at capture)
        self.pool = pool  # storage data_ptr -> bytes, of the tensors the graph allocated

    def replay(self) -> None:
        moved = [t for t, ptr in self.external if t.data_ptr() != ptr]
        if moved:
            self.emulator.counts["moved_storage"] += 1
            raise CaptureError("moved_storage", f"{len(moved)} tensors the graph reads (e.g. one of shape "
                               f"{tuple(moved[0].shape)}) moved to new storage since the capture: recapture")
        self.emulator.counts["replays"] += 1
        with torch.inference_mode(self.inference):
            for node in self.nodes:
                node.run()


class _Recorder(TorchDispatchMode):
    """The dispatch mode of one capture: refuses, runs and records each op (see the module docstring)."""

    def __init__(self, emulator: GraphEmulator):
        super().__init__()
        self.emulator = emulator
        self.nodes: list[_Node] = []
        self.pool: dict[int, int] = {}
        self.external: dict[int, tuple[torch.Tensor, int]] = {}
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (outside tensor written, its value before)
        self._saved_keys: set[tuple] = set()
        self._host_scalars: dict[int, weakref.ref] = {}  # 0-dim tensors made from host data inside the capture
        self.refusal: CaptureError | None = None  # the first, raised again should a caller turn it into another error

    def refuse(self, kind: str, message: str) -> CaptureError:
        self.emulator.counts[kind] += 1
        err = CaptureError(kind, message)
        self.refusal = self.refusal or err
        return err

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        inputs = _tensors((args, kwargs))
        self._save_outside_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _UPLOAD_OPS:
            self._host_scalars[id(out)] = weakref.ref(out)
        in_storages = {_storage(t) for t in inputs}
        # a view (`to`, `reshape`, ... only when they return an alias of their input) or a bare allocation: no node
        aliased = func.is_view and all(_storage(t) in in_storages for t in _tensors(out))
        node = None if aliased or func in _SKIP_ON_REPLAY else _Node(func, args, kwargs, out)
        for t in _tensors(out):
            s = _storage(t)
            if s not in in_storages and s not in self.pool:
                self.pool[s] = t.untyped_storage().nbytes()
        for t in inputs:
            if _storage(t) not in self.pool:
                self.external.setdefault(id(t), (t, t.data_ptr()))
        if node is not None:
            self.nodes.append(node)
        return out

    def _check(self, func, args, kwargs) -> None:
        name = str(func)
        if func in _HOST_SYNC_OPS or torch.Tag.data_dependent_output in func.tags:
            raise self.refuse("host_sync", f"{name} reads device data on the host")
        if func in _UPLOAD_OPS and args[0].dim() > 0:  # a 0-dim one is a host scalar (`x[i] = 0`): a constant
            raise self.refuse("host_upload", "a tensor is built from host data inside the capture "
                              "(`torch.tensor([...])`): build it once outside the step")
        scalar = self._host_scalars.get(id(args[2])) if func in _INDEX_PUTS else None
        if scalar is not None and scalar() is args[2]:
            # `x[index_tensors] = 0` (not `x[i] = 0`): CUDA's index_put_ copies the host scalar to the device
            raise self.refuse("host_upload", "`x[index_tensors] = scalar` copies the host scalar to the device "
                              "inside the capture: use `scatter_` / `index_fill_` / `masked_fill_` with the scalar")
        if kwargs.get("pin_memory") or func is aten._pin_memory.default:
            raise self.refuse("host_alloc", f"{name} allocates pinned host memory inside the capture")
        if func is _GROUPED_MM:
            raise self.refuse("host_sync", "aten._grouped_mm copies its group offsets to the host inside a CUDA "
                              "capture (ATen's fallback in fp32; in bf16 too on an H100 with torch 2.11)")
        if func in _INDEX_OPS:
            if any(t.dtype == torch.bool for t in _tensors(args[1])):
                raise self.refuse("dynamic_shape", f"{name} with a boolean mask has a data-dependent shape")
            return
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
                kwargs.get("output_size") is None:
            raise self.refuse("dynamic_shape", f"{name} without `output_size` has a data-dependent shape")
        if torch.Tag.dynamic_output_shape in func.tags:
            raise self.refuse("dynamic_shape", f"{name} has a data-dependent output shape")

    def _save_outside_writes(self, func, args, kwargs) -> None:
        """Keep the value of every pre-existing tensor this op writes, to put it back after the capture."""
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in _tensors(value):
                key = (_storage(t), t.storage_offset(), tuple(t.shape), t.stride())
                if key[0] not in self.pool and key not in self._saved_keys:
                    self._saved_keys.add(key)
                    self.saved.append((t, t.clone()))

    def record_kernel(self, run: Callable, args: tuple, kwargs: dict) -> None:
        """A Triton launch: a graph node re-run with the same arguments (pointers and scalars frozen)."""
        for t in _tensors((args, kwargs)):
            if _storage(t) not in self.pool:
                self.external.setdefault(id(t), (t, t.data_ptr()))
        self.nodes.append(_Node(run, args, kwargs, None))

    def restore(self) -> None:
        for t, before in reversed(self.saved):
            t.copy_(before)
        self.saved.clear()


class GraphEmulator:
    """`GraphRuntime` on the CPU (see the module docstring). `counts`: captures, replays, warmups and refusals by
    kind."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._recording: _Recorder | None = None
        self._graphs: list[EmulatedGraph] = []

    def warmup(self, fn: Callable[[], Any]) -> Any:
        self.counts["warmups"] += 1
        return fn()

    def capture(self, fn: Callable[[], Any]) -> tuple[EmulatedGraph, Any]:
        recorder = _Recorder(self)
        self._recording = recorder
        try:
            with self._host_reads_refused(recorder), _triton_launches_recorded(recorder), recorder:
                out = fn()
            for t in _tensors(out):
                if _storage(t) not in recorder.pool:
                    raise recorder.refuse("untracked_output", f"a step output of shape {tuple(t.shape)} was not "
                                          "produced by a recorded op (a kernel called outside the dispatcher)")
        except Exception as err:  # a refusal that the code in between reported as another error (module docstring)
            if recorder.refusal is None or isinstance(err, CaptureError):
                raise
            raise recorder.refusal from err
        finally:
            self._recording = None
            recorder.restore()
        graph = EmulatedGraph(self, recorder.nodes, list(recorder.external.values()), recorder.pool,
                              torch.is_inference_mode_enabled())
        self._graphs.append(graph)
        self.counts["captures"] += 1
        return graph, out

    def pool_memory(self) -> PoolMemory:
        """Bytes the graphs allocated at capture (kept for replay; each graph's own, no sharing between them)."""
        size = sum(sum(g.pool.values()) for g in self._graphs)
        return PoolMemory(size, size)

    def _host_reads_refused(self, recorder: _Recorder) -> contextlib.ExitStack:
        def refused(name, original):
            def method(t, *args, **kwargs):
                if self._recording is recorder and not _in_kernel[0]:
                    raise recorder.refuse("host_sync", f"Tensor.{name}() reads device data on the host")
                return original(t, *args, **kwargs)
            return method

        stack = contextlib.ExitStack()
        for name in _HOST_METHODS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, refused(name, getattr(torch.Tensor, name))))
        return stack


_in_kernel = [False]  # inside a recorded Triton launch: the interpreter's own host copies are not the step's


@contextlib.contextmanager
def _triton_launches_recorded(recorder: _Recorder) -> Iterator[None]:
    """Record Triton launches (CPU interpreter) made during the capture as graph nodes."""
    try:
        from triton.runtime.interpreter import GridExecutor, InterpretedFunction
    except ImportError:
        yield
        return
    # Triton >= 3.3 launches through the class's `run`; Triton 3.2 through `GridExecutor.__call__` (its `run` is a
    # per-instance closure that builds a `GridExecutor` too)
    owner, attr = (InterpretedFunction, "run") if "run" in vars(InterpretedFunction) else (GridExecutor, "__call__")
    original = getattr(owner, attr)

    def run(fn, *args, **kwargs):
        def launch(*a, **k):
            _in_kernel[0] = True
            try:
                with _disable_current_modes():
                    return original(fn, *a, **k)
            finally:
                _in_kernel[0] = False

        out = launch(*args, **kwargs)
        recorder.record_kernel(launch, args, kwargs)
        return out

    with mock.patch.object(owner, attr, run):
        yield


@contextlib.contextmanager
def emulate_cuda_graphs() -> Iterator[GraphEmulator]:
    """Within the block, engines built on the CPU with `cuda_graphs=True` capture and replay their decode steps on a
    new `GraphEmulator` (yielded; an engine keeps it after the block)."""
    emulator = GraphEmulator()
    previous = set_emulator(emulator)
    try:
        yield emulator
    finally:
        set_emulator(previous)
