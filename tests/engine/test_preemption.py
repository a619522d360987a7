"""Under a tiny KV pool the scheduler preempts (recomputing from the resident prompt blocks) instead of running out
of memory, and every sample still completes with exactly the tokens it would have had with a large pool."""

from __future__ import annotations

import pytest
import torch
from _models import frequent_token, reference_greedy, tiny_model

from trl_infinite import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.config.engine_config import SAMPLING_MODES
from trl_infinite.engine.sched.block_manager import blocks_for

G = 4
BLOCK = 4
MAX_NEW = 12
PROMPT_LENS = (3, 8, 9, 17)
# one prompt (the longest) plus one full completion: the smallest pool `generate` accepts
MIN_BLOCKS = blocks_for(max(PROMPT_LENS), BLOCK) + blocks_for(MAX_NEW, BLOCK)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request):
    model = tiny_model(request.param)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    eos = frequent_token(model, prompts)
    refs = [reference_greedy(model, p, MAX_NEW, [eos]) for p in prompts]
    assert max(len(r) for r in refs) == MAX_NEW  # some samples need every completion block
    return model, prompts, eos, refs


def _engine(model, mode: str, blocks: int) -> RolloutEngine:
    return RolloutEngine(model, EngineConfig(
        sampling_mode=mode, max_active_sequences=3, kv_cache_tokens=(blocks + 1) * BLOCK, block_size=BLOCK,  # + null
        max_prefill_tokens=12, scheduler="fifo", batch_policy="static"))


@pytest.mark.parametrize("mode", SAMPLING_MODES)
@pytest.mark.parametrize("blocks", [MIN_BLOCKS, MIN_BLOCKS + 3])
def test_tiny_pool_outputs_are_complete_and_greedy_identical(case, mode, blocks):
    model, prompts, eos, refs = case
    engine = _engine(model, mode, blocks)
    result = engine.generate(prompts, G, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_token_ids=[eos]))
    assert result.completion_ids == [r for r in refs for _ in range(G)]
    s = result.stats
    assert s.num_kv_blocks == blocks and s.peak_kv_blocks <= blocks
    assert engine.pool.allocator.num_used == 0
    if blocks == MIN_BLOCKS:
        # static admission starts a second sample as soon as its first block fits; two samples of the longest
        # prompt cannot both grow to MAX_NEW tokens in a pool that holds one completion, so one is preempted.
        assert s.preemptions > 0
    if s.preemptions or s.prompt_evictions:
        assert s.prefill_tokens > sum(PROMPT_LENS)  # recomputation is counted as prefill work
    else:
        assert s.prefill_tokens == sum(PROMPT_LENS)


@pytest.mark.parametrize("mode", ["fixed_slot", "full_group"])
def test_preempted_sampling_continues_the_same_random_stream(case, mode):
    """With sampling (seeded), a preempted sample resumes exactly where it was: the small-pool output equals the
    large-pool output token for token (the RNG is keyed by position, the recomputed KV equals the original)."""
    model, prompts, eos, _ = case
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=20, repetition_penalty=1.2,
                              eos_token_ids=[eos], seed=5)
    small = _engine(model, mode, MIN_BLOCKS).generate(prompts, G, sampling)
    large = _engine(model, mode, 256).generate(prompts, G, sampling)
    assert small.stats.preemptions > 0 and large.stats.preemptions == 0
    assert small.completion_ids == large.completion_ids
    for a, b in zip(small.logprobs, large.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
