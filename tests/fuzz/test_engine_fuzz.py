"""Differential fuzzer of the rollout engine (issue 24): random engine configurations over the whole space, random
prompts and call sequences on one engine; every call must give exactly the reference's tokens (greedy:
`model.generate`; sampled: the canonical plain engine with the same seed), every sample must run to EOS or
`max_new_tokens`, no block may stay held, the pool's peak must stay within the budget. One case in six captures and
replays its decode steps (the CPU capture emulation, the KV pool at fixed addresses across the calls). One case in
four changes a fresh model's weights between its calls (issue 40: every route of `testing/weight_routes.py`, and
`reset_prefix_cache()` where the case declares `kv_cache_reuse_across_calls`), its calls sharing a header that a stale
cache would serve: the references are recomputed on the new weights.

CI runs the `fuzz-ci` profile: derandomized (the same examples every run), a fixed number of examples, no compile.
`pytest tests/fuzz --fuzz-long` (or `TRL_INFINITE_FUZZ=long`) runs the `fuzz-long` profile: random examples, many
more of them, compile drawn in one case in ten. A failure is shrunk by hypothesis; shrunk failures are kept as
ordinary tests in `test_fuzz_regressions.py`.
"""

from __future__ import annotations

import os

import pytest
import torch
from _fuzz_engine import cases, run_case, world
from hypothesis import HealthCheck, given, settings

settings.register_profile(
    "fuzz-ci", max_examples=160, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "fuzz-long", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def _profile(request) -> settings:
    """The CI profile, or the long one (`--fuzz-long` / `TRL_INFINITE_FUZZ=long`); `TRL_INFINITE_FUZZ_EXAMPLES=N`
    sets the number of examples of either."""
    long = request.config.getoption("--fuzz-long") or os.environ.get("TRL_INFINITE_FUZZ") == "long"
    profile = settings.get_profile("fuzz-long" if long else "fuzz-ci")
    examples = os.environ.get("TRL_INFINITE_FUZZ_EXAMPLES")
    return settings(profile, max_examples=int(examples)) if examples else profile


pytestmark = pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # generate, on min_new_tokens


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_engine_is_lossless_under_every_configuration(request):
    profile = _profile(request)
    eos_pool = world().eos_pool
    allow_compile = not profile.derandomize and os.environ.get("TRL_INFINITE_FUZZ_COMPILE", "1") != "0"

    @profile
    @given(case=cases(eos_pool, allow_compile=allow_compile))
    def fuzz(case):
        run_case(case)

    fuzz()
