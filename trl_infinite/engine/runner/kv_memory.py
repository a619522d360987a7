"""Reserved address ranges for the KV pool: addresses fixed for the engine's life, memory held only during a call.

A captured CUDA graph replays on the addresses it recorded. The KV pool is released after every call (so the training
step between two rollouts has that memory) and sized anew for the next one; allocated again through PyTorch's
allocator it lands elsewhere, and every graph of the decode step must be captured again inside the next call (its
warm-ups and captures timed as decoding, its pool memory counted twice). vLLM keeps its KV cache's virtual
addresses across sleep / wake for this reason, and so does this module:

- `ReservedRange` reserves one virtual address range for every part (a layer's K or V tensor at the pool's largest
  size), each part starting on an allocation-granularity boundary, and hands out tensors over each part's whole
  range once (`tensor`): their addresses never change;
- `map(prefix_bytes)` backs the first `prefix_bytes[i]` bytes of part i with memory (rounded up to the
  granularity), zero-filled, keeping what is mapped already; `unmap()` gives all of it back, the addresses stay
  reserved.

Two implementations of the same rules:
- CUDA: the driver's virtual memory management (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemUnmap`,
  called through ctypes on `libcuda`, as vLLM's `CuMemAllocator` does in C++). The memory is outside PyTorch's
  caching allocator: `torch.cuda.mem_get_info` sees it, `memory_allocated` does not (the pool counts it itself);
- CPU: one anonymous private mapping (`MAP_NORESERVE`) whose pages are given back with `madvise(MADV_DONTNEED)`
  (they read as zeros when touched again), so a CPU run (and the CUDA-graph emulation in CI) keeps the same rule.

`reserve_range` returns None, with the reason, where neither applies (another device type, a driver without virtual
memory management); the pool then allocates through PyTorch as before and graphs are captured again when it moves
(`RolloutStats.graph_captures` counts them).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def _round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


class ReservedRange:
    """Parts of `sizes[i]` bytes at fixed addresses, backed by memory only where `map` says (see the module
    docstring). Subclasses implement `_reserve`, `_back`, `_release_all` and `_as_tensor`."""

    granularity: int

    def __init__(self, sizes: Sequence[int], device: torch.device):
        self.device = device
        self.sizes = [_round_up(max(int(s), 1), self.granularity) for s in sizes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.mapped = [0] * len(self.sizes)  # bytes backed at the start of each part
        self.base = self._reserve(self.total)
        self._bytes = self._as_tensor(self.base, self.total)  # uint8 over the whole range (no memory touched)

    @property
    def mapped_bytes(self) -> int:
        return sum(self.mapped)

    def overhead_bytes(self) -> int:
        """The most `map` can back beyond what was asked: one granule per part (the rounding)."""
        return self.granularity * len(self.sizes)

    def tensor(self, part: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor over part `part` from `offset` bytes into it (a multiple of the dtype's size; index only what is
        mapped)."""
        start = self.offsets[part] + offset
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > self.sizes[part]:
            raise ValueError(f"a {shape} {dtype} tensor at {offset} needs {offset + nbytes} bytes; part {part} holds "
                             f"{self.sizes[part]}.")
        return self._bytes[start : start + nbytes].view(dtype).view(shape)

    def map(self, prefix_bytes: Sequence[int]) -> None:
        """Back at least the first `prefix_bytes[i]` bytes of each part (what is backed already stays, contents
        included); newly backed bytes read as zeros."""
        for i, want in enumerate(prefix_bytes):
            want = min(_round_up(int(want), self.granularity), self.sizes[i])
            if want > self.mapped[i]:
                start = self.offsets[i] + self.mapped[i]
                self._back(start, want - self.mapped[i])
                self._bytes[start : self.offsets[i] + want].zero_()
                self.mapped[i] = want

    def unmap(self) -> None:
        """Give every backed byte back; the addresses stay reserved (and the tensors valid for the next `map`)."""
        if self.mapped_bytes:
            self._release_all()
        self.mapped = [0] * len(self.sizes)

    # implementation
    def _reserve(self, total: int) -> int:
        raise NotImplementedError

    def _back(self, start: int, nbytes: int) -> None:
        raise NotImplementedError

    def _release_all(self) -> None:
        raise NotImplementedError

    def _as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        raise NotImplementedError


class HostReservedRange(ReservedRange):
    """CPU: an anonymous mapping reserved without swap accounting (see the module docstring)."""

    granularity = mmap.PAGESIZE

    def _reserve(self, total: int) -> int:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        self._map = mmap.mmap(-1, total, flags=flags)
        return ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def _back(self, start: int, nbytes: int) -> None:
        pass  # anonymous pages are backed (and zero) on first touch

    def _release_all(self) -> None:
        for offset, mapped in zip(self.offsets, self.mapped):
            if mapped:
                self._map.madvise(mmap.MADV_DONTNEED, offset, mapped)

    def _as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _LOCATION_DEVICE, _READ_WRITE, _GRANULARITY_RECOMMENDED = 1, 1, 3, 1


class _CudaArray:
    """`__cuda_array_interface__` over raw device memory, so `torch.as_tensor` wraps it without a copy."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


class CudaReservedRange(ReservedRange):
    """CUDA: the driver's virtual memory management through ctypes (one physical allocation per mapped stretch:
    `cuMemMap` maps a whole allocation)."""

    def __init__(self, sizes: Sequence[int], device: torch.device):
        self._cuda = ctypes.CDLL("libcuda.so.1")
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        torch.zeros(1, device=device)  # the primary context, current on this thread
        self._prop = _AllocationProp(type=_PINNED, location=_Location(_LOCATION_DEVICE, index))
        self._access = _AccessDesc(location=_Location(_LOCATION_DEVICE, index), flags=_READ_WRITE)
        granularity = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self._prop),
                    _GRANULARITY_RECOMMENDED)
        self.granularity = granularity.value
        self._handles: list[tuple[int, int, int]] = []  # (address, bytes, handle)
        super().__init__(sizes, device)

    def _check(self, name: str, *args) -> None:
        result = getattr(self._cuda, name)(*args)
        if result != 0:
            raise RuntimeError(f"{name} failed with CUresult {result}")

    def _reserve(self, total: int) -> int:
        address = ctypes.c_uint64()
        self._check("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(total),
                    ctypes.c_size_t(self.granularity), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return address.value

    def _back(self, start: int, nbytes: int) -> None:
        handle = ctypes.c_uint64()
        self._check("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(self._prop),
                    ctypes.c_ulonglong(0))
        address = self.base + start
        try:
            self._check("cuMemMap", ctypes.c_uint64(address), ctypes.c_size_t(nbytes), ctypes.c_size_t(0), handle,
                        ctypes.c_ulonglong(0))
        except RuntimeError:
            self._cuda.cuMemRelease(handle)
            raise
        self._handles.append((address, nbytes, handle.value))
        self._check("cuMemSetAccess", ctypes.c_uint64(address), ctypes.c_size_t(nbytes), ctypes.byref(self._access),
                    ctypes.c_size_t(1))

    def _release_all(self) -> None:
        torch.cuda.synchronize(self.device)  # no kernel may still read the pages
        for address, nbytes, handle in self._handles:
            self._check("cuMemUnmap", ctypes.c_uint64(address), ctypes.c_size_t(nbytes))
            self._check("cuMemRelease", ctypes.c_uint64(handle))
        self._handles.clear()

    def _as_tensor(self, address: int, nbytes: int) -> torch.Tensor:
        # torch asks the driver which device the pointer belongs to (`cudaPointerGetAttributes`) once, here: an
        # address reserved but not backed reads as host memory ("The specified pointer resides on host memory"), so
        # the first granule is backed while the tensor is made, and given back after
        self._back(address - self.base, self.granularity)
        try:
            return torch.as_tensor(_CudaArray(address, nbytes), device=self.device)
        finally:
            self._release_all()


def reserve_range(sizes: Sequence[int], device: torch.device) -> ReservedRange | None:
    """A `ReservedRange` for `device`, or None (logged, with the reason) where the device cannot reserve addresses."""
    try:
        if device.type == "cpu":
            return HostReservedRange(sizes, device)
        if device.type == "cuda":
            return CudaReservedRange(sizes, device)
        reason = f"no address reservation on {device.type}"
    except (OSError, RuntimeError, AttributeError, ValueError) as err:
        reason = f"{type(err).__name__}: {err}"
    logger.warning("The KV pool cannot keep its addresses across calls (%s): it is allocated per call, and the "
                   "decode step's CUDA graphs are captured again whenever it moves (rollout/graph_captures).", reason)
    return None
