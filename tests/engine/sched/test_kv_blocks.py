"""KV moves are orders in the scheduled batch (`sched/batch.py`), carried out by the pool (`KVCachePool.apply`):
a partial prefix-cache hit (`PrefillCopy`), divided rollout's host tier (`Swap`) and completion
caching's shift onto the cache's grid (`SlotCopy`, issued by `postprocess`). With all of them in one call the output
stays token-identical to `model.generate`, and the KV the prefix cache holds afterwards equals a fresh prefill's."""

from __future__ import annotations

import torch
from _models import reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.model.exactness import _cache_kwarg
from trl_infinite.engine.runner.kv_pool import KVCachePool
from trl_infinite.engine.sched.batch import PrefillCopy, SlotCopy, Swap
from trl_infinite.engine.sched.block_manager import BlockAllocator
from trl_infinite.engine.sched.kv_blocks import KVBlocks
from trl_infinite.engine.sched.prefix_cache import PrefixCache
from trl_infinite.engine.sched.scheduler import Scheduler

BLOCK = 4
MAX_NEW = 16


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cached_slots(cache: PrefixCache, ids: list[int]) -> list[int]:
    """Pool slots the prefix cache holds for the leading positions of `ids` (full blocks, then a partial one)."""
    blocks = cache.match(ids, cache.keys(ids, len(ids) // BLOCK))
    slots = [b * BLOCK + t for b in blocks for t in range(BLOCK)]
    rest = ids[len(blocks) * BLOCK:]
    hit = cache.partial(rest, cache.serial(blocks[-1]) if blocks else 0, min(BLOCK, len(rest)))
    return slots + ([hit[0] * BLOCK + t for t in range(hit[1])] if hit else [])


def test_every_kv_move_is_an_order_the_pool_carries_out(monkeypatch):
    model = tiny_model("qwen3")
    header = _rand(BLOCK + 2, 1)  # ends inside a block: later prompts copy its 2 ids there
    prompts = [header + _rand(n, 10 + n) for n in (3, 5, 6)]
    scheduled, applied = [], []
    schedule, apply = Scheduler.schedule, KVCachePool.apply

    def spy_schedule(self, lookahead=0):
        batch = schedule(self, lookahead)
        scheduled.append(batch)
        return batch

    def spy_apply(self, moves):
        applied.extend(moves)
        return apply(self, moves)

    monkeypatch.setattr(Scheduler, "schedule", spy_schedule)
    monkeypatch.setattr(KVCachePool, "apply", spy_apply)
    # a pool too small for every sample: parked samples' KV goes to the host tier and comes back
    engine = RolloutEngine(model, EngineConfig(sampling_mode="dynamic_slot", kv_cache_tokens=100, block_size=BLOCK,
                                               chunk_tokens=4))
    out = engine.generate(prompts, 3, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0), keep_pool=True)
    assert out.completion_ids == [reference_greedy(model, p, MAX_NEW, []) for p in prompts for _ in range(3)]

    kinds = {(type(m), getattr(m, "to_host", None)) for m in applied}
    assert kinds == {(PrefillCopy, None), (Swap, True), (Swap, False), (SlotCopy, None)}
    # each order was handed over by a batch and applied once, in the batch's order
    ordered = [m for b in scheduled for m in (*b.moves, *b.moves_after)]
    assert applied == ordered
    assert all(isinstance(m, SlotCopy) for b in scheduled for m in b.moves_after)  # completion caching only
    first = scheduled[0]
    copies = [m for m in first.moves if isinstance(m, PrefillCopy)]
    assert [m.group_id for m in copies] == [g.group_id for g in first.prefill_groups[1:]]
    assert all(len(m.src) == len(m.dst) == 2 for m in copies)
    # the host tier: every block swapped out comes back once, as many blocks, before the call ends
    swaps = [m for m in applied if isinstance(m, Swap)]
    assert sorted((m.key, len(m.blocks)) for m in swaps if m.to_host) == \
        sorted((m.key, len(m.blocks)) for m in swaps if not m.to_host)

    # the KV the prefix cache holds (prompts and completions, shifted onto the grid) equals a fresh prefill's
    pool, shifted = engine.pool, 0
    for k, p in enumerate(prompts):
        ids = p + out.completion_ids[3 * k]
        slots = _cached_slots(pool.prefix_cache, ids)
        shifted += len(slots) > len(p) and len(p) % BLOCK != 0  # a completion cached by a shift onto the grid
        with torch.no_grad():
            cache = getattr(model(torch.tensor([ids[: len(slots)]]), use_cache=True), _cache_kwarg(model))
        for i, layer in enumerate(cache.layers):
            torch.testing.assert_close(pool.k_caches[i][slots], layer.keys[0].transpose(0, 1), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(pool.v_caches[i][slots], layer.values[0].transpose(0, 1), atol=1e-5,
                                       rtol=1e-4)
    assert shifted  # (prompt 1's: 11 tokens)


def test_partial_hit_copies_read_the_first_source_and_pin_it():
    """Pure Python: prompt 1 copies 2 ids from prompt 0's block, prompt 2 copies 3 ids from prompt 1's block, whose
    first two are targets of the first copy: the order reads the first copy's sources instead (one forward makes all
    copies as one gather then one scatter). The sources stay pinned until the step ends."""
    from trl_infinite.engine.outputs import RolloutStats
    from trl_infinite.engine.sched.sequence import make_group

    alloc = BlockAllocator(16, BLOCK, PrefixCache(BLOCK))
    kv = KVBlocks(alloc, RolloutStats(num_samples=3))
    a = _rand(BLOCK, 60)
    b = a[:2] + _rand(3, 61)
    groups = [make_group(i, p, 1, 4) for i, p in enumerate([a, b, b[:BLOCK]])]
    for g in groups:
        kv.allocate_prompt(g, reserve=1)
    c1, c2 = kv.take_moves()
    src0, src1 = groups[0].prompt_blocks[0] * BLOCK, groups[1].prompt_blocks[0] * BLOCK
    assert (c1.group_id, c1.src, c1.dst) == (1, (src0, src0 + 1), (src1, src1 + 1))
    assert (c2.group_id, c2.src) == (2, (src0, src0 + 1, src1 + 2))
    assert not set(c1.src + c2.src) & set(c1.dst + c2.dst)
    assert alloc.refs(groups[0].prompt_blocks[0]) == 2 and alloc.refs(groups[1].prompt_blocks[0]) == 2
    kv.end_step()
    assert alloc.refs(groups[0].prompt_blocks[0]) == 1 and kv.take_moves() == []
