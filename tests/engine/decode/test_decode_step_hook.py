"""`RolloutEngine.generate(on_decode_step=...)`: one call per decode forward, with the batch before its tokens."""

from __future__ import annotations

import pytest
from _models import tiny_model

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams

LENGTHS = [[1, 4, 6], [2, 5, 3]]  # a one-token sample ends at its prompt's prefill and never decodes


@pytest.mark.parametrize("method", [None, "ngram"])
def test_hook_sees_every_decode_step_and_its_rows(method):
    model = tiny_model("qwen3")
    # 3 slots for 6 samples: the second prompt is prefilled in a step that also decodes the first prompt's samples
    engine = RolloutEngine(model, EngineConfig(max_active_sequences=3, kv_cache_tokens=512,
                                               speculative_method=method, speculative_adaptive=False))
    calls = []

    def hook(batch, seconds):
        rows = [(s.num_generated, s.length_limit) for s in batch.decode]
        calls.append((rows, bool(batch.prefill_groups), seconds))

    sampling = SamplingParams(max_new_tokens=8, eos_token_ids=[1], seed=0)
    result = engine.generate([[5, 6, 7], [9, 10, 11, 12]], 3, sampling, forced_lengths=LENGTHS,
                             on_decode_step=hook)
    stats = result.stats
    assert [len(c) for c in result.completion_ids] == [n for g in LENGTHS for n in g]
    assert len(calls) == stats.decode_steps > 0
    assert all(seconds > 0 for _, _, seconds in calls)
    # the rows are seen before the step's tokens are appended: each has its first token and is not finished yet
    assert all(1 <= done < limit for rows, _, _ in calls for done, limit in rows)
    assert any(prefill for _, prefill, _ in calls)  # a step that admitted the second prompt while decoding
    if method is None:  # one token per decode row; every sample's first token comes from its prompt's prefill
        assert sum(len(rows) for rows, _, _ in calls) == stats.generated_tokens - 6
