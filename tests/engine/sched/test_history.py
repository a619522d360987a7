"""Per-prompt history across `generate` calls: bounded LRU, token budget, what the engine records, validation."""

import pytest
from _models import tiny_model

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.config.engine_config import HistoryConfig
from trl_infinite.engine.sched.history import PromptHistory


def test_lru_keeps_the_most_recently_visited_prompts():
    h = PromptHistory(HistoryConfig(max_prompts=2, max_visits=2))
    h.record([1, 2], [5, 6])
    h.record([3], [7])
    assert h.lengths([1, 2]) == [5, 6]  # reading does not refresh recency
    h.record([4], [8])  # evicts [1, 2], the least recently visited
    assert [1, 2] not in h and [3] in h and [4] in h and len(h) == 2
    h.record([3], [9])  # a revisit refreshes [3]
    h.record([5], [1])
    assert [4] not in h and h.lengths([3]) == [7, 9]


def test_visits_are_capped_oldest_first():
    h = PromptHistory(HistoryConfig(max_prompts=4, max_visits=2))
    for visit in range(3):
        h.record([1], [visit, visit], [[visit] * 3, [visit]])
    assert [v.lengths for v in h.visits([1])] == [[1, 1], [2, 2]]
    assert [list(c) for c in h.completions([1])] == [[1, 1, 1], [1], [2, 2, 2], [2]]
    assert h.num_tokens == 8


def test_token_budget_drops_token_ids_not_lengths():
    h = PromptHistory(HistoryConfig(max_prompts=8, max_visits=2, max_tokens=10))
    h.record([1], [4, 2], [[1] * 4, [2] * 2])
    h.record([2], [3, 3], [[3] * 3, [4] * 3])
    assert h.num_tokens == 6  # the older prompt's token ids went first, its lengths stay
    assert h.completions([1]) == [] and h.lengths([1]) == [4, 2]
    assert [list(c) for c in h.completions([2])] == [[3, 3, 3], [4, 4, 4]]
    lengths_only = PromptHistory(HistoryConfig(max_tokens=0))
    lengths_only.record([1], [2], [[5, 6]])
    assert lengths_only.completions([1]) == [] and lengths_only.lengths([1]) == [2]


def test_clear_and_disabled_history():
    h = PromptHistory()
    h.record([1], [2], [[3, 4]])
    h.clear()
    assert len(h) == 0 and h.num_tokens == 0 and h.lengths([1]) == []
    off = PromptHistory(HistoryConfig(max_prompts=0))
    off.record([1], [2])
    assert len(off) == 0


@pytest.mark.parametrize(
    "overrides,field",
    [({"history_max_prompts": -1}, "history_max_prompts"), ({"history_max_visits": 0}, "history_max_visits"),
     ({"history_max_tokens": 1.5}, "history_max_tokens"),
     ({"speculative_suffix_sources": "all"}, "speculative_suffix_sources"),
     ({"history_fallback": "group"}, "history_fallback")],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**overrides)


def test_engine_records_each_prompt_after_a_call():
    model = tiny_model("llama")
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    engine = RolloutEngine(model, EngineConfig(max_active_sequences=4, kv_cache_tokens=512, block_size=4))
    forced = [[3, 5], [2, 4]]
    res = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, seed=0), forced_lengths=forced)
    assert engine.history.lengths(prompts[0]) == [3, 5] and engine.history.lengths(prompts[1]) == [2, 4]
    assert [list(c) for c in engine.history.completions(prompts[1])] == res.completion_ids[2:]
    engine.generate(prompts[:1], 2, SamplingParams(max_new_tokens=8, seed=1), forced_lengths=[[1, 6]])
    assert [v.lengths for v in engine.history.visits(prompts[0])] == [[3, 5], [1, 6]]
    engine.history.clear()
    assert len(engine.history) == 0
    none = RolloutEngine(model, EngineConfig(max_active_sequences=4, kv_cache_tokens=512, block_size=4,
                                             history_max_prompts=0))
    none.generate(prompts, 2, SamplingParams(max_new_tokens=4))
    assert len(none.history) == 0
