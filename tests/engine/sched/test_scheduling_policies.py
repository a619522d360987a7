"""Scheduling policies and admission on hand-made traces with answers computed by hand (pure Python, no model)."""

import itertools
import random

import pytest

from trl_infinite.engine import EngineConfig
from trl_infinite.engine.call import RolloutCall
from trl_infinite.engine.config.registry import SCHEDULERS
from trl_infinite.engine.sched.block_manager import BlockAllocator
from trl_infinite.engine.sched.policies.admission import SLAAdmission
from trl_infinite.engine.sched.policies.fptas import fptas_partition, lpt, makespan
from trl_infinite.engine.sched.predictors.base import build_predictor
from trl_infinite.sim import SimConfig, oracle_bound, simulate
from trl_infinite.sim.replay import TraceExecutor, _requests
from trl_infinite.sim.traces import TraceRecord, lognormal_trace


def trace(*groups, max_new=64):
    return [TraceRecord(prompt_len=5, lengths=list(g), prompt_index=i, max_new_tokens=max_new)
            for i, g in enumerate(groups)]


def steps(records, mode="fixed_slot", scheduler="fifo", slots=2, length_predictor="oracle", **kw):
    engine = EngineConfig(sampling_mode=mode, scheduler=scheduler, max_active_sequences=slots, block_size=4,
                          length_predictor=length_predictor, **kw)
    res = simulate(records, SimConfig(engine, prompts_per_call=len(records)))
    assert res.lengths_preserved
    return res.total()


def finish_order(records, scheduler, slots=1, predictor="oracle"):
    groups = _requests(records, 64)
    cfg = EngineConfig(sampling_mode="fixed_slot", scheduler=scheduler, max_active_sequences=slots,
                       length_predictor=predictor)
    index = {g.group_id: g.group_id for g in groups}
    call = RolloutCall.build(cfg, groups, BlockAllocator(200, 4), build_predictor(cfg.scheduling),
                             lambda call: TraceExecutor(None, None, index))
    call.run()
    return [(s.group_id, s.sample_idx) for s in call.scheduler.finished]


def test_step_convention_one_sample():
    # the first token comes from the prompt's prefill, then one per decode step: length 5 -> 4 decode steps
    assert steps(trace([5]), slots=1).decode_steps == 4
    assert oracle_bound([5], 1) == 4


def test_sjf_vs_fifo_by_hand_micro_group():
    # lengths 9,2,9,2 (step costs 8,1,8,1), g=2 rounds. FIFO rounds {9,2},{9,2}: 8+8=16. SJF {2,2},{9,9}: 1+8=9.
    recs = trace([9, 2, 9, 2])
    assert steps(recs, "micro_group", "fifo").decode_steps == 16
    assert steps(recs, "micro_group", "sjf", length_predictor="oracle").decode_steps == 9


def test_sjf_fifo_lfs_by_hand_fixed_slot():
    # costs 8,1,1,1 on 2 slots. FIFO: slot A runs 8 while B runs 1,1,1 -> 8. SJF: 1,1 | 1,8 -> 1+8 = 9.
    recs = trace([9, 2, 2, 2])
    assert steps(recs, scheduler="fifo").decode_steps == 8
    assert steps(recs, scheduler="sjf", length_predictor="oracle").decode_steps == 9
    # costs 1,1,1,8 in submission order: FIFO 1,1 | 1,8 -> 9; LFS/infinite start the 8 first -> 8 (= the bound)
    recs = trace([2, 2, 2, 9])
    assert steps(recs, scheduler="fifo").decode_steps == 9
    assert steps(recs, scheduler="lfs", length_predictor="oracle").decode_steps == 8
    assert steps(recs, scheduler="infinite", length_predictor="oracle").decode_steps == 8
    assert oracle_bound([2, 2, 2, 9], 2) == 8


def test_fptas_static_plan_by_hand():
    # costs 3,3,2,2,2 (lengths 4,4,3,3,3) on 2 slots: optimum 6 (3+3 | 2+2+2); LPT/FIFO give 3+2+2 = 7
    costs = [3, 3, 2, 2, 2]
    assert makespan(costs, lpt(costs, 2)) == 7
    assert makespan(costs, fptas_partition(costs, 2, 0.1)[0]) == 6
    recs = trace([4, 4, 3, 3, 3])
    assert steps(recs, scheduler="fifo").decode_steps == 7
    assert steps(recs, scheduler="fptas", length_predictor="oracle").decode_steps == 6
    assert steps(recs, scheduler="infinite", length_predictor="oracle").decode_steps == 6


@pytest.mark.parametrize("eps", [0.05, 0.1, 0.3])
def test_fptas_respects_eps_against_brute_force(eps):
    rng = random.Random(0)
    for _ in range(60):
        n, m = rng.randint(3, 8), rng.randint(2, 3)
        costs = [rng.randint(1, 200) for _ in range(n)]
        opt = min(max(sum(c for c, a in zip(costs, assign) if a == b) for b in range(m))
                  for assign in itertools.product(range(m), repeat=n))
        bins, bound = fptas_partition(costs, m, eps)
        assert sorted(i for b in bins for i in b) == list(range(n))  # every sample placed exactly once
        assert bound == pytest.approx(eps) or bound <= eps  # no coarsening on small instances
        assert makespan(costs, bins) <= (1 + eps) * opt + 1e-9


def test_fptas_input_validation():
    with pytest.raises(ValueError, match="fptas_epsilon"):
        fptas_partition([1, 2], 2, 0.0)


def test_seer_probes_first_then_longest_group():
    # g=1: probes (sample 0 of each group) first, smallest generated first; then group 1 (L_g=20) before group 0 (3)
    order = finish_order(trace([3, 10, 10], [20, 2, 2]), "seer")
    assert order[:2] == [(0, 0), (1, 0)]
    assert order[2:4] == [(1, 1), (1, 2)] and order[4:] == [(0, 1), (0, 2)]


def test_no_policy_loses_or_shortens_a_sample():
    recs = lognormal_trace(3, 8, 20, 0.9, 64, prompt_len=6, seed=3)
    for sched in SCHEDULERS:
        for mode in ("micro_group", "fixed_slot", "dynamic_slot", "full_group"):
            for pred in ("oracle", "group", "none"):
                res = steps(recs, mode, sched, slots=3, length_predictor=pred)
                assert res.num_samples == 24, (sched, mode, pred)
    res = steps(recs, "dynamic_slot", "seer", slots=3, chunk_tokens=4, kv_cache_tokens=240)
    assert res.offloaded_blocks > 0


def test_memory_admission_preempts_when_estimate_is_wrong_and_never_exceeds_pool():
    # the first samples finish after 3 tokens, so Alg. 1 learns mu ~ 3 and admits many; the rest run to 60 tokens
    recs = trace([3] * 6 + [60] * 10, max_new=64)
    pool_tokens = 200
    res = steps(recs, "dynamic_slot", "fifo", batch_policy="memory", kv_cache_tokens=pool_tokens)
    assert res.num_samples == 16
    assert res.peak_kv_blocks <= pool_tokens // 4
    assert res.preemptions > 0  # a wrong guess preempts, it never fails
    steps(recs, "dynamic_slot", "fifo", kv_cache_tokens=pool_tokens)  # `steps` checks every length is kept


def test_memory_admission_is_conservative_before_statistics():
    # before 4 samples finished every sample counts as max_new_tokens: 64 tokens = 16 blocks, pool of 50 blocks
    recs = trace([30] * 8, max_new=64)
    res = steps(recs, "dynamic_slot", "fifo", batch_policy="memory", kv_cache_tokens=200)
    assert res.preemptions == 0
    assert res.mean_active_sequences <= 3.0


def test_sla_admission_binary_search_converges():
    # latency model: 1 ms per running sample; SLA 10 ms -> the batch size settles around 10
    sla = SLAAdmission(EngineConfig(sla_decode_ms=10.0, max_active_sequences=64, sla_window=1).scheduling)
    b = sla.max_running(None)
    for _ in range(60):
        sla.on_step_time(b, b / 1000.0)
        b = sla.max_running(None)
    assert 8 <= b <= 12, sla.history
    with pytest.raises(ValueError, match="sla_decode_ms"):
        SLAAdmission(EngineConfig().scheduling)
