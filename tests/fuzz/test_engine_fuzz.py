"""Differential fuzzer of the rollout engine (issue 24): random engine configurations over the whole space, random
prompts and call sequences on one engine; every call must give exactly the reference's tokens (greedy:
`model.generate`; sampled: the canonical plain engine with the same seed), every sample must run to EOS or
`max_new_tokens`, no block may stay held, the pool's peak must stay within the budget. One case in six captures and
replays its decode steps (the CPU capture emulation, the KV pool at fixed addresses across the calls). The draws
include generation kwargs at their edges (ids 0 and vocab-1, empty lists, `min_new_tokens` above `max_new_tokens`,
`top_k` at and above the vocabulary) and draft models that differ from the target (depth, heads, width, family,
vocabulary, dtype, the target's own config object). Two more tests (issue 40): draft models that do not match the
target are refused at build time naming `speculative_draft_model` or give the reference's tokens; one bad input among
edge values is refused before the model runs, naming the field.
Some cases (one in four of the random draws; about half of the derandomized CI examples) change a fresh model's
weights between their calls (issue 40: every route of `testing/weight_routes.py`, and `reset_prefix_cache()` where the
case declares `kv_cache_reuse_across_calls`), their calls sharing a header that a stale cache would serve: the
references are recomputed on the new weights.
One case in six runs whole under CPU bf16 autocast (TRL's `bf16=True` on float32 weights; the engine's 16-bit weight
copy or not), on a fresh model with references computed in the same region; the tolerances there scale with a bf16
ulp of the call's largest logit (`_fuzz_engine.Tolerance`). In both precisions a sampled token may differ where a
token sits at a top-k / top-p / min-p cut within rounding (`_fuzz_engine.admissible_rows`).

CI runs the `fuzz-ci` profile: derandomized (the same examples every run), a fixed number of examples, no compile.
`pytest tests/fuzz --fuzz-long` (or `TRL_INFINITE_FUZZ=long`) runs the `fuzz-long` profile: random examples, many
more of them, compile drawn in one case in ten. A failure is shrunk by hypothesis; shrunk failures are kept as
ordinary tests in `test_fuzz_regressions.py`.
"""

from __future__ import annotations

import os

import pytest
from _fuzz_edges import bad_inputs, check_refused_before_the_call
from _fuzz_engine import cases, draft_cases, run_case, run_draft_case, world
from _models import tiny_model
from _profiles import profile, register
from hypothesis import given, settings

from trl_infinite.engine import EngineConfig, RolloutEngine

register("fuzz", ci_examples=160, long_examples=1000)


def _profile(request) -> settings:
    return profile(request, "fuzz")


pytestmark = [pytest.mark.filterwarnings("ignore:Unfeasible length constraints"),  # generate, on min_new_tokens
              pytest.mark.usefixtures("one_thread")]


def test_engine_is_lossless_under_every_configuration(request):
    profile = _profile(request)
    eos_pool = world().eos_pool
    allow_compile = not profile.derandomize and os.environ.get("TRL_INFINITE_FUZZ_COMPILE", "1") != "0"

    @profile
    @given(case=cases(eos_pool, allow_compile=allow_compile))
    def fuzz(case):
        run_case(case)

    fuzz()


def _fewer(profile: settings, ci: int, long: int) -> settings:
    """The profile with `ci` examples (CI) or `long` (the long profile), unless `TRL_INFINITE_FUZZ_EXAMPLES` set it."""
    if os.environ.get("TRL_INFINITE_FUZZ_EXAMPLES"):
        return profile
    return settings(profile, max_examples=ci if profile.derandomize else long)


def test_draft_models_that_do_not_match_the_target_are_refused_or_lossless(request):
    """Issue 40: other depth / heads / width / family / vocabulary / special ids / dtype, or the target's own config
    object: a `ValueError` naming `speculative_draft_model` when the engine is built, or the reference's tokens."""

    @_fewer(_profile(request), ci=12, long=150)
    @given(case=draft_cases())
    def fuzz(case):
        run_draft_case(*case)

    fuzz()


def test_bad_inputs_are_refused_before_the_call_naming_the_field(request):
    """Issue 40: one bad `SamplingParams` field or generation kwarg among edge values: a `ValueError` naming it,
    before the model runs (no forward)."""
    engine = RolloutEngine(tiny_model("qwen3"), EngineConfig(kv_cache_tokens=256, block_size=4))

    @_fewer(_profile(request), ci=40, long=400)
    @given(bad=bad_inputs())
    def fuzz(bad):
        check_refused_before_the_call(engine, [[5, 6, 7], [8]], *bad)

    fuzz()
