"""Block accounting for the paged KV pool: a free list and reference counts, no tensors.

The tensors live in `KVCachePool`; this class only decides which block ids are in use, so the trace simulator can
run the very same accounting without a model.
"""

from __future__ import annotations

from collections import deque


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
    """Fixed set of `num_blocks` blocks; `allocate` never goes past it (it raises, the scheduler checks first)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool must hold at least one block, got num_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.peak_used = 0
        self._used_sum = 0  # sum over `sample_usage` calls, for mean utilisation
        self._samples = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free (scheduler bug).")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice (scheduler bug).")

    def sample_usage(self) -> None:
        """Record the current usage once per step (for `kv_utilization`)."""
        self._used_sum += self.num_used
        self._samples += 1

    @property
    def mean_utilization(self) -> float:
        return self._used_sum / (self._samples * self.num_blocks) if self._samples else 0.0
