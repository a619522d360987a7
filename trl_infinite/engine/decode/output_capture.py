"""transformers' output-capturing hooks (what `output_hidden_states=True` reads), installed before a compiled step.

transformers collects hidden states through forward hooks that a model decorated with `capture_outputs` installs on
its first forward asking for them (`maybe_install_capturing_hooks`), under a `threading.Lock`. Dynamo cannot trace
that lock, so a compiled (or captured) decode step must not be that first forward: the static step installs them
eagerly, before its first forward that wants hidden states, with transformers' own function called on the models it
would be called on: the decorated models a text forward runs (found from the support probe's attention calls),
outer ones first as in a forward. An outer model's installation hooks the models nested in it and marks every model
it hooked, so each installs once, on the modules and under the names a first eager forward would give; a model that
already had them (an earlier eager forward) is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

try:
    from transformers.utils.output_capturing import capture_outputs, maybe_install_capturing_hooks
except ImportError:  # a transformers without lazily installed capture hooks: nothing to install
    capture_outputs = maybe_install_capturing_hooks = None

# the code object every `capture_outputs` wrapper shares (the wrapper is a closure over the decorated forward)
_WRAPPER_CODE = capture_outputs(lambda self: None).__code__ if capture_outputs is not None else None


def captures_outputs(module: torch.nn.Module) -> bool:
    """Whether `module`'s class forward is decorated with transformers' `capture_outputs` (anywhere in its chain of
    `functools.wraps` decorators)."""
    fn = getattr(type(module), "forward", None)
    while fn is not None and _WRAPPER_CODE is not None:
        if getattr(fn, "__code__", None) is _WRAPPER_CODE:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def capturing_models(model: torch.nn.Module, reached: Iterable[torch.nn.Module]) -> tuple[torch.nn.Module, ...]:
    """The modules of `model` decorated with `capture_outputs` that contain one of `reached` (the attention modules
    a text forward ran), outer first: the ones a forward asking for hidden states installs the hooks from. A
    decorated model the text forward does not run (a vision tower) is not among them."""
    ran = {id(m) for m in reached}
    return tuple(m for m in model.modules() if captures_outputs(m) and any(id(x) in ran for x in m.modules()))


def install_capturing_hooks(models: tuple[torch.nn.Module, ...]) -> None:
    """Install transformers' output-capturing hooks on `models` (from `capturing_models`) now, eagerly, where they
    are not installed yet (see the module docstring)."""
    for m in models:
        maybe_install_capturing_hooks(m)
