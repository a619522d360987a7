"""The simulator replays none / coupled / decoupled speculation on acceptance traces through the drive loop."""

import pytest

from trl_infinite.engine.config.engine_config import EngineConfig
from trl_infinite.engine.spec_decode.plan import StepTimes, plan, tgs_decoupled
from trl_infinite.sim import SimConfig
from trl_infinite.sim.speculative import SpecReplay, acceptance_from_stats, simulate_speculative
from trl_infinite.sim.traces import TraceRecord

TIMES = StepTimes(verify=(0.02, 0.002, 0.0005, 0.0), draft=(0.001, 0.004, 0.0002))


def _records(p: float, g: int = 32, length: int = 200) -> list[TraceRecord]:
    return [TraceRecord(prompt_len=20, lengths=[length] * g, extra={"acceptance": [p] * g})]


def _run(records, **kw):
    cfg = SimConfig(engine=EngineConfig(sampling_mode="full_group", block_size=16))
    res = simulate_speculative(records, cfg, SpecReplay(TIMES, num_tokens=6, **kw))
    s = res.calls[0]
    assert res.lengths_preserved and s.generated_tokens == sum(records[0].lengths)
    return s


def test_replay_preserves_lengths_and_orders_the_modes():
    """High acceptance, costly drafting: fewer decode steps with speculation, decoupled faster than coupled than
    none, and the decoupled call's speed within 10% of the plan's steady-state TGS at that batch (the batch stays
    full: equal lengths)."""
    recs = _records(0.8)
    none, coupled, dec = (_run(recs, mode=m) for m in ("none", "coupled", "decoupled"))
    assert none.decode_steps == 199 and coupled.decode_steps < none.decode_steps
    speed = {m: s.generated_tokens / s.extra["sim_seconds"] for m, s in zip("ncd", (none, coupled, dec))}
    assert speed["d"] > speed["c"] > speed["n"]
    best = plan(TIMES, 0.8, 32, 6)
    assert speed["d"] == pytest.approx(tgs_decoupled(TIMES, 0.8, best.window, 32), rel=0.1)


def test_replay_is_reproducible_and_falls_back_at_low_acceptance():
    a, b = _run(_records(0.3), mode="decoupled"), _run(_records(0.3), mode="decoupled")
    assert a.decode_steps == b.decode_steps and a.extra["sim_seconds"] == b.extra["sim_seconds"]
    low = _run(_records(0.02), mode="decoupled")
    assert low.decode_steps == 199  # the plan says plain decoding: one token per step


def test_acceptance_from_stats():
    extra = {"spec_sample_acceptance": {"0/0": (8, 10, 2), "0/1": (0, 4, 4)}}
    assert acceptance_from_stats(extra, 0, 3) == [9 / 12, 1 / 6, 0.5]


def test_replay_drains_with_the_makespan_plan():
    """All 8 samples at once (nothing left to admit from the first step): the replay follows the engine's drain
    plan. One sample that accepts almost nothing bounds the call, so the planned replay decodes plainly (199 steps,
    no draft wasted on the others), while Alg. 1 at the mean acceptance would speculate; with every sample at 0.8
    it speculates and finishes in fewer steps."""
    times = StepTimes(verify=(0.07, 0.003, 0.002, 0.02), draft=(1e-5, 3e-6, 1e-6))
    mixed = [TraceRecord(prompt_len=20, lengths=[200] * 8, extra={"acceptance": [0.5] * 7 + [0.01]})]
    assert plan(times, (0.5 * 7 + 0.01) / 8, 8, 6).window > 0
    cfg = SimConfig(engine=EngineConfig(sampling_mode="full_group", block_size=16))
    run = lambda recs: simulate_speculative(recs, cfg, SpecReplay(times, num_tokens=6)).calls[0]  # noqa: E731
    assert run(mixed).decode_steps == 199
    high = [TraceRecord(prompt_len=20, lengths=[200] * 8, extra={"acceptance": [0.8] * 8})]
    assert run(high).decode_steps < 150
