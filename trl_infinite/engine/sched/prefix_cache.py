"""Automatic prefix caching: full KV blocks found again by the token ids they hold and everything before them.

Block `i` of a token sequence holds positions `[i * B, (i + 1) * B)`; its key is a hash chain,
`h_i = hash(h_{i-1}, ids[i * B:(i + 1) * B])` (`h_{-1} = 0`), as vLLM's automatic prefix caching. A block whose
KV was computed for such a prefix is registered under its key; a later sequence that starts with the same ids (another
prompt of the call sharing a system prompt or few-shot header, the next turn of a tool loop, a later call) maps those
blocks into its own block table instead of prefilling them again: shared copy-free, read-only (a sample writes only
its own blocks). A lookup never trusts the hash alone: a hit compares the block's ids, and its parent entry must be
the entry matched one block before (entries get serial numbers that are never reused), so a hash collision or a
recycled block id is a miss, never a wrong hit.

A finished completion's last, partial block is registered too (its entry holds fewer than B ids, so only `partial`
finds it). A prompt whose shared part ends inside a block (a 200-token header in 16-token blocks) takes the first ids
of that block from a cached block after the same prefix (`partial`), copied by the prefill forward's layers
(`kv_blocks.KVBlocks.allocate_prompt`), not run through the model.

Reference counts live in the `BlockAllocator`, which evicts cached blocks nobody references.

Pure Python (no torch): the scheduler and the trace simulator share it. The engine drops every entry when the
model's weights may have changed (`weight_state.py`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFn = Callable[[int, tuple[int, ...]], int]
PARTIAL_SCAN = 64  # most recent children of a block scanned for a partial hit


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Key of a block holding `tokens` after a prefix whose last block's key is `parent` (0 for the first block)."""
    return hash((parent, tokens))


@dataclass(frozen=True)
class CacheEntry:
    key: int
    tokens: tuple[int, ...]
    parent_serial: int  # serial of the entry of the block before (0: first block)
    serial: int  # unique over the cache's lifetime


class PrefixCache:
    """Full KV blocks by hash chain (see the module docstring). `hash_fn` is replaceable for tests (a constant
    forces collisions)."""

    def __init__(self, block_size: int, hash_fn: HashFn = chain_hash):
        self.block_size = block_size
        self.hash_fn = hash_fn
        self._by_key: dict[int, int] = {}  # key -> block
        self._entries: dict[int, CacheEntry] = {}  # block -> its entry
        self._children: dict[int, OrderedDict[int, None]] = {}  # parent serial -> its children's blocks, newest last
        self._serials = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def is_cached(self, block: int) -> bool:
        return block in self._entries

    def keys(self, ids: Sequence[int], num_blocks: int) -> list[int]:
        """Chain keys of the first `num_blocks` full blocks of `ids`."""
        bs, out, key = self.block_size, [], 0
        for i in range(num_blocks):
            key = self.hash_fn(key, tuple(ids[i * bs:(i + 1) * bs]))
            out.append(key)
        return out

    def match(self, ids: Sequence[int], keys: list[int]) -> list[int]:
        """Cached blocks holding the longest run of leading full blocks of `ids` (`keys`: their chain keys, as many
        blocks as the caller may take): ids compared, parent entries checked."""
        bs, out, parent = self.block_size, [], 0
        for i, key in enumerate(keys):
            block = self._by_key.get(key)
            entry = self._entries.get(block) if block is not None else None
            if entry is None or entry.parent_serial != parent or entry.tokens != tuple(ids[i * bs:(i + 1) * bs]):
                break
            out.append(block)
            parent = entry.serial
        return out

    def partial(self, ids: Sequence[int], parent_serial: int, limit: int) -> tuple[int, int] | None:
        """(block, m): a cached block following the entry `parent_serial` whose first `m` ids equal `ids[:m]`, the
        longest such `m <= limit` among its newest `PARTIAL_SCAN` children (None when no child shares a first id).
        Its first `m` slots can be copied instead of prefilled (a prompt that leaves a shared header inside a
        block)."""
        children = self._children.get(parent_serial)
        if not children or limit < 1:
            return None
        want, best = tuple(ids[:limit]), None
        for k, block in enumerate(reversed(children)):
            if k == PARTIAL_SCAN:
                break
            tokens, m = self._entries[block].tokens, 0
            while m < len(want) and m < len(tokens) and tokens[m] == want[m]:
                m += 1
            if m and (best is None or m > best[1]):
                best = (block, m)
                if m == len(want):
                    break
        return best

    def serial(self, block: int) -> int:
        return self._entries[block].serial

    def insert(self, block: int, key: int, tokens: tuple[int, ...], parent_serial: int) -> int | None:
        """Register `block` (its KV computed, or being computed in this step before any reader, for `tokens` after
        the prefix of entry `parent_serial`). Returns the serial of the entry now standing for this prefix: `block`'s,
        or that of an equal entry already cached (then `block` stays unregistered); None where another prefix holds
        the key (a hash collision: the first keeps it, this prefix is not cached)."""
        held = self._by_key.get(key)
        if held is not None:
            entry = self._entries[held]
            return entry.serial if (entry.tokens == tokens and entry.parent_serial == parent_serial) else None
        if block in self._entries:  # already standing for another prefix (cannot happen for a fresh block)
            return None
        entry = CacheEntry(key, tokens, parent_serial, next(self._serials))
        self._by_key[key] = block
        self._entries[block] = entry
        self._children.setdefault(parent_serial, OrderedDict())[block] = None
        return entry.serial

    def drop(self, block: int) -> None:
        """Forget `block`'s entry (it is given to a new owner)."""
        entry = self._entries.pop(block)
        del self._by_key[entry.key]
        siblings = self._children[entry.parent_serial]
        del siblings[block]
        if not siblings:
            del self._children[entry.parent_serial]

    def clear(self) -> None:
        self._by_key.clear()
        self._entries.clear()
        self._children.clear()
