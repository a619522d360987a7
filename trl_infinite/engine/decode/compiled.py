"""Calling a `torch.compile`d decode step without paying for Dynamo's guards on every step.

A compiled function's every call first runs Dynamo's cache lookup: guards over each parameter and attribute the
step reads (hundreds of tensors for a model), then the prologue bytecode that gathers them, then the graph. For a
small model's decode step that lookup costs a sizeable part of the step. The engine knows what can change between
its steps: the batch bucket and the sampling settings (the dispatch `key`), and the parameters' storage (it calls
`reset` when they move). So per key:

1. the first call goes through `torch.compile` with every guard evaluated, compiling the step if needed;
2. the bytecode of the compiled entry that served that call (compiled by it, or earlier for another key or before a
   `reset`) is kept as a plain function and called directly from then on: the same compiled graph and the same
   prologue, no guard evaluation (as vLLM's compile wrapper calls the bytecode Dynamo produced).

Step 2 reads Dynamo's cache entries, which are not public API, so only on the torch releases it was checked on
(`FAST_DISPATCH_TORCH`: 2.13, CI's; 2.11, the GPU image's; 2.14 and 2.15, by hand, the compiled-step and graph-capture
tests): on any other release every call is a plain guarded call of the compiled function (the same outputs, each
step paying for the guards). The compiled function's entries (one per key) exceed Dynamo's default limit of 8 per
function: the limit is raised only around the calls that may compile (`guarded`), and left as it was.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch

# torch (major, minor) whose Dynamo cache step 2 reads
FAST_DISPATCH_TORCH = frozenset({(2, 11), (2, 13), (2, 14), (2, 15)})
_FIRST_CALLS = threading.Lock()  # a key's first call and the read of the entry that served it, one engine at a time
RECOMPILE_LIMIT = 256  # compiled entries per step function: one per (batch bucket, sampling settings, ...)
# Dynamo's setting for it: `recompile_limit` since torch 2.7, `cache_size_limit` before
RECOMPILE_LIMIT_SETTING = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def fast_dispatch_supported(version: str = torch.__version__) -> bool:
    """Whether this torch is one whose Dynamo cache the direct dispatch was checked on (see the module docstring)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return ((int(major), int(minor)) in FAST_DISPATCH_TORCH
            and hasattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list"))


class StepCompileError(RuntimeError):
    """`torch.compile` could not compile the decode step (a graph break under `fullgraph=True`, a backend failure),
    raised naming the setting, with Dynamo's error as its cause. `origin`: the first error in Dynamo's chain that
    Dynamo did not raise itself (what the backend or the traced code raised; None for Dynamo's own refusals, such as a
    graph break). Not a CUDA-graph capture problem unless `origin` is one (`cuda_graphs.is_capture_error`)."""

    def __init__(self, backend: str, err: BaseException):
        first = str(err).strip().split("\n\n")[0][:600]
        super().__init__(f"torch.compile (backend {backend!r}) could not compile the decode step: "
                         f"{type(err).__name__}: {first}\nThe step must trace as one graph; run it uncompiled with "
                         "EngineConfig(compile=False) (the same results) and report the error.")
        self.backend = backend
        self.origin = _origin(err)


def _origin(err: BaseException | None) -> BaseException | None:
    seen = 0
    while isinstance(err, torch._dynamo.exc.TorchDynamoException) and seen < 16:
        err, seen = getattr(err, "inner_exception", None) or err.__cause__, seen + 1
    return None if isinstance(err, torch._dynamo.exc.TorchDynamoException) else err


class CompiledStep:
    """`torch.compile(method, fullgraph=True)` with per-key dispatch (see the module docstring). `fast`: use the
    direct dispatch (default: where `fast_dispatch_supported`); False: every call guarded."""

    def __init__(self, method: Callable, backend: str, options: dict | None, fast: bool | None = None):
        self.compiled = torch.compile(method, fullgraph=True, backend=backend, options=options)
        self.backend = backend
        self.fast = fast_dispatch_supported() if fast is None else fast
        self._owner = method.__self__
        self._code = method.__func__.__code__
        self._globals = method.__func__.__globals__  # where Dynamo installs the compiled graph the bytecode calls
        self._direct: dict[tuple, Callable] = {}

    def reset(self) -> None:
        """Something the keys do not cover changed (parameters gathered into new storage): check every guard again
        at the next call of each key."""
        self._direct.clear()

    def entry(self, key: tuple) -> Callable | None:
        """The bytecode of the entry that served `key`'s first call, as a plain function of (owner, *args), or None.
        Calling it runs the compiled graph without entering Dynamo at all (what a graph capture records)."""
        direct = self._direct.get(key)
        return None if direct is None else lambda *args: direct(self._owner, *args)

    def guarded(self, *args) -> Any:
        """A call of the compiled function with every guard evaluated (compiling where none matches). A failure to
        compile raises `StepCompileError`."""
        limit = max(getattr(torch._dynamo.config, RECOMPILE_LIMIT_SETTING), RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(**{RECOMPILE_LIMIT_SETTING: limit}):
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.TorchDynamoException as err:
                raise StepCompileError(self.backend, err) from err

    def __call__(self, key: tuple, *args) -> Any:
        if not self.fast:
            return self.guarded(*args)
        direct = self._direct.get(key)
        if direct is not None:
            return direct(self._owner, *args)
        with _FIRST_CALLS:  # (the code object, so its cache, is shared by every engine's step)
            out = self.guarded(*args)
            code = _most_recent_entry(self._code)
        if code is not None:
            self._direct[key] = types.FunctionType(code, self._globals, self._code.co_name)
        return out


def _most_recent_entry(code: types.CodeType) -> types.CodeType | None:
    """The bytecode of the compiled entry of `code` that served its last call, or None where it has none: Dynamo's
    cache lookup puts the entry it compiles, or the one it finds, at the front of the function's cache."""
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    return entries[0].code if entries else None
