"""Host memory of CPU tensors: a caching allocator for large tensors, and giving freed memory back to the OS.

Why: PyTorch's CPU tensors come from the C library's `malloc`. glibc serves blocks below its dynamic mmap threshold
(it rises to 32 MiB after the first large free) from one heap, and the small allocations made between two large
ones (tensor metadata, Python objects) are carved out of the holes large frees leave, so a later large tensor no
longer fits and the heap grows. A gradient-checkpointed training forward of SmolLM2-135M on 4,262 packed tokens
grows the heap by ~80 MB per layer while its live tensors grow by 10 MB (`benchmarks/RESULTS-history.md`): the resident set
ends ~2 GB above what is live, and more tokens per step make it worse. A fixed low mmap threshold stops that but
maps and faults in fresh pages for every large tensor (20-25 % slower forward and backward here).

`install()` puts a caching allocator in front of PyTorch's CPU allocator (`c10::SetCPUAllocator`), in the manner of
PyTorch's CUDA caching allocator: a tensor of at least `MIN_BYTES` gets its own anonymous mapping, rounded up to a
size class (1/8 steps of a power of two, at most 12.5 % over); a freed one is kept for the next tensor of its class
(no page faults: each decoder layer asks for the same sizes as the last), least recently freed first given back to
the OS once more than `limit_bytes` are kept. Smaller tensors go to the previous allocator unchanged. `trim()` gives
every kept block back (and asks glibc to return its free heap pages, `malloc_trim`): for phase boundaries, such as
the end of a rollout. Values are unchanged: only where the bytes live. The extension is built on first use (cached
on disk, like the CPU decode kernel); if it cannot be built, `install` warns and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_BYTES = 1 << 20  # tensors below this stay with the default allocator

SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <algorithm>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {
constexpr size_t kMinBytes = MIN_BYTES;

size_t size_class(size_t n) {  // n rounded up to an eighth of its power of two (page multiple)
  size_t top = 63 - __builtin_clzll(n);
  size_t step = std::max<size_t>(size_t(1) << (top - 3), 4096);
  return (n + step - 1) / step * step;
}

class HostCache final : public c10::Allocator {
 public:
  explicit HostCache(c10::Allocator* previous) : previous_(previous) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return previous_->allocate(n);
    size_t size = size_class(n);
    void* p = take(size);
    if (p == nullptr) {  // mapped outside the lock
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(p != MAP_FAILED, "trl_infinite host cache: mapping ", size, " bytes failed");
      std::lock_guard<std::mutex> guard(mutex_);
      mapped_ += size;
      ++misses_;
      sizes_[p] = size;
    }
    return {p, p, &free_block, c10::Device(c10::DeviceType::CPU)};  // context == data: `raw_allocate` works too
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  static void free_block(void* p);

  void keep(void* p) {
    std::unique_lock<std::mutex> guard(mutex_);
    auto found = sizes_.find(p);
    if (found == sizes_.end()) {  // a small block `raw_allocate` took from the previous allocator
      guard.unlock();
      c10::DeleterFnPtr previous = previous_->raw_deleter();
      TORCH_CHECK(previous != nullptr, "trl_infinite host cache: no raw deleter for a block of the previous allocator");
      previous(p);
      return;
    }
    size_t size = found->second;
    sizes_.erase(found);
    free_[size].push_back(p);
    order_.emplace_back(size, p);
    cached_ += size;
    while (cached_ > limit_ && !order_.empty()) {  // give back the least recently freed
      auto [s, q] = order_.front();
      order_.pop_front();
      auto& blocks = free_[s];
      auto it = std::find(blocks.begin(), blocks.end(), q);
      if (it == blocks.end()) continue;  // reused since (and perhaps freed again: a later entry)
      blocks.erase(it);
      unmap(q, s);
    }
  }

  int64_t trim() {
    std::lock_guard<std::mutex> guard(mutex_);
    int64_t released = 0;
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) unmap(p, size);
      released += int64_t(size * blocks.size());
    }
    free_.clear();
    order_.clear();
    return released;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {int64_t(mapped_), int64_t(cached_), int64_t(hits_), int64_t(misses_), int64_t(limit_)};
  }

  void set_limit(size_t limit) {
    std::lock_guard<std::mutex> guard(mutex_);
    limit_ = limit;
  }

  c10::Allocator* previous_;

 private:
  void* take(size_t size) {  // a kept block of this class, now in use; nullptr if none
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    cached_ -= size;
    ++hits_;
    sizes_[p] = size;
    return p;
  }

  void unmap(void* p, size_t size) {  // caller holds the mutex
    munmap(p, size);
    mapped_ -= size;
    cached_ -= size;
  }

  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;  // blocks in use -> their size class
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::deque<std::pair<size_t, void*>> order_;
  size_t mapped_ = 0, cached_ = 0, hits_ = 0, misses_ = 0, limit_ = 0;
};

HostCache* cache = nullptr;  // never destroyed: tensors it allocated may outlive everything else
constexpr uint8_t kPriority = 50;

void HostCache::free_block(void* p) { cache->keep(p); }
}  // namespace

void install(int64_t limit) {
  if (cache == nullptr) cache = new HostCache(c10::GetCPUAllocator());
  cache->set_limit(size_t(limit));
  c10::SetCPUAllocator(cache, kPriority);
}

void uninstall() {
  if (cache != nullptr && c10::GetCPUAllocator() == cache) c10::SetCPUAllocator(cache->previous_, kPriority);
}

bool installed() { return cache != nullptr && c10::GetCPUAllocator() == cache; }

int64_t trim() { return cache == nullptr ? 0 : cache->trim(); }

std::vector<int64_t> stats() {
  return cache == nullptr ? std::vector<int64_t>{0, 0, 0, 0, 0} : cache->stats();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("uninstall", &uninstall);
  m.def("installed", &installed);
  m.def("trim", &trim);
  m.def("stats", &stats);
}
"""


@dataclass(frozen=True)
class HostCacheStats:
    """The caching allocator's state: bytes mapped (in use + kept), bytes kept for reuse, allocations served from
    kept blocks / by a new mapping, and the most bytes it keeps."""

    mapped_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    limit_bytes: int


@functools.cache
def _extension():
    """The compiled extension, or None (with one warning) where it cannot be built or the platform has no mmap."""
    if not sys.platform.startswith("linux"):
        return None
    from trl_infinite.engine.attention.extensions import load_extension

    logger.info("Loading the host tensor cache (built once per machine and torch release, about half a minute).")
    try:
        return load_extension("trl_infinite_host_cache", cpp_sources=[SOURCE],
                              extra_cflags=["-O2", f"-DMIN_BYTES={MIN_BYTES}"])
    except Exception as err:  # compiler, headers or ninja missing, ...
        logger.warning("The host tensor cache could not be built (%s); CPU tensors keep the default allocator.", err)
        return None


def install(limit_bytes: int) -> bool:
    """Put the caching allocator in front of PyTorch's CPU allocator for this process (again: only the limit
    changes), keeping at most `limit_bytes` of freed blocks. False where it cannot be built."""
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < 0:
        raise ValueError(f"`limit_bytes` must be a non-negative integer, got {limit_bytes!r}.")
    ext = _extension()
    if ext is None:
        return False
    ext.install(limit_bytes)
    return True


def _built():
    """The extension if an earlier call built it (None otherwise: these calls never build it)."""
    return _extension() if _extension.cache_info().currsize else None


def uninstall() -> None:
    """Back to the previous CPU allocator for new tensors (blocks still in use return to the cache when freed)."""
    if (ext := _built()) is not None:
        ext.uninstall()


def installed() -> bool:
    return (ext := _built()) is not None and ext.installed()


def stats() -> HostCacheStats:
    ext = _built()
    return HostCacheStats(*(ext.stats() if ext is not None else (0, 0, 0, 0, 0)))


def trim() -> int:
    """Give the freed memory back to the OS: every block the cache keeps, and glibc's free heap pages. Returns the
    cache's bytes released."""
    ext = _built()
    released = ext.trim() if ext is not None else 0
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
    return released


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn
