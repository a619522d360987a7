"""Drafter units: the grouped suffix tree proposes a sibling's continuation; n-gram prompt lookup; registry."""

import pytest
import torch

from trl_infinite.engine import EngineConfig, SamplingParams
from trl_infinite.engine.sched.history import PromptHistory
from trl_infinite.engine.sched.sequence import Group, Sequence
from trl_infinite.engine.spec_decode import DRAFTERS, DraftContext
from trl_infinite.engine.spec_decode.adaptive import AcceptanceTracker, best_length


def build_drafter(name, history=None, **flags):
    """The drafter `name`, built as the engine builds it, with the options of the flags given."""
    cfg = EngineConfig(**flags)
    return DRAFTERS.build(name, cfg.speculative, DraftContext(torch.device("cpu"), SamplingParams(), cfg, history))


def _group(prompt, g=2):
    group = Group(0, prompt, g)
    return group, [Sequence(group, j, max_new_tokens=64) for j in range(g)]


def test_suffix_proposes_sibling_continuation_after_shared_prefix():
    _, (a, b) = _group([90, 91, 92])
    d = build_drafter("suffix")
    d.start(a)
    d.update(a, [10, 11, 12, 13, 14, 15, 16])
    d.stop(a)  # a finished: its completion stays in the group's tree
    d.start(b)
    d.update(b, [10, 11, 12])
    assert d.propose([b], [3])[0].tokens == [13, 14, 15]
    assert d.propose([b], [10])[0].tokens == [13, 14, 15, 16]  # no more continuation known


@pytest.mark.parametrize("sources", ["siblings+history", "history", "siblings"])
def test_suffix_drafts_from_the_prompts_earlier_completions(sources):
    history = PromptHistory()
    history.record([90, 91, 92], [6], [[10, 11, 12, 40, 41, 42]])  # the prompt's completion on an earlier visit
    _, (a, b) = _group([90, 91, 92])
    d = build_drafter("suffix", history=history, speculative_suffix_sources=sources)
    d.start(a)
    d.update(a, [10, 11, 12])
    expected = {"siblings": [], "history": [40, 41], "siblings+history": [40, 41]}[sources]
    assert d.propose([a], [2])[0].tokens == expected
    assert d.history_texts == (0 if sources == "siblings" else 1)
    d.update(a, [13, 14, 15])
    d.start(b)
    d.update(b, [13])
    # with "history" only, the running sibling's own text is matched, never indexed
    assert d.propose([b], [2])[0].tokens == ([] if sources == "history" else [14, 15])


def test_suffix_confidence_threshold_and_frequency():
    def proposal(min_confidence: float) -> list[int]:
        _, seqs = _group([90], g=4)
        d = build_drafter("suffix", speculative_suffix_min_confidence=min_confidence)
        for s, tail in zip(seqs[:3], ([5, 6], [5, 6], [5, 7])):
            d.start(s)
            d.update(s, [1, 2, 3] + tail)
        d.start(seqs[3])
        d.update(seqs[3], [1, 2, 3])
        return d.propose([seqs[3]], [4])[0].tokens

    assert proposal(0.6) == [5, 6]  # 6 follows 5 in 2 of 3 siblings: 2/3 >= 0.6
    assert proposal(0.7) == [5]  # 2/3 < 0.7 stops before 6


def test_ngram_prompt_lookup():
    _, (a, _) = _group([1, 2, 3, 9, 8, 7])
    d = build_drafter("ngram")
    d.start(a)
    d.update(a, [4, 1, 2])
    assert d.propose([a], [3])[0].tokens == [3, 9, 8]
    assert d.propose([a], [0])[0].tokens == []


def test_best_of_n_scores_members_and_prefers_the_accurate_one():
    _, (a, b) = _group([90, 91, 92])
    d = build_drafter("best_of_n")
    for s in (a, b):
        d.start(s)
    d.update(a, [10, 11, 12, 13, 14, 15])
    d.update(b, [10, 11])
    assert d.propose([b], [3])[0].tokens == [12, 13, 14]  # only the suffix tree knows the sibling
    d.update(b, [12, 13, 14, 99])
    assert d.tracker.alpha((b.seq_id, 0)) > d.tracker.alpha((b.seq_id, 1))


def test_adaptive_length_backs_off():
    t = AcceptanceTracker()
    for _ in range(8):
        t.observe("x", 4, 0)
    assert best_length(t.alpha("x"), 0.05, 5) == 0
    assert best_length(0.9, 0.05, 5) == 5


def test_config_validation():
    assert {"suffix", "ngram", "draft_model", "best_of_n"} <= set(DRAFTERS)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="speculative_num_tokens"):
        EngineConfig(speculative_method="suffix", speculative_num_tokens=0)
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(speculative_method="draft_model")
