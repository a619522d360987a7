"""One caller at a time per model: what the engine changes on a model is changed by one thread only, and restored.

While it runs, the engine switches the model's attention implementation to the paged one and puts the model in
eval mode; both are restored on exit (also on error or `KeyboardInterrupt`), each by the context manager that set
it. Two threads doing that on one model at once would each save the other's temporary state and "restore" it, and
would share the KV pool, the decode rows and the scheduler's tables. `model_guard(model)` serialises every engine
call on a model (all engines built on it, and those using it as their draft model): a second thread waits until
the first call returns. A call made from
inside a running call on the same thread (e.g. from an `on_sample_finished` callback) is refused with a
`RuntimeError`: waiting would deadlock, and running it would corrupt the running call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from weakref import WeakKeyDictionary

import torch

_registry_lock = threading.Lock()
_locks: WeakKeyDictionary[torch.nn.Module, _ModelLock] = WeakKeyDictionary()


class _ModelLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: int | None = None  # thread id of the running call


def _lock_of(model: torch.nn.Module) -> _ModelLock:
    with _registry_lock:
        return _locks.setdefault(model, _ModelLock())


@contextmanager
def model_guard(model: torch.nn.Module, what: str = "RolloutEngine.generate",
                also: torch.nn.Module | None = None) -> Iterator[None]:
    """Hold the model for one engine call (see the module docstring); `also`: a second model held with it (the
    draft model, whose attention the call switches too), both taken in one global order (no deadlock between two
    engines whose target and draft are swapped)."""
    if also is None or also is model:
        with _guard(model, what):
            yield
        return
    first, second = sorted((model, also), key=id)
    with _guard(first, what), _guard(second, what):
        yield


@contextmanager
def _guard(model: torch.nn.Module, what: str) -> Iterator[None]:
    state = _lock_of(model)
    if state.owner == threading.get_ident():
        raise RuntimeError(f"{what} was called while another rollout engine call on the same model is running on this "
                           "thread (e.g. from an `on_sample_finished` callback); one engine call per model at a time.")
    state.lock.acquire()
    state.owner = threading.get_ident()
    try:
        yield
    finally:
        state.owner = None
        state.lock.release()
