"""The paged KV pool: sizing from the budget, block accounting, one shared prompt prefill, memory bounded in G."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_model

from trl_infinite import EngineConfig, KVCachePool, RolloutEngine, SamplingParams
from trl_infinite.engine.sched.batch import SlotCopy, Swap
from trl_infinite.engine.sched.block_manager import BlockAllocator, blocks_for, pool_size

BLOCK = 4
PROMPT_LEN = 10  # 3 blocks of 4 (the last one partial), shared by all samples of the prompt
PROMPT_BLOCKS = blocks_for(PROMPT_LEN, BLOCK)
MAX_NEW = 8  # 2 own blocks per sample at most
NUM_PROMPTS = 2
SLOTS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, 96, (PROMPT_LEN,), generator=gen).tolist() for _ in range(NUM_PROMPTS)]


def _lengths(group_size: int, fixed: int | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(group_size)
    if fixed is not None:
        return [[fixed] * group_size for _ in range(NUM_PROMPTS)]
    return torch.randint(1, MAX_NEW + 1, (NUM_PROMPTS, group_size), generator=gen).tolist()


def _run(model, mode: str, group_size: int, kv_tokens: int, fixed: int | None = None):
    engine = RolloutEngine(model, EngineConfig(sampling_mode=mode, max_active_sequences=SLOTS,
                                               kv_cache_tokens=kv_tokens, block_size=BLOCK))
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    result = engine.generate(_prompts(), group_size, sampling, forced_lengths=_lengths(group_size, fixed))
    want = [n for row in _lengths(group_size, fixed) for n in row]
    assert [len(c) for c in result.completion_ids] == want  # nothing dropped or shortened
    assert engine.pool.allocator.num_used == 0  # every block was freed
    return result.stats


def test_pool_is_sized_from_tokens_or_gigabytes(model):
    cfg = model.config
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    pool = KVCachePool(cfg, EngineConfig(kv_cache_tokens=100, block_size=16), torch.float32, torch.device("cpu"))
    assert pool.num_blocks == 5  # floor(100 / 16) = 6 blocks in the budget, one of them the null block
    assert pool.null_block == 5
    assert len(pool.k_caches) == len(pool.v_caches) == layers
    assert pool.k_caches[0].shape == (6 * 16, kv_heads, head_dim) == pool.v_caches[-1].shape
    assert pool.block_bytes == 2 * layers * 16 * kv_heads * head_dim * 4
    gb = 10 * pool.block_bytes / 1e9
    pool_gb = KVCachePool(cfg, EngineConfig(kv_cache_gb=gb * 1.0001, block_size=16), torch.float32,
                          torch.device("cpu"))
    assert pool_gb.num_blocks == 9
    cache_bytes = sum(t.numel() * 4 for t in pool_gb.k_caches + pool_gb.v_caches)
    assert cache_bytes == 10 * pool.block_bytes  # K and V (null block included) fill exactly the budget


def test_a_companion_pool_is_paid_by_a_byte_budget_not_by_a_token_budget(model):
    """A draft model's pool mirrors this pool's blocks (`companion_block_bytes`): a byte budget pays for both, a token
    budget counts tokens (issue 40: the draft pool ignored `kv_cache_gb`)."""
    cfg, cpu = model.config, torch.device("cpu")
    block = KVCachePool(cfg, EngineConfig(kv_cache_tokens=64, block_size=16), torch.float32, cpu).block_bytes
    gb = 10 * block / 1e9 * 1.0001
    pool = KVCachePool(cfg, EngineConfig(kv_cache_gb=gb, block_size=16), torch.float32, cpu, companion_block_bytes=block)
    assert pool.budget_blocks() == 4  # 10 blocks' bytes pay for 5 of each pool, one of them the null block
    assert (pool.budget_blocks() + 1) * (pool.block_bytes + block) <= gb * 1e9
    tokens = KVCachePool(cfg, EngineConfig(kv_cache_tokens=100, block_size=16), torch.float32, cpu,
                         companion_block_bytes=block)
    assert tokens.budget_blocks() == 5
    with pytest.raises(ValueError, match=r"`kv_cache_gb` gives a KV pool of less than two blocks.*draft model"):
        KVCachePool(cfg, EngineConfig(kv_cache_gb=3 * block / 1e9, block_size=16), torch.float32, cpu,
                    companion_block_bytes=block)


@pytest.mark.parametrize("release", [True, False])
def test_pool_sized_per_call_and_released_after_it(model, release):
    """Each call allocates what it can use (prompts + the slots' completions, rounded up by at most 12.5%), never
    above the budget; with `kv_cache_release` (the default) the tensors are gone after the call, otherwise kept and
    reused by the next call of the same size."""
    engine = RolloutEngine(model, EngineConfig(sampling_mode="fixed_slot", max_active_sequences=SLOTS,
                                               kv_cache_tokens=4096, block_size=BLOCK, kv_cache_release=release))
    assert engine.pool.allocated_bytes == 0  # nothing held before the first call
    during = []

    def on_step(batch, seconds):
        during.append((engine.pool.num_blocks, engine.pool.allocated_bytes, engine.pool.k_caches[0].data_ptr()))

    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    need = NUM_PROMPTS * PROMPT_BLOCKS + SLOTS * blocks_for(MAX_NEW, BLOCK)
    for _ in range(2):
        engine.generate(_prompts(), 16, sampling, forced_lengths=_lengths(16), on_decode_step=on_step)
        assert (engine.pool.allocated_bytes == 0) == release
    blocks, held, _ = during[0]
    assert blocks == pool_size(need) < 4096 // BLOCK and need <= blocks <= need * 1.125
    assert held == (blocks + 1) * engine.pool.block_bytes
    if not release:  # kept: the second call reuses the same tensors
        assert len({p for _, _, p in during}) == 1


def test_pool_size_rounding():
    assert [pool_size(n) for n in (1, 8, 9, 16, 17, 100, 1000)] == [1, 8, 9, 16, 18, 104, 1024]
    for n in range(1, 5000):
        assert n <= pool_size(n) <= max(n * 1.125, n + 1) and pool_size(pool_size(n)) == pool_size(n)


def test_allocator_free_list_and_refcounts():
    alloc = BlockAllocator(num_blocks=5, block_size=4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 2 and alloc.peak_used == 3
    alloc.share(a[:1])  # a second owner of the first block
    alloc.free(a)
    assert alloc.num_free == 4  # the shared block stays in use until its last owner frees it
    alloc.free(a[:1])
    assert alloc.num_free == 5
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(a[:1])
    assert not alloc.can_allocate(6)
    with pytest.raises(RuntimeError, match="exhausted"):
        alloc.allocate(6)
    assert alloc.peak_used == 3


@pytest.mark.parametrize("mode", ["fixed_slot", "micro_group"])
def test_peak_kv_blocks_does_not_grow_with_group_size(model, mode):
    """g slots: the peak is the slots' own blocks plus the resident prompts, whatever G is."""
    peaks = {g: _run(model, mode, g, kv_tokens=4096).peak_kv_blocks for g in (4, 16, 64)}
    bound = NUM_PROMPTS * PROMPT_BLOCKS + SLOTS * blocks_for(MAX_NEW, BLOCK)
    assert all(p <= bound for p in peaks.values()), peaks
    assert max(peaks.values()) - min(peaks.values()) <= PROMPT_BLOCKS, peaks


def test_full_group_peak_grows_linearly_with_group_size(model):
    """Baseline: every sample holds its own KV at once; the prompt blocks are still counted once per prompt."""
    for g in (4, 16, 64):
        stats = _run(model, "full_group", g, kv_tokens=4096, fixed=MAX_NEW)
        assert stats.peak_kv_blocks == NUM_PROMPTS * (PROMPT_BLOCKS + g * blocks_for(MAX_NEW, BLOCK)), g
        assert stats.peak_active_sequences == NUM_PROMPTS * g
        assert stats.prefill_tokens == NUM_PROMPTS * PROMPT_LEN  # one prefill per prompt, not G
        assert stats.peak_kv_bytes == stats.peak_kv_blocks * stats.kv_block_bytes


@pytest.mark.parametrize("mode", ["fixed_slot", "dynamic_slot", "micro_group", "full_group"])
def test_peak_never_exceeds_a_small_pool(model, mode):
    """G = 64 under a 24-block pool: every mode completes every sample within the pool."""
    stats = _run(model, mode, 64, kv_tokens=25 * BLOCK)  # 24 usable blocks + the null block
    # the call's pool: what it can use (the slots' modes need less than the budget), never above the budget
    assert stats.num_kv_blocks == (24 if mode in ("dynamic_slot", "full_group") else
                                   min(24, pool_size(NUM_PROMPTS * PROMPT_BLOCKS + SLOTS * blocks_for(MAX_NEW, BLOCK))))
    assert stats.peak_kv_blocks <= stats.num_kv_blocks
    if mode == "fixed_slot":
        assert stats.peak_active_sequences == SLOTS


PUBLISHED_PARAMS_M = {"smollm2-135m": 134.5, "qwen2.5-0.5b": 494.0, "qwen3-0.6b": 596.0, "qwen3-1.7b": 1720.6,
                      "qwen3-8b": 8190.7, "llama-3.2-1b": 1235.8}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS_M))
def test_model_zoo_configs_match_published_sizes(name):
    """Named configs build the real architecture (parameter count within 0.1% of the published model's)."""
    from transformers import AutoModelForCausalLM

    from trl_infinite.testing.model_zoo import model_config

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(model_config(name))
    m.tie_weights()  # transformers 5.0 leaves a model built on the meta device untied (5.24 ties it)
    assert sum(p.numel() for p in m.parameters()) / 1e6 == pytest.approx(PUBLISHED_PARAMS_M[name], rel=1e-3)


def test_kv_block_bytes_of_a_real_geometry():
    """Qwen3-1.7B: 28 layers x 8 KV heads x head_dim 128; a 16-token bf16 block is 2*28*16*8*128*2 bytes."""
    from trl_infinite.engine.runner.kv_layout import kv_geometry
    from trl_infinite.testing.model_zoo import model_config

    assert kv_geometry(model_config("qwen3-1.7b")) == (28, 8, 128)
    pool = KVCachePool(model_config("qwen3-1.7b"), EngineConfig(kv_cache_tokens=32, block_size=16), torch.bfloat16,
                       torch.device("cpu"))
    assert pool.block_bytes == 2 * 28 * 16 * 8 * 128 * 2 == 1835008


def test_model_zoo_unknown_name():
    from trl_infinite.testing.model_zoo import random_model

    with pytest.raises(ValueError, match="config"):
        random_model("gpt-7")


def test_pool_layout_with_per_layer_widths():
    """MLA-style layers (keys 12 wide, values 8) and a layer with one KV head: per-layer views of one allocation
    (freed as a whole), exact block bytes."""
    from trl_infinite.engine.runner.kv_layout import KVLayout

    layout = KVLayout(num_kv_heads=(4, 1), k_dims=(12, 16), v_dims=(8, 16))
    pool = KVCachePool(layout, EngineConfig(kv_cache_tokens=64, block_size=16), torch.float32, torch.device("cpu"))
    assert [t.shape for t in pool.k_caches] == [(64, 4, 12), (64, 1, 16)]
    assert [t.shape for t in pool.v_caches] == [(64, 4, 8), (64, 1, 16)]
    assert pool.block_bytes == 16 * (4 * (12 + 8) + 1 * (16 + 16)) * 4
    storage = {t.untyped_storage().data_ptr() for t in (*pool.k_caches, *pool.v_caches)}
    assert len(storage) == 1 and pool.k_caches[0].untyped_storage().nbytes() == pool.allocated_bytes
    assert all(t.is_contiguous() for t in (*pool.k_caches, *pool.v_caches))
    pool.k_caches[0][[3, 17]] = 1.0  # slots 3 (block 0) and 17 (block 1)
    pool.apply([Swap(7, (0, 1), to_host=True)])  # the host tier: per-layer copies of whole blocks
    pool.k_caches[0].zero_()
    pool.apply([Swap(7, (2, 0), to_host=False)])  # back into other blocks: block 0's content lands in block 2, block 1's in 0
    assert pool.k_caches[0][[35, 1]].eq(1.0).all() and pool.k_caches[0].sum() == 2 * 4 * 12
    assert not pool.host  # the host copy is dropped once back
    pool.apply([SlotCopy((35, 4), (4, 5))])  # one copy reads all its sources first: slot 5 gets slot 4's old zeros
    assert pool.k_caches[0][[1, 4, 35]].eq(1.0).all() and pool.k_caches[0].sum() == 3 * 4 * 12
    pool.apply([SlotCopy((4,), (5,)), SlotCopy((5,), (6,))])  # copies run in order: the second reads the first's
    assert pool.k_caches[0][[1, 4, 5, 6, 35]].eq(1.0).all() and pool.k_caches[0].sum() == 5 * 4 * 12


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_reserved_range_keeps_addresses_and_gives_memory_back():
    """`HostReservedRange`: tensors over each part's whole range at fixed addresses; `map` backs a prefix zero-filled
    (keeping what is backed), `unmap` returns the pages to the OS (resident memory drops) and the next `map` reads
    zeros again at the same addresses."""
    from trl_infinite.engine.runner.kv_memory import reserve_range

    mib = 1 << 20
    region = reserve_range([64 * mib, 3 * mib + 5], torch.device("cpu"))
    assert region.sizes[1] % region.granularity == 0 and region.offsets[1] == 64 * mib
    a, b = region.tensor(0, torch.float32, (16 * mib // 4, 4)), region.tensor(1, torch.bfloat16, (1000, 3))
    addresses = (a.data_ptr(), b.data_ptr())
    base = _rss_bytes()
    region.map([48 * mib, 100])
    a[: 12 * mib // 4].fill_(1.0)  # 48 MiB written
    b[:10].fill_(2.0)
    assert _rss_bytes() - base > 40 * mib and region.mapped_bytes == 48 * mib + region.granularity
    region.map([64 * mib, 100])  # grows in place: the backed part keeps its contents
    head, tail = a[: 12 * mib // 4], a[12 * mib // 4 :]  # (checked by reductions: no large temporaries in the RSS)
    assert head.min() == head.max() == 1.0 and tail.min() == tail.max() == 0.0
    region.unmap()
    assert region.mapped_bytes == 0 and _rss_bytes() - base < 8 * mib
    region.map([64 * mib, 100])
    assert (a.data_ptr(), b.data_ptr()) == addresses and a.min() == a.max() == 0.0 and not b[:10].any()


def test_stable_pool_keeps_its_addresses_across_sizes_and_grows_in_place():
    """`KVCachePool(stable=True)`: block 0 is the null block, blocks 1..n usable; pools of other sizes (per call)
    and released pools keep the K/V addresses; the prefix cache's growth keeps every block's contents where it is;
    a byte budget includes the granularity rounding."""
    from trl_infinite.engine.runner.kv_layout import KVLayout

    layout = KVLayout.uniform(2, 2, 8)
    pool = KVCachePool(layout, EngineConfig(kv_cache_tokens=256, block_size=4, prefix_cache=True), torch.float32,
                       torch.device("cpu"), allocate=False, stable=True)
    pool.open(5)
    addresses = [t.data_ptr() for t in (*pool.k_caches, *pool.v_caches)]
    assert pool.null_block == 0 and pool.num_blocks == 5 and pool.allocator.allocate(5) == [1, 2, 3, 4, 5]
    pool.k_caches[1][4 * 3 : 4 * 4] = 7.0  # block 3
    pool._grow(9, staged=False)  # what `open` does for a held pool with cached prefixes
    assert pool.num_blocks == 9 and pool.k_caches[1][12:16].eq(7.0).all()
    assert sorted(pool.allocator.allocate(4)) == [6, 7, 8, 9]
    pool.release()
    assert pool.allocated_bytes == 0 and not pool.allocated
    pool.open(30)
    assert [t.data_ptr() for t in (*pool.k_caches, *pool.v_caches)] == addresses
    assert pool.k_caches[1][: 31 * 4].eq(0).all()  # backed anew: zeros
    assert pool.budget_blocks() == 63  # 256 tokens of 4 = 64 blocks, one the null block
    byte_pool = KVCachePool(layout, EngineConfig(kv_cache_gb=1e-4, block_size=4), torch.float32,
                            torch.device("cpu"), allocate=False, stable=True)
    byte_pool.open(10**6)  # everything the budget gives
    assert byte_pool.allocated_bytes <= 1e-4 * 1e9
