"""`CompiledStep`: every guard checked on a key's first call, the compiled bytecode called directly afterwards.

- Its outputs equal the uncompiled method's on every call: the first of a key, the direct ones after it, another
  key, and after the parameters are updated in place (an optimizer step) — the bytecode reads them at each call.
- After the first call of a key, its calls skip Dynamo's guards: a change that the guards would catch but the key
  does not cover (a Python attribute the step branches on) goes unseen until `reset()`. This is the contract the
  engine keeps: what varies between its steps is in the key, and it calls `reset` when parameters move.
- After `reset()`, the next call is checked in full and recompiles where a guard fails; where none fails, the entry
  that served it is called directly afterwards (what a graph capture records: the fuzzer found a capture after a
  `reset` calling Dynamo instead).
- A second module whose first call reuses an entry compiled for the first (nothing new compiled) runs correctly, and
  then directly through that entry, on its own parameters.
- The private hooks are used only on the torch versions they were checked on; elsewhere (`fast=False`) every call is
  guarded, with the same outputs. More entries than Dynamo's default limit compile, and no Dynamo setting (nor
  anything else an engine sets) is left changed after the engine is gone.
"""

from __future__ import annotations

import pytest
import torch
from _models import requires_compile

from trl_infinite.engine.decode.compiled import RECOMPILE_LIMIT_SETTING, CompiledStep, fast_dispatch_supported


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.double = True

    def step(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if self.double else y


def test_direct_calls_match_eager_and_read_parameters_each_call():
    torch._dynamo.reset()
    torch.manual_seed(0)
    toy = Toy()
    step = CompiledStep(toy.step, "eager", None)
    x, y = torch.randn(3, 4), torch.randn(5, 4)
    for _ in range(3):
        torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)
        torch.testing.assert_close(step(("rows", 5), y), toy.step(y), rtol=0, atol=0)
    with torch.no_grad():
        toy.lin.weight.add_(1.0)  # an optimizer step: same storage, new values
    torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)


@pytest.mark.skipif(not fast_dispatch_supported(), reason="the guard-free dispatch runs only on the torch releases of FAST_DISPATCH_TORCH")
def test_guards_are_skipped_after_the_first_call_until_reset():
    torch._dynamo.reset()
    torch.manual_seed(0)
    toy = Toy()
    step = CompiledStep(toy.step, "eager", None)
    x = torch.randn(3, 4)
    step(("rows", 3), x)
    step(("rows", 3), x)
    toy.double = False  # the guards would catch this; the key does not cover it
    with torch.no_grad():
        torch.testing.assert_close(step(("rows", 3), x), toy.lin(x) * 2, rtol=0, atol=0)  # the key's old bytecode
    step.reset()
    torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)  # checked in full: recompiled
    torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)  # and called directly again


def test_an_entry_compiled_for_another_module_serves_the_second_directly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    first, second = Toy(), Toy()  # other random weights
    x = torch.randn(3, 4)
    CompiledStep(first.step, "eager", None)(("rows", 3), x)
    step = CompiledStep(second.step, "eager", None)
    for _ in range(3):
        torch.testing.assert_close(step(("rows", 3), x), second.step(x), rtol=0, atol=0)
    if step.fast:
        torch.testing.assert_close(step.entry(("rows", 3))(x), second.step(x), rtol=0, atol=0)


@pytest.mark.skipif(not fast_dispatch_supported(), reason="the guard-free dispatch runs only on the torch releases of FAST_DISPATCH_TORCH")
def test_after_a_reset_that_changes_nothing_the_entry_is_called_directly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    toy = Toy()
    step = CompiledStep(toy.step, "eager", None)
    x, y = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    toy64 = Toy().to(torch.float64)
    step(("rows", 3), x)
    CompiledStep(toy64.step, "eager", None)(("rows", 3), y)  # another entry, now the most recently used
    step.reset()  # parameters moved (here: nothing did): the next call is checked in full, compiling nothing
    assert step.entry(("rows", 3)) is None
    torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)
    direct = step.entry(("rows", 3))
    assert direct is not None
    torch.testing.assert_close(direct(x), toy.step(x), rtol=0, atol=0)  # float32's entry, not float64's


def test_private_hooks_only_on_checked_torch_versions():
    for version in ("2.11.0", "2.13.0", "2.13.1+cu128", "2.14.1+cu130", "2.15.0+cu132"):
        assert fast_dispatch_supported(version), version
    for version in ("2.4.0", "2.10.0", "2.12.1", "2.16.0", "3.0.0", "3.13.0"):
        assert not fast_dispatch_supported(version)
    assert CompiledStep(Toy().step, "eager", None).fast == fast_dispatch_supported()


def test_guarded_fallback_matches_eager_and_sees_every_change():
    """Without the private hooks (`fast=False`, any torch outside `FAST_DISPATCH_TORCH`): plain guarded calls, so a
    change the key does not cover is seen at once (no `reset` needed)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    toy = Toy()
    step = CompiledStep(toy.step, "eager", None, fast=False)
    x, y = torch.randn(3, 4), torch.randn(5, 4)
    for _ in range(2):
        torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)
        torch.testing.assert_close(step(("rows", 5), y), toy.step(y), rtol=0, atol=0)
    assert step.entry(("rows", 3)) is None  # nothing to call directly: a graph capture records the guarded call
    toy.double = False
    torch.testing.assert_close(step(("rows", 3), x), toy.step(x), rtol=0, atol=0)


@pytest.mark.parametrize("fast", [True, False])
def test_more_entries_than_dynamos_default_limit_compile_and_the_limit_is_restored(fast):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    limit = getattr(torch._dynamo.config, RECOMPILE_LIMIT_SETTING)
    toy = Toy()
    step = CompiledStep(toy.step, "eager", None, fast=fast)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # one entry per row count
        for rows in range(1, 2 * limit + 2):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(step(("rows", rows), x), toy.step(x), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 2 * limit + 1  # every one compiled, none left to eager
    assert getattr(torch._dynamo.config, RECOMPILE_LIMIT_SETTING) == limit


@requires_compile
def test_an_engine_leaves_no_process_wide_setting_changed():
    """Built, used (compiled step, support probe, CPU kernel where it builds) and dropped: Dynamo's and inductor's
    settings, torch's global modes and the probe's record are as they were."""
    import gc

    from _models import tiny_model

    from trl_infinite.engine import EngineConfig, RolloutEngine, SamplingParams
    from trl_infinite.engine.model.probe import _ACTIVE

    def state():
        return (torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy(),
                torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
                torch.are_deterministic_algorithms_enabled(), _ACTIVE.get(None))

    before = state()
    engine = RolloutEngine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, block_size=4, compile=True,
                                                             compile_backend="eager", max_active_sequences=2))
    engine.generate([[5, 6, 7]], 2, SamplingParams(max_new_tokens=4, seed=0))
    del engine
    gc.collect()
    assert state() == before
