"""Run the model in eval mode for the duration of a block, then give every module back its own previous mode."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model.eval()` inside the block (no dropout: sampling follows the model's eval distribution); on exit, also on
    error, each submodule returns to the mode it had (a model partly in train mode stays so)."""
    modes = [(m, m.training) for m in model.modules()]  # pre-order: a parent is restored before its children
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.train(training)
