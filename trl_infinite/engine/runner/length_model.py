"""A Hugging Face sequence-classification model as the prefix length predictor's head (`length_predictor` given as
a model): the scheduling package imports no torch, so the engine hands it this function (`build_predictor`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def length_regressor(model: torch.nn.Module) -> Callable[[list[int], list[int]], float]:
    """`(prompt_ids, prefix_ids) -> length`: the model's one regression logit on the prompt + prefix ids."""

    def run(prompt_ids: list[int], prefix_ids: list[int]) -> float:
        with torch.no_grad():
            ids = torch.tensor([prompt_ids + prefix_ids], device=next(model.parameters()).device)
            return float(model(input_ids=ids).logits.reshape(-1)[0])

    return run
