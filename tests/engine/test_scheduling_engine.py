"""The engine runs the simulator's scheduler: same decode steps on forced lengths (every registered scheduler x batch
policy x sampling mode); divided rollout, memory admission and the prefix predictor inside the real engine (tiny
random model)."""

import random

import pytest
from _models import tiny_model

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.config.registry import BATCH_POLICIES, SAMPLING_MODES, SCHEDULERS
from trl_infinite.engine.executor import ModelExecutor
from trl_infinite.sim import SimConfig, simulate
from trl_infinite.sim.traces import TraceRecord

RNG = random.Random(0)
PROMPTS = [[RNG.randrange(5, 90) for _ in range(RNG.randint(3, 9))] for _ in range(2)]
LENGTHS = [[RNG.randint(1, 30) for _ in range(6)] for _ in PROMPTS]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize(
    "mode,scheduler,chunk",
    [("micro_group", "fifo", None), ("fixed_slot", "sjf", None), ("fixed_slot", "infinite", None),
     ("fixed_slot", "fptas", None), ("fixed_slot", "seer", 6), ("dynamic_slot", "lfs", None)],
)
def test_engine_matches_simulator_on_forced_lengths(model, mode, scheduler, chunk):
    _check_engine_equals_simulator(model, mode, scheduler, chunk, LENGTHS)


@pytest.mark.parametrize(
    "scheduler,chunk", [("lrf", None), ("lrf", 5), ("lfs_max", None), ("fifo", 5)],
)
def test_new_policies_match_simulator_on_forced_lengths(model, scheduler, chunk):
    _check_engine_equals_simulator(model, "fixed_slot", scheduler, chunk, LENGTHS)


@pytest.mark.parametrize(
    "scheduler,chunk", [("lfs", None), ("lrf", 5), ("infinite", None), ("sjf", None), ("lfs_max", None)]
)
def test_engine_matches_simulator_across_calls_with_history(model, scheduler, chunk):
    """Two calls on the same prompts (two epochs): the second is scheduled from the first call's lengths, in the
    engine's history and in the simulator's alike (k beyond every length: the prefix head never answers)."""
    epochs = [LENGTHS, [[n % 7 + 2 * i + 1 for n in g] for i, g in enumerate(reversed(LENGTHS))]]
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=3, scheduler=scheduler,
                       length_predictor="history", prefix_predictor_k=64, kv_cache_tokens=240, block_size=4,
                       chunk_tokens=chunk)
    engine = RolloutEngine(model, cfg)
    steps = [engine.generate(PROMPTS, 6, SamplingParams(max_new_tokens=40, seed=e), forced_lengths=lengths)
             .stats.decode_steps for e, lengths in enumerate(epochs)]
    records = [TraceRecord(prompt_len=len(p), lengths=g, prompt_index=i, max_new_tokens=40, prompt_ids=p, epoch=e)
               for e, lengths in enumerate(epochs) for i, (p, g) in enumerate(zip(PROMPTS, lengths))]
    sim = simulate(records, SimConfig(cfg, prompts_per_call=2))
    assert steps == [c.decode_steps for c in sim.calls]
    assert len(engine.history) == 2 and engine.history.lengths(PROMPTS[1]) == LENGTHS[1] + epochs[1][1]
    if scheduler != "lfs_max":  # it ranks by the longest known length, not the predictor's estimate
        assert engine.predictor.mae_by_source()["history"][1] == 12  # every second-call sample ranked by history


STEP_MS = (1.0, 1.0)  # decode step time model (1 ms + 1 ms per row): what `sla` decides from, engine and simulator
SHORT = [[RNG.randint(1, 14) for _ in range(6)] for _ in PROMPTS]
SAME = ("decode_steps", "tail_decode_steps", "scheduler_steps", "active_sequence_steps", "peak_active_sequences",
        "peak_kv_blocks", "num_kv_blocks", "preemptions", "prompt_evictions", "parks", "offloaded_blocks",
        "generated_tokens")


@pytest.mark.parametrize("mode", list(SAMPLING_MODES))
def test_engine_and_simulator_take_the_same_steps_for_every_plugin(model, monkeypatch, mode):
    """Every registered scheduler x batch policy in this sampling mode, on forced lengths: the engine and the
    simulator, built from one `EngineConfig`, schedule alike (same steps, batch sizes, blocks, preemptions). The
    `sla` policy decides from the same deterministic step-time model in both (the engine's measured step times
    replaced by it)."""
    monkeypatch.setattr(ModelExecutor, "step_seconds",
                        lambda self, batch, measured: (STEP_MS[0] + STEP_MS[1] * len(batch.decode)) / 1e3)
    records = [TraceRecord(prompt_len=len(p), lengths=g, prompt_index=i, max_new_tokens=16)
               for i, (p, g) in enumerate(zip(PROMPTS, SHORT))]
    steps = {}
    for scheduler in SCHEDULERS:
        for policy in BATCH_POLICIES:
            cfg = EngineConfig(sampling_mode=mode, max_active_sequences=3, scheduler=scheduler, batch_policy=policy,
                               length_predictor="oracle", kv_cache_tokens=160, block_size=4, sla_decode_ms=3.0,
                               sla_window=1)
            res = RolloutEngine(model, cfg).generate(PROMPTS, 6, SamplingParams(max_new_tokens=16, seed=1),
                                                     forced_lengths=SHORT)
            assert [len(c) for c in res.completion_ids] == [n for g in SHORT for n in g]
            sim = simulate(records, SimConfig(cfg, prompts_per_call=2, step_ms=STEP_MS))
            assert sim.lengths_preserved and len(sim.calls) == 1
            assert {k: getattr(res.stats, k) for k in SAME} == {k: getattr(sim.calls[0], k) for k in SAME}, (
                scheduler, policy)
            steps[scheduler, policy] = res.stats.decode_steps
    # the policies do decide: the SLA bound (about 2 rows at 3 ms) changes the schedule of some scheduler
    assert any(steps[s, "sla"] != steps[s, "static"] for s in SCHEDULERS)


def test_one_token_samples_take_no_decode_row(model):
    """Samples that end with their first token (sampled from the prompt's logits) never join a decode forward."""
    ones = [[1, 1, 1, 4, 1, 1], [1, 1, 1, 1, 1, 1]]
    _check_engine_equals_simulator(model, "fixed_slot", "fifo", None, ones)
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=3, kv_cache_tokens=240, block_size=4)
    res = RolloutEngine(model, cfg).generate(PROMPTS, 6, SamplingParams(max_new_tokens=1, seed=1))
    assert res.stats.decode_steps == 0 and all(len(c) == 1 for c in res.completion_ids)


def _check_engine_equals_simulator(model, mode, scheduler, chunk, lengths):
    cfg = EngineConfig(sampling_mode=mode, max_active_sequences=3, scheduler=scheduler, length_predictor="oracle",
                       kv_cache_tokens=240, block_size=4, chunk_tokens=chunk)
    res = RolloutEngine(model, cfg).generate(PROMPTS, 6, SamplingParams(max_new_tokens=40, seed=1),
                                             forced_lengths=lengths)
    assert [len(c) for c in res.completion_ids] == [n for g in lengths for n in g]  # nothing lost or shortened
    records = [TraceRecord(prompt_len=len(p), lengths=g, prompt_index=i, max_new_tokens=40)
               for i, (p, g) in enumerate(zip(PROMPTS, lengths))]
    sim = simulate(records, SimConfig(cfg, prompts_per_call=2)).total()
    assert res.stats.decode_steps == sim.decode_steps
    assert res.stats.peak_kv_blocks == sim.peak_kv_blocks
    assert res.stats.tail_decode_steps == sim.tail_decode_steps


def test_divided_rollout_offload_is_lossless(model):
    sp = SamplingParams(max_new_tokens=24, temperature=0.0)
    ref = RolloutEngine(model, EngineConfig(max_active_sequences=4, kv_cache_tokens=800, block_size=4))
    base = ref.generate(PROMPTS, 5, sp).completion_ids
    cfg = EngineConfig(sampling_mode="dynamic_slot", kv_cache_tokens=100, block_size=4, chunk_tokens=4)
    res = RolloutEngine(model, cfg).generate(PROMPTS, 5, sp)
    assert res.stats.offloaded_blocks > 0  # the host tier was used, and KV came back without re-prefill
    assert res.completion_ids == base


def test_memory_batch_policy_in_engine_stays_in_pool(model):
    cfg = EngineConfig(sampling_mode="dynamic_slot", batch_policy="memory", kv_cache_tokens=160, block_size=4)
    forced = [[2, 2, 2, 2, 28, 28], [28, 28, 2, 28, 28, 28]]
    res = RolloutEngine(model, cfg).generate(PROMPTS, 6, SamplingParams(max_new_tokens=30), forced_lengths=forced)
    assert [len(c) for c in res.completion_ids] == [n for g in forced for n in g]
    assert res.stats.peak_kv_blocks <= res.stats.num_kv_blocks


def test_prefix_predictor_learns_from_hidden_states(model):
    cfg = EngineConfig(sampling_mode="fixed_slot", max_active_sequences=4, scheduler="sjf", length_predictor="prefix",
                       prefix_predictor_k=2, prefix_predictor_min_train=4, kv_cache_tokens=600, block_size=4)
    engine = RolloutEngine(model, cfg)
    sp = SamplingParams(max_new_tokens=40, seed=3)
    for _ in range(2):
        res = engine.generate(PROMPTS, 6, sp, forced_lengths=LENGTHS)
        assert [len(c) for c in res.completion_ids] == [n for g in LENGTHS for n in g]
    assert len(engine.predictor.head) == 24  # every finished sample with a captured hidden state trained the head
    assert engine.predictor.head.xs[0].shape == (model.config.hidden_size,)
    assert "length_prediction_mae" in res.stats.extra  # the second call scheduled with the head's predictions
