"""The decoupled plan (`spec_decode/plan.py`) and the verification cost model (`spec_decode/adaptive.py`) on
synthetic timings: Alg. 1 and Alg. 2 pick what the TGS formulas say, the drain plan what its makespan formula says
(checked against every window assignment), and the cost model recovers the fixed cost of a verification."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_infinite.engine.spec_decode.adaptive import CostModel, plan_lengths
from trl_infinite.engine.spec_decode.plan import (
    COUPLED,
    DECOUPLED,
    Plan,
    StepTimes,
    chain_share,
    drain,
    drain_rows,
    emitted,
    plan,
    reconfigure,
    replan_due,
    tgs_coupled,
    tgs_decoupled,
)


def _brute_tgs(times: StepTimes, p: float, w: int, b: int, decoupled: bool) -> float:
    """The TGS formulas written out again (plan.py's module docstring), from first principles."""
    e = sum(p**a for a in range(w + 1))
    v0, v1, v2, v3 = times.verify
    d0, d1, d2 = times.draft
    draft = lambda n: (d0 + d1 * n + d2 * b * n) if n else 0.0  # noqa: E731
    if not decoupled:
        return b * e / (draft(w) + v0 + v1 * b + v2 * b * w + (v3 if w else 0.0))
    pi = p / (p + 1 - p ** (w + 1))
    return b * (pi * e + 1 - pi) / max(draft(w + 1), v0 + v1 * b + v2 * pi * b * w + (v3 if pi * w else 0.0))


def test_tgs_formulas_and_window_choice():
    """Expensive drafting (a draft model), verification that grows with the batch: the plan picks the window with
    the highest decoupled TGS, and decoupled beats every coupled window there."""
    times = StepTimes(verify=(0.02, 0.002, 0.0005, 0.0), draft=(0.001, 0.004, 0.0002))
    p, b, w_max = 0.8, 32, 8
    assert emitted(p, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert chain_share(1.0, 4) == pytest.approx(1.0) and chain_share(0.0, 4) == 0.0
    for w in range(1, w_max + 1):
        assert tgs_decoupled(times, p, w, b) == pytest.approx(_brute_tgs(times, p, w, b, True))
        assert tgs_coupled(times, p, w, b) == pytest.approx(_brute_tgs(times, p, w, b, False))
    best_w = max(range(1, w_max + 1), key=lambda w: _brute_tgs(times, p, w, b, True))
    best_c = max(_brute_tgs(times, p, w, b, False) for w in range(w_max + 1))
    got = plan(times, p, b, w_max)
    assert got.mode == DECOUPLED and got.window == best_w and got.tgs > best_c
    assert 1 < best_w < w_max  # an interior optimum: not just the largest or smallest window


def test_plan_falls_back_to_coupled_when_drafting_is_cheap_or_acceptance_low():
    """Nearly free drafting (a suffix tree): nothing to overlap, the waste of decoupled execution loses -> coupled
    with the best coupled window; acceptance 0.05: coupled with window 0 (plain decoding)."""
    cheap = StepTimes(verify=(0.02, 0.001, 0.0001, 0.0), draft=(1e-5, 1e-5, 1e-6))
    got = plan(cheap, 0.7, 8, 6)
    best_c = max(range(7), key=lambda w: _brute_tgs(cheap, 0.7, w, 8, False))
    assert got == Plan(COUPLED, best_c, pytest.approx(_brute_tgs(cheap, 0.7, best_c, 8, False)))
    costly = StepTimes(verify=(0.02, 0.002, 0.0005, 0.0), draft=(0.001, 0.004, 0.0002))
    assert plan(costly, 0.05, 32, 6).window == 0


def test_reconfigure_moves_requests_below_the_mean():
    """Alg. 2: requests at or above the mean acceptance keep the batch plan; one far below gets the better of its
    own coupled and decoupled windows at the current batch (not at b = 1, the paper's choice: see `reconfigure`); a
    batch planned as plain decoding keeps every request at plain decoding."""
    times = StepTimes(verify=(0.02, 0.002, 0.0005, 0.0), draft=(0.001, 0.004, 0.0002))
    base = plan(times, 0.8, 32, 6)
    out = reconfigure(times, base, {1: 0.9, 2: 0.85, 3: 0.1}, 6, 32)
    assert out[1] == base and out[2] == base
    dec = max(range(1, 7), key=lambda w: _brute_tgs(times, 0.1, w, 32, True))
    cpl = max(range(7), key=lambda w: _brute_tgs(times, 0.1, w, 32, False))
    tgs_d, tgs_c = _brute_tgs(times, 0.1, dec, 32, True), _brute_tgs(times, 0.1, cpl, 32, False)
    want = (DECOUPLED, dec) if tgs_d > tgs_c else (COUPLED, cpl)
    assert (out[3].mode, out[3].window) == want and out[3].window < base.window
    # compute-bound at 64 rows (each verified position costs 2 ms): plain decoding is planned, and a request below
    # the mean stays at plain decoding; evaluated at b = 1 (the paper's Alg. 2) it would get a 4-token window
    bound = StepTimes(verify=(0.02, 0.0001, 0.002, 0.0), draft=(0.0005, 0.0002, 0.00001))
    none = plan(bound, 0.8, 64, 6)
    assert none.window == 0
    assert all(p.window == 0 for p in reconfigure(bound, none, {1: 0.9, 2: 0.9, 3: 0.7}, 6, 64).values())
    assert reconfigure(bound, none, {1: 0.9, 2: 0.9, 3: 0.7}, 6, 1)[3].window == 4


# ------------------------------------------------------------------------------------------- the verification cost
def test_cost_model_learns_the_fixed_cost_of_verifying():
    """Steps timed as t = 70 ms + 3 ms b + 2 ms D + 20 ms [D > 0] (a plain static step, or an eager verification
    forward): the fit recovers each coefficient, and the batch switch turns speculation off when one draft per row
    at acceptance 0.15 cannot pay for the fixed cost (it would at 0.6)."""
    truth = (0.07, 0.003, 0.002, 0.02)
    cost = CostModel(decay=1.0, ridge=1e-9)
    for i in range(60):
        b, d = 4 + i % 5, [0, 1, 3, 8, 16][i % 5 if i % 7 else 0]
        cost.observe(b, d, truth[0] + truth[1] * b + truth[2] * d + (truth[3] if d else 0.0))
    assert cost.coef == pytest.approx(truth, rel=1e-3)
    assert cost.time(8, 1) - cost.time(8, 0) == pytest.approx(0.022, rel=1e-3)
    assert plan_lengths([0.15] * 8, [1] * 8, cost, adaptive=True) == [0] * 8
    assert plan_lengths([0.6] * 8, [1] * 8, cost, adaptive=True) == [1] * 8


# ------------------------------------------------------------------------------------------------ the drain plan
CPU8 = StepTimes(verify=(0.07, 0.003, 0.002, 0.02), draft=(1e-5, 3e-6, 1e-6))  # suffix drafter: nearly free
COSTLY = StepTimes(verify=(0.02, 0.002, 0.0005, 0.0), draft=(0.001, 0.004, 0.0002))  # a draft model


def _brute_drain(times: StepTimes, remaining, acceptance, w_max: int, mode: str) -> float:
    """The least makespan over every window assignment (w_max + 1)^b, the module docstring's formula written out."""
    v0, v1, v2, v3 = times.verify
    d0, d1, d2 = times.draft
    best = float("inf")
    for ws in itertools.product(range(w_max + 1), repeat=len(remaining)):
        tok, verified = [], 0.0
        for p, w in zip(acceptance, ws):
            e = sum(p**a for a in range(w + 1))
            pi = p / (p + 1 - p ** (w + 1)) if p > 0 else 0.0
            tok.append(e if mode == COUPLED else pi * e + 1 - pi)
            verified += w if mode == COUPLED else pi * w
        m = max(r / t for r, t in zip(remaining, tok))
        n, top = sum(1 for w in ws if w), max(ws)
        rounds = top if mode == COUPLED else top + 1
        draft = d0 + d1 * rounds + d2 * n * rounds if n else 0.0
        verify = v0 + v1 * len(ws) + v2 * verified + (v3 if verified > 0 else 0.0)
        best = min(best, m * (draft + verify if mode == COUPLED else max(draft, verify)))
    return best


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 80), st.floats(0.0, 0.95)), min_size=1, max_size=4),
       costly=st.booleans(), w_max=st.integers(1, 3))
def test_drain_plan_is_the_least_makespan_of_every_window_assignment(rows, costly, w_max):
    times = COSTLY if costly else CPU8
    remaining, acceptance = [r for r, _ in rows], [p for _, p in rows]
    got = drain(times, remaining, acceptance, w_max)
    want = {m: _brute_drain(times, remaining, acceptance, w_max, m) for m in (COUPLED, DECOUPLED)}
    assert got.seconds == pytest.approx(min(want.values()), rel=1e-9)
    assert got.seconds == pytest.approx(want[got.mode], rel=1e-9) and len(got.windows) == len(rows)
    assert all(0 <= w <= w_max for w in got.windows)


def test_drain_plan_follows_the_slowest_row_not_the_batch():
    """Eight rows, 63 tokens to go, nearly free drafting and a 20 ms fixed verification cost (the CPU figures):
    - at acceptance 0.5 for all, Alg. 1 (tokens per second) and the drain plan both speculate;
    - one row at 0.02 bounds the makespan whatever the others do: plain decoding, where Alg. 1 at the mean would
      still speculate;
    - one row with 60 tokens to go and seven with 10: only that row drafts;
    - a draft model with high acceptance: decoupled execution, every row with a window."""
    assert plan(CPU8, 0.5, 8, 5).window > 0 and any(drain(CPU8, [63] * 8, [0.5] * 8, 5).windows)
    mixed = [0.5] * 7 + [0.02]
    assert plan(CPU8, sum(mixed) / 8, 8, 5).window > 0
    none = drain(CPU8, [63] * 8, mixed, 5)
    assert none.windows == (0,) * 8 and none.steps == 63 and none.mode == COUPLED
    one = drain(CPU8, [10] * 7 + [60], [0.6] * 8, 5)
    assert one.windows[:7] == (0,) * 7 and one.windows[7] > 0 and one.steps < 60
    dec = drain(COSTLY, [63] * 8, [0.8] * 8, 5)
    assert dec.mode == DECOUPLED and all(dec.windows)
    top, rows = drain_rows(COSTLY, {"a": (63, 0.8), "b": (63, 0.8)}, 5)
    assert top.mode == DECOUPLED and top.window == max(p.window for p in rows.values()) and set(rows) == {"a", "b"}


def test_replan_due():
    """Every `every` steps; at once when draining begins or a row has no plan; every step while a drain plan drafts;
    `every` = 0: never again."""
    assert replan_due(16, 16, False, False, True, False) and not replan_due(5, 16, False, False, True, False)
    assert replan_due(5, 16, True, False, False, False)  # the call starts draining
    assert not replan_due(5, 16, True, True, False, False)  # draining, plan of no speculation: at the period
    assert replan_due(5, 16, True, True, True, False) and replan_due(5, 16, True, True, False, True)
    assert not any(replan_due(s, 0, True, False, True, True) for s in range(1, 40))
