"""`length_predictor="history"`: the chain history -> siblings -> prefix -> global mean, by hand (no model)."""

import pytest

from trl_infinite.engine import EngineConfig
from trl_infinite.engine.config.registry import SCHEDULERS
from trl_infinite.engine.sched.history import PromptHistory
from trl_infinite.engine.sched.policies.base import SchedulerView
from trl_infinite.engine.sched.predictors.base import GroupPredictor, build_predictor
from trl_infinite.engine.sched.predictors.history import HistoryPredictor, SortedLengths
from trl_infinite.engine.sched.sequence import Group, Sequence


def scheduling(**flags):
    return EngineConfig(length_predictor="history", **flags).scheduling


def group(prompt, g=4, gid=0):
    grp = Group(group_id=gid, prompt_ids=list(prompt), num_generations=g)
    return grp, [Sequence(grp, j, max_new_tokens=100) for j in range(g)]


def finish(pred, seq, n):
    seq.output_ids = [0] * n
    pred.observe(seq)


def test_sorted_lengths_conditional_means():
    s = SortedLengths([40, 10, 30, 20])
    assert s.mean_above(0) == 25 and s.mean_above(25) == 35 and s.mean_above(40) is None
    assert s.mean_above(0, 0.5) == 35  # the upper half: ranks 2..3
    assert s.mean_above(35, 0.5) == 40


def test_history_by_rank_and_elapsed():
    hist = PromptHistory()
    hist.record([1, 2], [10, 20, 30, 40])
    pred = build_predictor(scheduling(prefix_predictor_k=16, history_fallback="prefix"), hist)
    grp, seqs = group([1, 2])
    pred.begin_call([grp])
    assert pred.predict_with_source(seqs[0]) == (25, "history")  # the mean of the prompt's past lengths
    finish(pred, seqs[0], 12)  # r = 1 of 4 finished: the 3 still running are the group's longest
    assert pred.predict_with_source(seqs[1]) == (30, "history")  # mean of the upper 3/4 of the history
    seqs[1].output_ids = [0] * 35  # outlived most of its history: E[L | L > 35] = 40
    assert pred.estimate(seqs[1]) == 40
    seqs[2].output_ids = [0] * 50  # longer than anything seen: no history, no sibling longer -> global mean > e
    assert pred.predict_with_source(seqs[2]) == (None, "global")
    assert pred.estimate(seqs[2]) == 100  # max_new_tokens while nothing longer finished
    assert pred.needs_prefix(seqs[2]) and not pred.needs_prefix(seqs[3])


def test_siblings_then_global_without_history():
    pred = HistoryPredictor(scheduling(prefix_predictor_k=4, history_fallback="siblings"), PromptHistory())
    grp, seqs = group([7])
    other, others = group([8], gid=1)
    pred.begin_call([grp, other])
    assert pred.predict_with_source(seqs[0]) == (None, "global") and not pred.has_estimate(seqs[0])
    finish(pred, others[0], 60)
    assert pred.predict_with_source(seqs[0]) == (60, "global")  # mean of finished lengths (any prompt) > e
    finish(pred, seqs[0], 30)
    finish(pred, seqs[1], 50)
    assert pred.predict_with_source(seqs[2]) == (40, "siblings") and pred.has_estimate(seqs[2])
    seqs[2].output_ids = [0] * 45
    assert pred.predict_with_source(seqs[2]) == (50, "siblings")
    pred.begin_call([grp])  # a new call: siblings are those of this call only
    assert pred.predict_with_source(seqs[3])[1] == "global"
    plain = HistoryPredictor(scheduling(prefix_predictor_k=4), PromptHistory())  # the default chain skips siblings (and the prefix probe)
    plain.begin_call([grp])
    plain.observe(Sequence(grp, 0, 100, output_ids=[0] * 30))
    assert plain.predict_with_source(seqs[3]) == (30, "global") and not plain.needs_prefix(seqs[3])
    assert plain.prefix_k is None and not plain.wants_hidden
    with pytest.raises(ValueError, match="history_fallback"):
        scheduling(history_fallback="group")


def test_first_prediction_is_scored_against_the_constant_mean():
    hist = PromptHistory()
    hist.record([3], [100, 100])
    pred = HistoryPredictor(scheduling(prefix_predictor_k=4), hist)
    warm, warm_seqs = group([4], g=2, gid=1)
    grp, seqs = group([3], g=2)
    pred.begin_call([warm, grp])
    finish(pred, warm_seqs[0], 20)
    finish(pred, warm_seqs[1], 40)  # the constant-mean predictor now says 30
    assert pred.estimate(seqs[0]) == 100
    finish(pred, seqs[0], 90)
    assert pred.source_scores["history"].call == [10] and pred.baseline.call[-1] == 60
    assert pred.mae_by_source()["history"] == (10, 1)
    pred.end_call()  # per-call tables go; the running scores stay
    assert pred.source_scores["history"].call == [] and pred.mae_by_source()["history"] == (10, 1)


def test_group_predictor_forgets_siblings_between_calls():
    pred = GroupPredictor()
    grp, seqs = group([1])
    pred.observe(Sequence(grp, 0, 100, output_ids=[0] * 9))
    assert pred.predict(seqs[1]) == 9
    nxt, nxt_seqs = group([2])  # same group id 0 in the next call, another prompt
    pred.begin_call([nxt])
    assert pred.predict(nxt_seqs[1]) is None


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("fallback", ["prefix", "none"])
def test_only_samples_without_history_probe_their_prefix(known, fallback):
    hist = PromptHistory()
    if known:
        hist.record([5, 5], [30, 30, 30, 30])
    config = scheduling(prefix_predictor_k=4, history_fallback=fallback)
    pred = build_predictor(config, hist)
    policy = SCHEDULERS.build("lfs", config, pred, 4)
    grp, seqs = group([5, 5])
    policy.on_submit([grp], seqs)
    assert policy.chunk_limit(seqs[0]) == (5 if fallback == "prefix" and not known else None)


def test_lfs_max_runs_the_prompt_with_the_longest_known_completion_first():
    hist = PromptHistory()
    hist.record([1], [5, 6, 7, 8])
    hist.record([2], [3, 3, 3, 40])  # shorter on average, but its longest completion is the longest known
    config = scheduling(prefix_predictor_k=16)
    pred = build_predictor(config, hist)
    policy = SCHEDULERS.build("lfs_max", config, pred, 2)
    (g1, s1), (g2, s2), (g3, s3) = group([1]), group([2], gid=1), group([3], gid=2)
    policy.on_submit([g1, g2, g3], s1 + s2 + s3)
    waiting = s1 + s2 + s3
    order = policy.ordered(SchedulerView([], waiting, 100, 100, 4, 0))
    # prompt 3 was never seen: a potential long tail (max_new_tokens) first, then prompt 2 (40), then prompt 1 (8)
    assert [s.group_id for s in order] == [2] * 4 + [1] * 4 + [0] * 4
    finish(pred, s3[0], 2)  # a finished sibling now bounds prompt 3 from below: 2 < 8 < 40
    assert [s.group_id for s in policy.ordered(SchedulerView([], waiting[:-4] + s3[1:], 100, 100, 4, 0))] == (
        [1] * 4 + [0] * 4 + [2] * 3)
