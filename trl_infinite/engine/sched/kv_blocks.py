"""The KV blocks of one call's prompts and samples (pure Python): a prompt's blocks with its prefix-cache hits,
completion caching, and divided rollout's host tier.

Every KV movement it decides is an order (`batch.SlotCopy`, `PrefillCopy`, `Swap`) kept in `moves` in the order
issued, which the scheduler hands over with the step's batch (the engine's pool carries them out).

With a prefix cache (`prefix_cache.py`, carried by the allocator), a prompt's leading full blocks found in the cache
are shared instead of allocated and only the rest is prefilled (at least its last token, whose logits give the first
tokens); its new full blocks are registered at once, so a prompt admitted later in the same step reads them (the
prefill runs the step's prompts in admission order, each layer writing every new token's KV before attending). The
first ids of the next block found inside a cached block (a partial hit) are copied by the prefill's layers
(`PrefillCopy`). With `cache_completions`, a finished sample's blocks past its prompt are registered too
(`cache_completion`), so the next turn of a tool loop prefills only what follows them.
"""

from __future__ import annotations

from trl_infinite.engine.outputs import RolloutStats
from trl_infinite.engine.sched.batch import KVMove, PrefillCopy, SlotCopy, Swap
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for
from trl_infinite.engine.sched.sequence import Group, Sequence


class KVBlocks:
    """Block bookkeeping of one call (`Scheduler.kv`); counts cache hits, cached completion blocks and offloaded
    blocks in the call's `stats`."""

    def __init__(self, allocator: BlockAllocator, stats: RolloutStats, cache_completions: bool = False):
        """`cache_completions`: register finished samples' completion blocks in the prefix cache (useful when a
        later call continues the conversation)."""
        self.allocator = allocator
        self.cache = allocator.cache
        self.block_size = allocator.block_size
        self.stats = stats
        self.cache_completions = cache_completions and self.cache is not None
        self.moves: list[KVMove] = []  # issued since the last `take_moves`
        self._keys: dict[int, list[int]] = {}  # group_id -> chain keys of its prompt's full blocks
        self._pinned: list[int] = []  # sources of this step's partial-hit copies, held until its forward ran
        # destination slot -> source slot of this step's partial-hit copies: a later copy whose source slot is an
        # earlier copy's destination reads that copy's source (all copies of a forward are one gather, then one
        # scatter)
        self._copied: dict[int, int] = {}

    def take_moves(self) -> list[KVMove]:
        moves, self.moves = self.moves, []
        return moves

    def end_step(self) -> None:
        """The step's forward ran: its partial-hit copies are made, their sources no longer pinned."""
        self.allocator.free(self._pinned)
        self._pinned = []
        self._copied = {}

    def own_need(self, seq: Sequence, lookahead: int) -> int:
        """Own blocks `seq` needs: KV slots for every output token (the last one's KV is written by this step's
        forward) + drafts; a sample without tokens yet reserves the slot of its first token."""
        return blocks_for(max(seq.num_generated, 1) + lookahead, self.block_size)

    def _prompt_keys(self, group: Group) -> list[int]:
        keys = self._keys.get(group.group_id)
        if keys is None:
            keys = self._keys[group.group_id] = self.cache.keys(group.prompt_ids, group.prompt_len // self.block_size)
        return keys

    def _prompt_hits(self, group: Group) -> list[int]:
        """Cached blocks for the prompt's leading full blocks, short of its last token (prefilled for its logits)."""
        if self.cache is None:
            return []
        return self.cache.match(group.prompt_ids, self._prompt_keys(group)[: (group.prompt_len - 1) // self.block_size])

    def prompt_need(self, group: Group) -> int:
        """Blocks that making the prompt resident takes from the free count (hits on blocks in use take none)."""
        hits = self._prompt_hits(group)
        return blocks_for(group.prompt_len, self.block_size) - sum(1 for b in hits if self.allocator.refs(b) > 0)

    def allocate_prompt(self, group: Group, reserve: int) -> None:
        """The prompt's blocks: its cache hits shared, the rest allocated and registered (their KV is computed by
        this step's prefill, before anything admitted later reads it). `reserve`: blocks the caller allocates next
        (a partial hit's source is pinned only if that leaves them free)."""
        hits, bs = self._prompt_hits(group), self.block_size
        self.allocator.share(hits)  # first: the allocation below may evict unreferenced cached blocks
        count = blocks_for(group.prompt_len, bs) - len(hits)
        parent = self.cache.serial(hits[-1]) if hits else 0
        partial = None
        if self.cache is not None:  # the next block's first ids, short of the prompt's last token
            start = len(hits) * bs
            partial = self.cache.partial(group.prompt_ids[start:], parent, min(bs, group.prompt_len - 1 - start))
            if (partial is not None and self.allocator.refs(partial[0]) == 0
                    and not self.allocator.can_allocate(count + 1 + reserve)):
                partial = None  # pinning the source would take a block the prompt needs
            if partial is not None:
                self.allocator.share([partial[0]])  # pinned until the step's forward copied it (`end_step`)
                self._pinned.append(partial[0])
        fresh = self.allocator.allocate(count)
        group.prompt_blocks = hits + fresh
        group.num_cached = len(hits) * bs
        if partial is not None:
            src, m = partial
            copy = PrefillCopy(group.group_id, tuple(self._copied.get(src * bs + t, src * bs + t) for t in range(m)),
                               tuple(fresh[0] * bs + t for t in range(m)))
            self._copied.update(zip(copy.dst, copy.src))
            self.moves.append(copy)
            group.num_cached += m
        if self.cache is None:
            return
        self.stats.prefix_cache_hit_tokens += group.num_cached
        keys = self._prompt_keys(group)
        for i in range(len(hits), len(keys)):
            parent = self.cache.insert(group.prompt_blocks[i], keys[i], tuple(group.prompt_ids[i * bs:(i + 1) * bs]),
                                       parent)
            if parent is None:  # its key is another prefix's (a hash collision): the rest stays uncached
                break

    def free_prompt(self, group: Group) -> None:
        self.allocator.free(group.prompt_blocks)
        group.prompt_blocks = []

    def cache_completion(self, seq: Sequence) -> None:
        """Register `seq`'s prompt + completion past its prompt's full blocks (see the module docstring): the
        positions whose KV is written (all but the last output token), after a cached chain; the full blocks, then
        the last, partial one (found only by `PrefixCache.partial`: the next turn copies its ids' KV). Grid block
        `i` (positions `[i * B, (i + 1) * B)`) goes into the sample's own block `i - P // B`: where the prompt ends
        inside a block the KV is shifted there (one `SlotCopy`, no new block: the sample is finished, nothing reads
        its own blocks any more)."""
        if not self.cache_completions:
            return
        group, bs, cache = seq.group, self.block_size, self.cache
        plen, end = group.prompt_len, seq.num_tokens - 1  # the positions whose KV is written
        if not seq.blocks or not group.resident or end <= plen:
            return
        ids = group.prompt_ids + seq.output_ids
        full, first = end // bs, plen // bs
        keys = cache.keys(ids, full)
        held = cache.match(ids, keys)
        start = len(held)
        if start < first or start * bs >= end:  # the prompt's chain is not cached, or nothing new is
            return
        self.allocator.share(held)  # pinned while a block is taken for the shifted tail
        pinned, blocks = list(held), list(seq.blocks)
        try:
            if end > full * bs and full - first == len(blocks):  # the shift carries the tail past the own blocks
                if plen % bs and group.num_finished == group.num_generations - 1:
                    # the group's last sample: the prompt's partial block is no one else's and is freed with it
                    blocks.append(group.prompt_blocks[first])
                    self.allocator.share(blocks[-1:])
                    pinned.append(blocks[-1])
                elif not self.allocator.can_allocate(1):
                    end = full * bs
                else:
                    blocks += self.allocator.allocate(1)  # free or evictable anyway: the room does not shrink
                    pinned.append(blocks[-1])
            if plen % bs and start * bs < end:
                self.moves.append(SlotCopy(tuple(self._slot(seq, p) for p in range(start * bs, end)),
                                           tuple(blocks[p // bs - first] * bs + p % bs for p in range(start * bs, end))))
            parent = cache.serial(held[-1]) if held else 0
            for i in range(start, full):
                parent = cache.insert(blocks[i - first], keys[i], tuple(ids[i * bs:(i + 1) * bs]), parent)
                if parent is None:
                    return
                self.stats.cached_completion_blocks += 1
            if end > full * bs:
                tokens = tuple(ids[full * bs:end])
                if cache.insert(blocks[full - first], cache.hash_fn(keys[-1] if full else 0, tokens), tokens,
                                parent) is not None:
                    self.stats.cached_completion_blocks += 1
        finally:
            self.allocator.free(pinned)

    def _slot(self, seq: Sequence, pos: int) -> int:
        """Pool slot holding position `pos` of `seq` (prompt blocks, then its own blocks from the prompt's end)."""
        plen, bs = seq.prompt_len, self.block_size
        if pos < plen:
            return seq.group.prompt_blocks[pos // bs] * bs + pos % bs
        own = pos - plen
        return seq.blocks[own // bs] * bs + own % bs

    def offload(self, seq: Sequence) -> None:
        """Move the KV of parked `seq` to the host tier, freeing its blocks."""
        self.moves.append(Swap(seq.seq_id, tuple(seq.blocks), to_host=True))
        seq.host_blocks = len(seq.blocks)
        self.stats.offloaded_blocks += len(seq.blocks)
        self.allocator.free(seq.blocks)
        seq.blocks = []

    def resume(self, seq: Sequence, lookahead: int) -> tuple[bool, bool]:
        """A parked sample comes back with its KV: still in the pool, or copied back from the host tier. Returns
        (resumed: it had KV, grown: it got new blocks)."""
        host, seq.host_blocks = seq.host_blocks, 0
        if not seq.blocks and not host:
            return False, False
        extra = self.own_need(seq, lookahead) - len(seq.blocks)
        if extra > 0:
            seq.blocks.extend(self.allocator.allocate(extra))
        if host:
            self.moves.append(Swap(seq.seq_id, tuple(seq.blocks[:host]), to_host=False))
        return True, extra > 0
