"""The hypothesis profiles of the fuzzers: a derandomized CI profile (the same examples every run, a fixed number)
and a long random one, chosen by `--fuzz-long` / `TRL_INFINITE_FUZZ=long`; `TRL_INFINITE_FUZZ_EXAMPLES=N` sets the
number of examples of either."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]


def register(name: str, ci_examples: int, long_examples: int) -> None:
    """Profiles `{name}-ci` and `{name}-long`."""
    settings.register_profile(f"{name}-ci", max_examples=ci_examples, derandomize=True, deadline=None, database=None,
                              print_blob=True, suppress_health_check=_QUIET)
    settings.register_profile(f"{name}-long", max_examples=long_examples, deadline=None, print_blob=True,
                              suppress_health_check=_QUIET)


def profile(request, name: str) -> settings:
    """The CI profile of `name`, or its long one."""
    long = request.config.getoption("--fuzz-long") or os.environ.get("TRL_INFINITE_FUZZ") == "long"
    chosen = settings.get_profile(f"{name}-long" if long else f"{name}-ci")
    examples = os.environ.get("TRL_INFINITE_FUZZ_EXAMPLES")
    return settings(chosen, max_examples=int(examples)) if examples else chosen
