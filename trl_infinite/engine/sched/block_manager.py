"""Block accounting for the paged KV pool: a free list and reference counts, no tensors.

The tensors live in `KVCachePool`; this class only decides which block ids are in use, so the trace simulator can
run the very same accounting without a model.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from trl_infinite.engine.sched.prefix_cache import PrefixCache


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def pool_size(need_blocks: int) -> int:
    """`need_blocks` rounded up to 8 steps per power of two (at most 12.5% more), so calls of similar size get pools
    of the same size: a held pool is reused, and compiled decode steps see the same shapes."""
    if need_blocks <= 8:
        return max(1, need_blocks)
    step = 1 << (need_blocks.bit_length() - 4)
    return -(-need_blocks // step) * step


class BlockAllocator:
    """Fixed set of `num_blocks` blocks, ids `first_id .. first_id + num_blocks - 1` (a stable KV pool keeps id 0 for
    its null block); `allocate` never goes past it (it raises, the scheduler checks first).

    With a `PrefixCache`, a block whose last reference goes while it is cached becomes *evictable* instead of free:
    it still counts as free (`num_free`, `can_allocate`), `share` takes it back for a new reader, and `allocate`
    hands it out (dropping its cache entry), least recently used first, only when no never-cached block is left."""

    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None, first_id: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV pool must hold at least one block, got num_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self.first_id = first_id
        self._free: deque[int] = deque(range(first_id, first_id + num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._refs = [0] * (first_id + num_blocks)  # indexed by block id
        self.peak_used = 0
        self._used_sum = 0  # sum over `sample_usage` calls, for mean utilisation
        self._samples = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {self.num_free} free (scheduler bug).")
        out = []
        for _ in range(n):
            if self._free:
                out.append(self._free.popleft())
            else:  # the least recently used cached block nobody reads
                block, _ = self._evictable.popitem(last=False)
                self.cache.drop(block)
                out.append(block)
        for b in out:
            self._refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]  # a cache hit on an unreferenced block: in use again
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self.cache is not None and self.cache.is_cached(b):
                    self._evictable[b] = None  # most recently used last
                else:
                    self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice (scheduler bug).")

    def drop_cache(self) -> None:
        """Forget every cached block (weights changed, or the pool's contents are no longer trusted): the
        unreferenced ones become plain free blocks."""
        if self.cache is None:
            return
        self._free.extend(self._evictable)
        self._evictable.clear()
        self.cache.clear()

    def grown(self, num_blocks: int) -> BlockAllocator:
        """An allocator over `num_blocks >= self.num_blocks` blocks whose first `self.num_blocks` keep their
        references and cache entries (the pool's tensors grew with their contents kept); the rest are free."""
        first = self.first_id
        out = BlockAllocator(num_blocks, self.block_size, self.cache, first)
        out._refs[: len(self._refs)] = self._refs
        out._free = deque([*self._free, *range(first + self.num_blocks, first + num_blocks)])
        out._evictable = OrderedDict(self._evictable)
        return out

    def reset_counters(self) -> None:
        """Fresh peak and utilisation counters (a new call on the same blocks)."""
        self.peak_used = self.num_used
        self._used_sum = self._samples = 0

    def sample_usage(self) -> None:
        """Record the current usage once per step (for `kv_utilization`)."""
        self._used_sum += self.num_used
        self._samples += 1

    @property
    def mean_utilization(self) -> float:
        return self._used_sum / (self._samples * self.num_blocks) if self._samples else 0.0
