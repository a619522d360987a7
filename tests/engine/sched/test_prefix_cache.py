"""Automatic prefix caching: prompts sharing a header, calls continuing a conversation, a tight pool, hash
collisions and weight updates; greedy output always token-identical to `model.generate`."""

from __future__ import annotations

import pytest
import torch
from _models import frequent_token, reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.sched.block_manager import BlockAllocator
from trl_infinite.engine.sched.prefix_cache import PrefixCache

BLOCK = 4
MAX_NEW = 8


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _engine(model, **kw) -> RolloutEngine:
    cfg = dict(block_size=BLOCK, max_active_sequences=4, scheduler="fifo", kv_cache_tokens=4096)
    return RolloutEngine(model, EngineConfig(**{**cfg, **kw}))


def _greedy(eos: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos] if eos is not None else [])


def _refs(model, prompts, eos):
    return [reference_greedy(model, p, MAX_NEW, [eos] if eos is not None else []) for p in prompts]


@pytest.mark.parametrize("header_blocks", [1, 2, 2.5])
def test_shared_header_is_prefilled_once_and_greedy_matches_generate(model, header_blocks):
    header = _rand(int(header_blocks * BLOCK), 1)
    prompts = [header + _rand(n, 10 + n) for n in (1, 3, 6, 9)]
    eos = frequent_token(model, prompts)
    refs = _refs(model, prompts, eos)
    on = _engine(model).generate(prompts, 2, _greedy(eos))
    off = _engine(model, prefix_cache=False).generate(prompts, 2, _greedy(eos))
    assert on.completion_ids == off.completion_ids == [r for r in refs for _ in range(2)]
    # the header's full blocks are found by every later prompt; a header ending inside a block (2.5) also gives
    # its 2 last ids by copy to the prompts after the first one whose block there is full (prompt 1: 13 tokens)
    hits = int(header_blocks) * BLOCK * (len(prompts) - 1) + (2 * 2 if header_blocks == 2.5 else 0)
    assert off.stats.prefill_tokens == sum(len(p) for p in prompts)
    assert on.stats.prefix_cache_hit_tokens == hits
    assert on.stats.prefill_tokens == off.stats.prefill_tokens - hits


def test_identical_prompts_and_prompt_on_block_boundary(model):
    p = _rand(2 * BLOCK, 3)  # a whole-block prompt: its last token is prefilled again for the logits
    prompts = [p, p, p + _rand(BLOCK, 4)]
    refs = _refs(model, prompts, None)
    out = _engine(model).generate(prompts, 3, _greedy())
    assert out.completion_ids == [r for r in refs for _ in range(3)]
    # the repeated prompt: its first block, and 3 of its second block's ids by copy (the last token is prefilled);
    # the longer prompt: both blocks of `p` (full there)
    assert out.stats.prefix_cache_hit_tokens == (2 * BLOCK - 1) + 2 * BLOCK
    assert out.stats.prefill_tokens == 2 * BLOCK + 1 + BLOCK


def test_a_partial_hit_on_a_block_filled_by_a_copy_in_the_same_forward(model, monkeypatch):
    """Prompt 1 takes its first 2 ids by copy from prompt 0's block; prompt 2 takes 3 ids by copy from prompt 1's
    block, 2 of them targets of the first copy. One forward makes every copy at once (each source read before any
    target is written), so the second copy must read the first one's source, never a target of that forward."""
    from trl_infinite.engine.sched.batch import PrefillCopy
    from trl_infinite.engine.sched.scheduler import Scheduler

    a = _rand(BLOCK, 60)
    prompts = [a, a[:2] + _rand(3, 61), None]
    prompts[2] = prompts[1][:BLOCK]
    steps = []
    schedule = Scheduler.schedule

    def spy(self, lookahead=0):
        batch = schedule(self, lookahead)
        steps.append([c for m in batch.moves if isinstance(m, PrefillCopy) for c in zip(m.src, m.dst)])
        return batch

    monkeypatch.setattr(Scheduler, "schedule", spy)
    out = _engine(model).generate(prompts, 1, _greedy())
    assert out.completion_ids == _refs(model, prompts, None)
    assert steps[0] and len(steps[0]) == 2 + 3  # all three prompts were prefilled in one step
    for copies in steps:
        assert not {src for src, _ in copies} & {dst for _, dst in copies}
    assert out.stats.prefix_cache_hit_tokens == 2 + 3


def test_cache_across_calls_only_while_the_pool_is_kept(model):
    """... and the caller declared it reports weight changes (`kv_cache_reuse_across_calls`; tests/engine/
    test_weight_state.py)."""
    prompts = [_rand(10, 5), _rand(7, 6)]
    refs = _refs(model, prompts, None)
    kept = _engine(model, kv_cache_release=False, kv_cache_reuse_across_calls=True)
    first = kept.generate(prompts, 2, _greedy())
    second = kept.generate(prompts, 2, _greedy())
    assert first.completion_ids == second.completion_ids == [r for r in refs for _ in range(2)]
    assert first.stats.prefix_cache_hit_tokens == 0
    # everything but each prompt's last token (its full blocks, the rest of its last block by copy)
    assert second.stats.prefix_cache_hit_tokens == sum(len(p) - 1 for p in prompts)
    assert second.stats.prefill_tokens == len(prompts)
    for engine in (_engine(model), _engine(model, kv_cache_release=False)):  # released, or kept but not declared
        engine.generate(prompts, 2, _greedy())
        assert engine.generate(prompts, 2, _greedy()).stats.prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("kv_tokens", [4096, 48])  # 48: the grown pool and the old one exceed the budget together
@pytest.mark.parametrize("prompt_len", [8, 9, 10])  # the first turn ends on a block boundary, or inside a block
def test_next_turn_prefills_only_its_new_tokens(model, kv_tokens, prompt_len):
    """A tool loop's turn k+1 = turn k's prompt + its completion + a tool result: with `keep_pool`, the completion's
    blocks (the last, partial one too) were cached when it finished, so only its last token and the tool result are
    prefilled (the pool
    grows for the longer turn with its cached blocks, through host memory under a tight budget)."""
    engine = _engine(model, kv_cache_tokens=kv_tokens)
    prompt = _rand(prompt_len, 7)
    turn1 = engine.generate([prompt], 1, _greedy(), keep_pool=True)
    assert turn1.stats.cached_completion_blocks > 0
    tool = _rand(5, 8)
    follow = prompt + turn1.completion_ids[0] + tool
    turn2 = engine.generate([follow], 1, _greedy(), keep_pool=True)
    assert turn2.completion_ids == [reference_greedy(model, follow, MAX_NEW, [])]
    cached = len(prompt) + MAX_NEW - 1  # every position whose KV the first turn wrote (its last partial block too)
    assert turn2.stats.prefix_cache_hit_tokens == cached
    assert turn2.stats.prefill_tokens == len(follow) - cached
    engine.release_pool()
    assert not engine.pool.allocated


@pytest.mark.parametrize("mode", ["fixed_slot", "full_group"])
def test_tight_pool_preemption_and_eviction_stay_greedy_identical(model, mode):
    header = _rand(2 * BLOCK + 2, 11)
    prompts = [header + _rand(n, 20 + n) for n in (2, 5, 7)] + [_rand(9, 30)]
    eos = frequent_token(model, prompts)
    refs = _refs(model, prompts, eos)
    # the smallest pool `generate` accepts: one prompt and one completion
    blocks = -(-max(len(p) for p in prompts) // BLOCK) + MAX_NEW // BLOCK
    engine = _engine(model, kv_cache_tokens=(blocks + 1) * BLOCK, sampling_mode=mode, max_active_sequences=3,
                     max_prefill_tokens=8, kv_cache_release=False)
    for _ in range(2):  # the second call finds what the first left cached, in a pool that must evict it
        out = engine.generate(prompts, 3, _greedy(eos))
        assert out.completion_ids == [r for r in refs for _ in range(3)]
        assert out.stats.preemptions + out.stats.prompt_evictions > 0
        assert out.stats.peak_kv_blocks <= blocks == out.stats.num_kv_blocks
        assert engine.pool.allocator.num_used == 0


def test_forced_hash_collisions_never_hit():
    cache = PrefixCache(BLOCK, hash_fn=lambda parent, tokens: 0)  # every block hashes alike
    alloc = BlockAllocator(8, BLOCK, cache)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9, 5, 6, 7, 8, 9]
    blocks = alloc.allocate(2)
    assert cache.insert(blocks[0], 0, tuple(a[:4]), 0) is not None
    assert cache.match(b, cache.keys(b, 2)) == []  # equal hashes, different ids: a miss
    assert cache.match(a, cache.keys(a, 1)) == blocks[:1]
    # a colliding second block is refused (the first holder keeps the key)
    assert cache.insert(blocks[1], 0, tuple(a[4:8]), cache.serial(blocks[0])) is None


def test_forced_collisions_in_the_engine_stay_exact(model, monkeypatch):
    monkeypatch.setattr(PrefixCache.__init__, "__defaults__", (lambda parent, tokens: 7,))  # one key for all
    prompts = [_rand(9, 40), _rand(9, 41), _rand(9, 40)[:8] + [5]]
    refs = _refs(model, prompts, None)
    out = _engine(model).generate(prompts, 2, _greedy())
    assert out.completion_ids == [r for r in refs for _ in range(2)]
    # prompt 0's first block holds the one key: prompt 1 (other ids) misses, prompt 2 hits that block only (its
    # second block's key is the first block's, whose parent differs)
    assert out.stats.prefix_cache_hit_tokens == BLOCK


def test_cache_dropped_after_a_weight_update():
    model = tiny_model("llama", seed=3)
    engine = _engine(model, kv_cache_release=False, kv_cache_reuse_across_calls=True)
    prompts = [_rand(11, 50)]
    engine.generate(prompts, 1, _greedy())
    assert engine.generate(prompts, 1, _greedy()).stats.prefix_cache_hit_tokens == 10  # all but the last token
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # an optimizer step: in place
    out = engine.generate(prompts, 1, _greedy())
    assert out.stats.prefix_cache_hit_tokens == 0
    assert out.completion_ids == _refs(model, prompts, None)


def test_unreferenced_cached_blocks_are_evicted_lru_only_when_needed():
    cache = PrefixCache(BLOCK)
    alloc = BlockAllocator(4, BLOCK, cache)
    ids = list(range(12))
    keys = cache.keys(ids, 3)
    blocks = alloc.allocate(3)
    parent = 0
    for i, b in enumerate(blocks):
        parent = cache.insert(b, keys[i], tuple(ids[i * BLOCK:(i + 1) * BLOCK]), parent)
    alloc.free([blocks[2]])
    alloc.free([blocks[0]])
    alloc.free([blocks[1]])  # evictable, least recent first: 2, 0, 1
    assert alloc.num_free == 4 and alloc.num_used == 0 and alloc.num_evictable == 3 and len(cache) == 3
    assert cache.match(ids, keys) == blocks
    assert alloc.allocate(1) == [3]  # a never-cached block first: nothing evicted
    alloc.share([blocks[2]])  # a hit takes it back (no longer evictable)
    assert alloc.allocate(1) == [blocks[0]] and not cache.is_cached(blocks[0])  # then the least recently used
    assert cache.match(ids, keys) == []  # the chain starts at the evicted block
    assert not alloc.can_allocate(2) and alloc.can_allocate(1)


def test_partial_copies_from_a_block_copied_in_the_same_step(model):
    """A header ending inside a block, several prompts prefilled in one step: a later prompt's partial hit may find
    as its source the block of an earlier prompt of the same step whose header ids are themselves copied in that
    step; the copy must read the original slots (a gather of the not-yet-copied destination gave unwritten KV:
    wrong log-probs from the third prompt on, found on SmolLM2 with a chat template's header). Log-probs, not only
    greedy tokens, equal the engine's without the cache."""
    header = _rand(int(2.5 * BLOCK), 1)
    prompts = [header + _rand(n, 20 + n) for n in (3, 4, 5, 6, 7)]  # every prompt's block 2 is full: a cached child
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    on = _engine(model, max_active_sequences=16).generate(prompts, 1, sp)
    off = _engine(model, max_active_sequences=16, prefix_cache=False).generate(prompts, 1, sp)
    assert on.stats.prefix_cache_hit_tokens == 2 * BLOCK * 4 + 2 * 4  # one prefill step: 4 prompts hit
    assert on.completion_ids == off.completion_ids
    for a, b in zip(on.logprobs, off.logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
