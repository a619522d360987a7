"""Decoupled speculation (SpecActor §4.1): lossless like coupled speculation, the drafter thread joined on every exit
path, and the TGS plan (Alg. 1) / per-request reconfiguration (Alg. 2) choosing what the formulas say."""

import copy
import threading

import pytest
from _models import reference_greedy
from test_spec_engine import _chi2_pvalue, _exact_triples, _ModelOracle

from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
from trl_infinite.engine.spec_decode import register_drafter
from trl_infinite.engine.spec_decode.decoupled import DecoupledStep
from trl_infinite.engine.spec_decode.plan import (
    COUPLED,
    DECOUPLED,
    Plan,
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [3, 4, 5, 3, 4, 5, 3, 4, 30, 31]]
MAX_NEW = 32


@register_drafter("test_oracle_ahead")
class _AheadOracle(_ModelOracle):
    """The target's argmax continuation (often accepted), also after assumed tokens (drafting ahead), computed by a
    copy of the target given as the draft model (the drafter thread runs while the target itself verifies)."""

    supports_ahead = True

    def propose_ahead(self, seqs, assumed, ks):
        saved = dict(self.ctx)
        try:
            for s, extra in zip(seqs, assumed):
                self.ctx[s.seq_id] = self.ctx[s.seq_id] + list(extra)
            return self.propose(seqs, ks)
        finally:
            self.ctx = saved


def _engine(model, method=None, draft=None, **kw):
    if method is not None and method.startswith("test_"):
        draft = copy.deepcopy(model)
    cfg = EngineConfig(kv_cache_tokens=16384, block_size=8, speculative_method=method, speculative_draft_model=draft,
                       **kw)
    return RolloutEngine(model, cfg)


def _fixed_plans(monkeypatch, plans) -> None:
    """Every plan of the decoupled step (Alg. 1, and the drain plan for every row) is the next of `plans`; no
    Alg. 2."""
    import trl_infinite.engine.spec_decode.decoupled as decoupled

    def drain_rows(times, rows, w_max):
        p = next(plans)
        return p, {k: Plan(p.mode, p.window, p.tgs) for k in rows}

    monkeypatch.setattr(decoupled, "plan", lambda times, p, b, w_max: next(plans))
    monkeypatch.setattr(decoupled, "drain_rows", drain_rows)
    monkeypatch.setattr(decoupled, "reconfigure", lambda *args: {})


def _drafter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trl-infinite-drafter")]


@pytest.mark.parametrize("method", ["suffix", "ngram", "best_of_n", "draft_model", "test_oracle_ahead"])
def test_decoupled_coupled_and_none_give_the_same_greedy_tokens(model, draft, method):
    """Greedy: no speculation, coupled and decoupled (a fixed window, and the TGS plan after a profiling call) give
    `model.generate`'s tokens; the decoupled runs verified windows drafted ahead on the drafter thread."""
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    ref = [c for p in PROMPTS for c in [reference_greedy(model, p, MAX_NEW, [])] * 2]
    none = _engine(model).generate(PROMPTS, 2, sp)
    d = draft if method in ("draft_model", "best_of_n") else None
    coupled = _engine(model, method, d).generate(PROMPTS, 2, sp)
    fixed = _engine(model, method, d, speculative_decoupled=True, speculative_draft_window=3).generate(PROMPTS, 2, sp)
    planned_engine = _engine(model, method, d, speculative_decoupled=True, speculative_reconfigure_every=2)
    planned = [planned_engine.generate(PROMPTS, 2, sp) for _ in range(2)]
    for out in (none, coupled, fixed, *planned):
        assert out.completion_ids == ref
    assert fixed.stats.extra["spec_ahead_tokens"] > 0  # the drafter thread drafted windows ahead
    if method == "test_oracle_ahead":  # drafts that are often right: windows drafted ahead are used
        assert fixed.stats.extra["spec_ahead_used"] > 0 and fixed.stats.accepted_tokens > 0
    assert not _drafter_threads()


def test_decoupled_sampling_keeps_the_target_law(model):
    """T=1, top_k=6, top_p=0.9, decoupled with window 2: 1500 samples of the first 3 tokens pass the chi-square test
    against the exact law at significance 0.001 (deterministic seeds), drafts drafted ahead were both accepted and
    rejected, and the samples equal plain sampling's with the same seed."""
    prompt, g = PROMPTS[0], 1500
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=6, top_p=0.9, seed=11)
    law = _exact_triples(model, prompt, sp)
    cfg = dict(max_active_sequences=g, speculative_num_tokens=2, speculative_decoupled=True,
               speculative_draft_window=2)
    out = _engine(model, "test_oracle_ahead", **cfg).generate([prompt], g, sp)
    base = _engine(model, max_active_sequences=g).generate([prompt], g, sp)
    s = out.stats
    assert s.extra["spec_ahead_used"] > 0 and 0 < s.accepted_tokens < s.draft_tokens
    assert _chi2_pvalue([tuple(c[:3]) for c in out.completion_ids], law) > 1e-3
    assert out.completion_ids == base.completion_ids


def test_drafter_thread_joined_when_a_step_raises(model, draft):
    """A fault from a decode step of a decoupled call reaches the caller, the drafter thread is gone, nothing is
    held, and the next call gives the plain greedy tokens."""
    engine = _engine(model, "draft_model", draft, speculative_decoupled=True, speculative_draft_window=2)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)

    class Fault(Exception):
        pass

    def fault(batch, seconds):
        if len(batch.decode) and batch.decode[0].num_generated >= 3:
            raise Fault

    with pytest.raises(Fault):
        engine.generate(PROMPTS, 2, sp, on_decode_step=fault)
    assert not _drafter_threads() and engine.pool.allocator.num_used == 0
    out = engine.generate(PROMPTS, 2, sp)
    assert out.completion_ids == _engine(model).generate(PROMPTS, 2, sp).completion_ids



@pytest.mark.parametrize("window", [0, 3])
def test_a_coupled_plan_runs_coupled_speculation_without_a_drafter_thread(model, monkeypatch, window):
    """When the plan gives every row coupled execution the step is coupled speculation (window > 0: the coupled
    controller's drafts, verified) or plain decoding (window 0: no draft at all), and no drafter thread starts."""
    import trl_infinite.engine.spec_decode.decoupled as decoupled

    def no_thread(*args, **kwargs):
        raise AssertionError("a drafter thread was started under a coupled plan")

    _fixed_plans(monkeypatch, iter(lambda: Plan(COUPLED, window, 1.0), None))
    monkeypatch.setattr(decoupled, "ThreadPoolExecutor", no_thread)
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    engine = _engine(model, "suffix", speculative_decoupled=True, speculative_reconfigure_every=2)
    engine.generate(PROMPTS, 2, sp)  # profiles the step times: the plan is made from the next call's first step
    out = engine.generate(PROMPTS, 2, sp)
    s = out.stats
    assert s.extra["spec_plan_mode"] == COUPLED and s.extra["spec_plans"] > 0
    assert s.extra["spec_decoupled_rows"] == 0 and s.extra["spec_ahead_tokens"] == 0
    assert (s.draft_tokens == 0) == (window == 0)
    assert out.completion_ids == [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS for _ in range(2)]


@register_drafter("test_oracle_counted")
class _CountedOracle(_AheadOracle):
    """`_AheadOracle` that counts its updates and checks that it always drafts from the whole context."""

    updates = starts = stops = 0

    def _start(self, seq):
        type(self).starts += 1
        super()._start(seq)

    def update(self, seq, tokens):
        type(self).updates += 1
        super().update(seq, tokens)

    def stop(self, seq):
        type(self).stops += 1
        super().stop(seq)

    assumed: dict[int, int] = {}  # seq_id -> tokens assumed after the context while drafting ahead

    def propose_ahead(self, seqs, assumed, ks):
        self.assumed = {s.seq_id: len(a) for s, a in zip(seqs, assumed)}
        try:
            return super().propose_ahead(seqs, assumed, ks)
        finally:
            self.assumed = {}

    def propose(self, seqs, ks):
        for s in seqs:
            ctx = self.ctx[s.seq_id]
            ctx = ctx[: len(ctx) - self.assumed.get(s.seq_id, 0)]
            assert ctx == s.group.prompt_ids + s.output_ids, "drafting from a stale context"
        return super().propose(seqs, ks)


def test_a_plan_of_no_speculation_defers_the_drafters_updates(model, monkeypatch):
    """While the plan is "no speculation" a step is the plain one: no draft slots reserved and no per-token update
    of the drafter; when a re-plan drafts again, the drafter first gets everything it missed (it never drafts from a
    stale context), and the tokens stay plain greedy decoding's."""
    # none, then w=3 for three plans (the first of them drafts from the step after it: no slots were reserved)
    _fixed_plans(monkeypatch, iter(([Plan(COUPLED, 0, 1.0)] + [Plan(COUPLED, 3, 1.0)] * 3) * 100))
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    engine = _engine(model, "test_oracle_counted", speculative_decoupled=True, speculative_reconfigure_every=4)
    engine.generate(PROMPTS, 2, sp)  # profiles the step times: the plan is made from the next call's first step
    steps = []  # (draft slots reserved, rows decoded) per step
    _CountedOracle.updates = 0
    out = engine.generate(PROMPTS, 2, sp,
                          on_decode_step=lambda batch, seconds: steps.append((batch.lookahead, len(batch.decode))))
    s = out.stats
    assert out.completion_ids == [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS for _ in range(2)]
    assert s.extra["spec_plans"] >= 3 and s.draft_tokens > 0  # speculation resumed after an idle stretch
    lookaheads = [k for k, _ in steps]
    assert 0 in lookaheads and max(lookaheads) == 5  # speculative_num_tokens (default)
    # without deferral: one update per row and step; here the idle steps' updates are merged into one per row
    assert 0 < _CountedOracle.updates < sum(rows for _, rows in steps) - sum(1 for k in lookaheads if k == 0)


def test_config_fields_and_errors():
    cfg = EngineConfig(speculative_method="suffix", speculative_decoupled=True, speculative_draft_window=3,
                       speculative_reconfigure_every=4)
    assert (cfg.speculative.decoupled, cfg.speculative.draft_window, cfg.speculative.reconfigure_every) == (True, 3, 4)
    with pytest.raises(ValueError, match="speculative_draft_window"):
        EngineConfig(speculative_num_tokens=2, speculative_draft_window=3)
    with pytest.raises(ValueError, match="speculative_decoupled"):
        EngineConfig(speculative_decoupled="yes")
    with pytest.raises(ValueError, match="speculative_reconfigure_every"):
        EngineConfig(speculative_reconfigure_every=-1)
    from trl_infinite.trainer.config import InfiniteGRPOConfig

    names = {f for f in InfiniteGRPOConfig.__dataclass_fields__}
    assert {"rollout_speculative_decoupled", "rollout_speculative_draft_window",
            "rollout_speculative_reconfigure_every"} <= names


def test_a_drafter_that_cannot_draft_ahead_is_refused(model):
    """`test_oracle` (no `propose_ahead`) with decoupled execution, or the target as its own draft model (both would
    run at once): a ValueError."""
    with pytest.raises(ValueError, match="speculative_decoupled"):
        _engine(model, "test_oracle", speculative_decoupled=True).generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))
    self_draft = RolloutEngine(model, EngineConfig(kv_cache_tokens=4096, speculative_method="draft_model",
                                                   speculative_draft_model=model, speculative_decoupled=True))
    with pytest.raises(ValueError, match="another module"):
        self_draft.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))


def test_draining_calls_use_the_drain_plans_windows(model, monkeypatch):
    """Two slots for four samples: `ScheduledBatch.draining` turns on once the last sample is admitted and stays on;
    the step plans again at once, and from then on every row drafts exactly its drain-plan window (here 3 for the
    row with the largest id, 0 for the others; the coupled controller would draft for every row, this oracle's
    drafts being always right). Greedy tokens unchanged."""
    import trl_infinite.engine.spec_decode.decoupled as decoupled

    chosen, drafted = [], []  # the row each drain plan gives a window; (draining, that row, {seq_id: k}) per draft

    def drain_rows(times, rows, w_max):
        chosen.append(max(rows))
        per_row = {k: Plan(COUPLED, 3 if k == chosen[-1] else 0, 1.0) for k in rows}
        return Plan(COUPLED, 3, 1.0), per_row

    propose = decoupled.DecoupledStep._propose

    def recorded(self, seqs, ks):
        drafted.append((self.draining, chosen[-1] if chosen else None, {s.seq_id: k for s, k in zip(seqs, ks)}))
        return propose(self, seqs, ks)

    monkeypatch.setattr(decoupled, "drain_rows", drain_rows)
    monkeypatch.setattr(decoupled.DecoupledStep, "_propose", recorded)
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    engine = _engine(model, "test_oracle_ahead", speculative_decoupled=True, sampling_mode="fixed_slot",
                     max_active_sequences=2)
    engine.generate(PROMPTS, 2, sp)  # profiles the step times
    chosen.clear()
    drafted.clear()
    draining = []
    out = engine.generate(PROMPTS, 2, sp, on_decode_step=lambda batch, seconds: draining.append(batch.draining))
    assert out.completion_ids == [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS for _ in range(2)]
    first = draining.index(True)
    assert 0 < first and all(draining[first:])  # off while samples wait, then on for good
    assert out.stats.extra["spec_plan_draining"] is False and chosen
    in_drain = [(row, ks) for flag, row, ks in drafted if flag]
    assert in_drain and all(k == 0 if sid != row else 0 < k <= 3 for row, ks in in_drain for sid, k in ks.items())
    assert any(ks[row] == 3 for row, ks in in_drain)  # the window as planned (<3 only where the length cap cuts)


def test_a_call_planned_without_speculation_never_touches_the_drafter(model, monkeypatch):
    """A plan of no speculation for the whole call: the drafter is never started, updated or stopped (a suffix
    tree over the prompt and every completion, a draft model's prefill: work only drafts would use); greedy tokens
    unchanged."""
    _fixed_plans(monkeypatch, iter(lambda: Plan(COUPLED, 0, 1.0), None))
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    engine = _engine(model, "test_oracle_counted", speculative_decoupled=True)
    engine.generate(PROMPTS, 2, sp)  # profiles the step times: the plan is made from the next call's first step
    _CountedOracle.starts = _CountedOracle.updates = _CountedOracle.stops = 0
    out = engine.generate(PROMPTS, 2, sp)
    assert out.completion_ids == [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS for _ in range(2)]
    assert out.stats.draft_tokens == 0
    assert (_CountedOracle.starts, _CountedOracle.updates, _CountedOracle.stops) == (0, 0, 0)


@pytest.mark.parametrize("mode", [COUPLED, DECOUPLED])
def test_a_replan_that_resumes_speculation_drafts_only_into_reserved_slots(model, monkeypatch, mode):
    """Regression (a real-weights run of `benchmarks/decoupled.py`: every row of a b = 8 call left plain decoding):
    while the plan is "no speculation" no draft slots are reserved (`lookahead` 0), so a re-plan that resumes
    speculation in the middle of a step must not draft before the next step. The drain plan's per-row windows were
    drafted at once, their KV written past the sample's blocks (into another block) and the tokens after them
    sampled from corrupted context. Blocks of 4 tokens, so that every window of 5 crosses a block."""
    plans = iter(([Plan(COUPLED, 0, 1.0)] + [Plan(mode, 5, 1.0)] * 3) * 100)  # none, then w=5 for three plans
    _fixed_plans(monkeypatch, plans)
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    engine = RolloutEngine(model, EngineConfig(kv_cache_tokens=16384, block_size=4,
                                               speculative_method="test_oracle_counted",
                                               speculative_draft_model=copy.deepcopy(model),
                                               speculative_decoupled=True, speculative_reconfigure_every=3))
    engine.generate(PROMPTS, 2, sp)  # profiles the step times: the plan is made from the next call's first step
    steps = []  # (draft slots reserved, most drafts verified by a row) per step
    draft = DecoupledStep._draft

    def recorded(self, batch):
        proposals = draft(self, batch)
        steps.append((batch.lookahead, max(len(p.tokens) for p in proposals)))
        return proposals

    monkeypatch.setattr(DecoupledStep, "_draft", recorded)
    out = engine.generate(PROMPTS, 2, sp)
    assert out.completion_ids == [reference_greedy(model, p, MAX_NEW, []) for p in PROMPTS for _ in range(2)]
    assert out.stats.draft_tokens > 0 and any(k == 0 for k, _ in steps)  # idle stretches and drafting ones
    assert all(drafts <= reserved for reserved, drafts in steps)
