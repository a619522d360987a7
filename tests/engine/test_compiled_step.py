"""`CompiledStep`: every guard checked on a key's first call, the compiled bytecode called directly afterwards.

- Its outputs equal the uncompiled method's on every call: the first of a key, the direct ones after it, another
  key, and after the parameters are updated in place (an optimizer step) — the bytecode reads them at each call.
- After the first call of a key, its calls skip Dynamo's guards: a change that the guards would catch but the key
  does not cover (a Python attribute the step branches on) goes unseen until `reset()`. This is the contract the
  engine keeps: what varies between its steps is in the key, and it calls `reset` when parameters move.
- After `reset()`, the next call is checked in full and recompiles where a guard fails.
- A second module whose first call reuses an entry compiled for the first (nothing new compiled, so no bytecode to
  keep) runs correctly on the guarded path.
"""

from __future__ import annotations

import torch

from trl_infinite.engine.compiled_step import CompiledStep


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


def test_an_entry_compiled_for_another_module_runs_guarded():
    torch._dynamo.reset()
    torch.manual_seed(0)
    first, second = Toy(), Toy()
    x = torch.randn(3, 4)
    CompiledStep(first.step, "eager", None)(("rows", 3), x)
    step = CompiledStep(second.step, "eager", None)
    for _ in range(3):
        torch.testing.assert_close(step(("rows", 3), x), second.step(x), rtol=0, atol=0)
