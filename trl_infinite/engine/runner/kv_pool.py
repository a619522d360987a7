"""The paged KV pool: K and V tensors for every attention layer, allocated once from the configured budget."""

from __future__ import annotations

import torch

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.runner.kv_layout import KVLayout
from trl_infinite.engine.runner.kv_memory import ReservedRange, reserve_range
from trl_infinite.engine.sched.batch import KVMove, SlotCopy, Swap
from trl_infinite.engine.sched.block_manager import BlockAllocator
from trl_infinite.engine.sched.prefix_cache import PrefixCache

GB = 1e9


class KVCachePool:
    """`num_blocks` usable blocks of `block_size` tokens per layer, plus one null block (id `num_blocks`) that padded
    decode rows of a static batch write to and read from: `k_caches[i]` is [(num_blocks + 1) * B, Hkv_i, Dk_i] and
    `v_caches[i]` is [(num_blocks + 1) * B, Hkv_i, Dv_i]. The null block is part of the budget. `layout` is a
    `KVLayout` (or a config, read by `from_config`).

    The budget (`EngineConfig.kv_cache`: `kv_cache_tokens` / `kv_cache_gb` / `kv_cache_fraction`) bounds the pool; the engine
    sizes it for each call from what the call can use (`open`) and gives the memory back after it (`release`), so
    a training step running between two rollouts has that memory.

    With `prefix_cache` on, the pool's allocator carries a `PrefixCache`: full blocks of earlier prompts (and
    completions) stay findable until their blocks are needed (`BlockAllocator`). The entries outlive a call only
    while the pool is kept (`kv_cache_release=False`, or the engine's `keep_pool`): a pool that must grow keeps
    them (contents copied, through host memory where old and new tensors would not fit in the budget together).

    `stable=True` (the engine's choice where decode steps are captured in graphs): the K and V tensors keep their
    addresses for the pool's life (`kv_memory.ReservedRange`: reserved once at the largest size the budget allows,
    backed with memory per call and given back by `release`), so a captured decode step replays across calls
    instead of being captured again. The null block is then block 0 and the usable blocks 1..num_blocks: the
    backed part of each tensor is one stretch from its start, which grows in place (`_grow` copies nothing)."""

    def __init__(self, layout, config: EngineConfig, dtype: torch.dtype, device: torch.device, reserve_bytes: int = 0,
                 allocate: bool = True, stable: bool = False, companion_block_bytes: int = 0):
        """`reserve_bytes`: taken out of a `kv_cache_fraction` budget first (the captured decode step's memory).
        `companion_block_bytes`: bytes another pool holds per block of this one (a draft model's pool, which
        mirrors this pool's blocks): a byte budget (`kv_cache_gb`, `kv_cache_fraction`) pays for both.
        `allocate=False`: no tensors until `open` sizes the pool for a call (the engine's way). `stable`: fixed
        addresses (see the class docstring; falls back to per-call allocation, with a warning, where the device
        cannot reserve addresses)."""
        self.reserve_bytes = reserve_bytes
        self.companion_block_bytes = companion_block_bytes
        self.stable = stable
        self._range: ReservedRange | None = None  # the reserved addresses (stable pools, from the first allocation)
        self._views: list[torch.Tensor] = []  # K tensors then V tensors over the whole reserved range
        self._capacity = 0  # usable blocks the reserved range holds
        self.layout = layout if isinstance(layout, KVLayout) else KVLayout.from_config(layout)
        self.block_size = config.block_size
        self.dtype = dtype
        self.device = device
        self.config = config
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.null_block = 0
        self.prefix_cache = PrefixCache(self.block_size) if config.prefix_cache else None
        self.host: dict[int, list[torch.Tensor]] = {}  # divided rollout's host tier: K/V of swapped-out blocks
        self.allocator = BlockAllocator(1, self.block_size)  # replaced when the pool is sized
        if allocate:
            self._allocate(self.budget_blocks())
        else:
            self.budget_blocks()  # validates the budget now, not at the first call

    @property
    def allocated(self) -> bool:
        return bool(self.k_caches)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the K and V tensors held now (null block included; 0 when released): a stable pool's backed
        memory (granularity rounding included)."""
        if self._range is not None:
            return self._range.mapped_bytes
        return sum(t.numel() * t.element_size() for t in (*self.k_caches, *self.v_caches))

    @property
    def first_block(self) -> int:
        """Id of the first usable block: 1 in a stable pool (block 0 is its null block), else 0."""
        return 1 if self._range is not None else 0

    def budget_blocks(self) -> int:
        """Usable blocks the budget allows now (the null block taken out). A `kv_cache_fraction` budget is read
        from the memory free at this moment plus what PyTorch's allocator holds unused and this pool's own tensors,
        which would be freed first (so the pool follows the memory training leaves, call by call)."""
        n = self._num_blocks(self.config) - 1
        return min(n, self._capacity) if self._range is not None else n

    def open(self, need_blocks: int) -> None:
        """Size the pool for one call: `min(need_blocks, budget)` usable blocks, all free. A held pool at least that
        large is reused (fresh accounting); otherwise it is allocated anew (zeroed)."""
        if self.stable and self._range is None:
            self._reserve()  # first: a byte budget then leaves room for the reservation's rounding
        budget = self.budget_blocks()
        blocks = max(1, min(int(need_blocks), budget))
        if self.allocated and self.num_blocks < blocks and self.prefix_cache:
            self._grow(blocks, staged=self.num_blocks + 1 + blocks > budget)  # cached blocks kept
        elif not self.allocated or self.num_blocks < blocks:
            self.release()
            self._allocate(blocks)
        self.reset()

    def release(self) -> None:
        """Free the K and V tensors (the memory goes back to the allocator, e.g. for the training step); every
        cached prefix goes with them."""
        self.k_caches, self.v_caches = [], []
        if self._range is not None:
            self._range.unmap()
        self.num_blocks = 0
        self.allocator = BlockAllocator(1, self.block_size)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _grow(self, usable_blocks: int, staged: bool) -> None:
        """Larger tensors holding the old blocks' contents at the same ids (the old null block becomes usable).
        `staged`: old and new tensors would not fit in the budget together, so the old contents wait in host memory
        while the pool is re-allocated."""
        if self._range is not None:  # the backed stretch grows in place: nothing moves
            self._map(usable_blocks)
            self.allocator = self.allocator.grown(usable_blocks)
            return
        old = [*self.k_caches, *self.v_caches]
        old_slots, allocator = self.num_blocks * self.block_size, self.allocator
        if staged:
            old = [t[:old_slots].cpu() for t in old]
            self.k_caches, self.v_caches = [], []  # freed before the new pool is allocated
        self._allocate(usable_blocks)
        for new, saved in zip((*self.k_caches, *self.v_caches), old):
            new[:old_slots] = saved[:old_slots].to(self.device)
        del old
        self.allocator = allocator.grown(usable_blocks)

    def _shapes(self, usable_blocks: int) -> list[tuple[int, int, int]]:
        """[slots, heads, width] of every K tensor, then every V tensor, for `usable_blocks` plus the null block."""
        slots, lay = (usable_blocks + 1) * self.block_size, self.layout
        return ([(slots, h, d) for h, d in zip(lay.num_kv_heads, lay.k_dims)]
                + [(slots, h, d) for h, d in zip(lay.num_kv_heads, lay.v_dims)])

    def _map(self, usable_blocks: int) -> None:
        """Back a stable pool's first `usable_blocks` + 1 blocks (null block first) and point the caches at them."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        self._range.map([s * h * d * elem for s, h, d in self._shapes(usable_blocks)])
        self.num_blocks = usable_blocks
        lay = self.layout
        self.k_caches, self.v_caches = self._views[: lay.num_layers], self._views[lay.num_layers :]

    def _reserve(self) -> None:
        """A stable pool's address range, once, at the largest size its budget can ever give (`capacity_blocks`)."""
        capacity = self.capacity_blocks()
        elem = torch.empty((), dtype=self.dtype).element_size()
        shapes = self._shapes(capacity)
        self._range = reserve_range([s * h * d * elem for s, h, d in shapes], self.device)
        if self._range is None:  # logged: allocated per call instead
            self.stable = False
            return
        self._views = [self._range.tensor(i, self.dtype, shape) for i, shape in enumerate(shapes)]
        self._capacity = capacity

    def capacity_blocks(self) -> int:
        """Usable blocks a stable pool reserves addresses for: the budget's, or for a `kv_cache_fraction` budget on
        CUDA the fraction of the device's whole memory (no call can be given more)."""
        kv = self.config.kv_cache
        if self.device.type == "cuda" and kv.tokens is None and kv.gb is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            return max(1, int(total * kv.fraction // self.budget_block_bytes) - 1)
        return self.budget_blocks()

    def _allocate(self, usable_blocks: int) -> None:
        if self.stable and self._range is None:
            self._reserve()
        if self._range is not None:
            usable_blocks = min(usable_blocks, self._capacity)
            self.null_block = 0
            self._map(usable_blocks)
            self.allocator = BlockAllocator(usable_blocks, self.block_size, self.prefix_cache, first_id=1)
            return
        self.num_blocks = usable_blocks
        self.null_block = usable_blocks
        shapes = self._shapes(usable_blocks)
        lay = self.layout
        # One allocation carved into per-layer views: freed as a whole (on CPU a block this large is its own mapping,
        # given back to the OS at once; many per-layer tensors would stay in the heap and fragment it)
        storage = torch.zeros(sum(s * h * d for s, h, d in shapes), dtype=self.dtype, device=self.device)
        views = [t.view(shape) for t, shape in zip(storage.split([s * h * d for s, h, d in shapes]), shapes)]
        self.k_caches, self.v_caches = views[: lay.num_layers], views[lay.num_layers :]
        self.allocator = BlockAllocator(usable_blocks, self.block_size, self.prefix_cache)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * self.layout.elements_per_token() * elem

    @property
    def budget_block_bytes(self) -> int:
        """Bytes a byte budget pays per block: this pool's and its companion's (a draft model's pool)."""
        return self.block_bytes + self.companion_block_bytes

    def _num_blocks(self, config: EngineConfig) -> int:
        kv = config.kv_cache
        if kv.tokens is not None:
            n, field = kv.tokens // self.block_size, kv.flag("tokens")
        elif kv.gb is not None:
            n, field = int((kv.gb * GB - self._rounding_bytes()) // self.budget_block_bytes), kv.flag("gb")
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            n = int(((free + cached + self.allocated_bytes) * kv.fraction - self.reserve_bytes
                     - self._rounding_bytes()) // self.budget_block_bytes)
            field = kv.flag("fraction")
        else:
            n, field = kv.cpu_tokens // self.block_size, kv.flag("cpu_tokens")
        if n < 2:
            draft = (f", {self.companion_block_bytes} of them the draft model's pool (`speculative_draft_model`)"
                     if self.companion_block_bytes else "")
            raise ValueError(f"`{field}` gives a KV pool of less than two blocks ({self.block_size} tokens, "
                             f"{self.budget_block_bytes} bytes each{draft}; one is the null block of padded decode "
                             "rows); raise it.")
        return n

    def _rounding_bytes(self) -> int:
        """What a stable pool's backing may add to its blocks' bytes (one granule per tensor), inside byte budgets."""
        return self._range.overhead_bytes() if self._range is not None else 0

    def reset(self, keep_cache: bool = True) -> None:
        """Every block unreferenced, for a new call. Cached blocks stay findable when `keep_cache` and nothing is
        referenced (a call that ended normally); otherwise the cache is dropped. The host tier is emptied."""
        self.host.clear()
        if keep_cache and self.prefix_cache is not None and self.allocator.num_used == 0 and self.allocated:
            self.allocator.reset_counters()
            return
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.allocator = BlockAllocator(self.num_blocks, self.block_size, self.prefix_cache, self.first_block)

    def drop_cache(self) -> None:
        """Forget every cached prefix (the weights changed)."""
        self.allocator.drop_cache()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def zero(self) -> None:
        """Zero every cached key and value (after a call whose values were not finite); no prefix stays cached."""
        self.drop_cache()
        slots = (self.num_blocks + 1) * self.block_size  # what is backed (a stable pool's tensors reach further)
        for t in (*self.k_caches, *self.v_caches):
            t[:slots].zero_()

    def apply(self, moves: list[KVMove]) -> None:
        """Carry out a batch's KV moves (`sched/batch.py`) in their order: slot copies (every source read before
        any write), and the host tier's swaps out (kept in `host` under the move's key) and back in. A `PrefillCopy`
        is not done here: the layers of the forward that prefills its prompt make it (`Segment.copies`)."""
        caches, bs = (*self.k_caches, *self.v_caches), self.block_size
        for move in moves:
            if isinstance(move, SlotCopy):
                src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (move.src, move.dst))
                for t in caches:
                    t[dst] = t[src]
            elif isinstance(move, Swap):
                slots = torch.tensor([b * bs + i for b in move.blocks for i in range(bs)], device=self.device)
                if move.to_host:
                    self.host[move.key] = [t[slots].cpu() for t in caches]
                else:
                    for t, saved in zip(caches, self.host.pop(move.key)):
                        t[slots] = saved.to(self.device)
