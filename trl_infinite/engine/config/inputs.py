"""Validation of what `RolloutEngine.generate` is given: prompt token ids and EOS ids, checked against the vocabulary.

Prompts are a list of lists of Python ints (a 2D tensor / numpy array, or a list of 1D ones, is accepted and
converted); floats, booleans and strings are refused rather than truncated or reinterpreted. Each error is a
`ValueError` naming the argument.
"""

from __future__ import annotations

import numbers
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def model_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's input embedding (the ids it accepts), else `config.vocab_size`."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    return int(model.config.get_text_config().vocab_size)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _array_to_list(value, name: str):
    """A torch tensor / numpy array of integers as nested lists; anything else unchanged."""
    if not (hasattr(value, "tolist") and hasattr(value, "dtype")):
        return value
    torch = sys.modules.get("torch")  # a tensor means torch is imported; this module does not import it
    if torch is not None and isinstance(value, torch.Tensor):
        is_int = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
    else:  # numpy: signed / unsigned integer kinds
        is_int = getattr(value.dtype, "kind", None) in ("i", "u")
    if not is_int:
        raise ValueError(f"`{name}` must hold integer token ids, got an array of dtype {value.dtype}.")
    return value.tolist()


def _int_rows(value, name: str) -> list[list[int]]:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"`{name}` must be a list of token-id lists, got a string {value[:40]!r}; tokenize it first.")
    value = _array_to_list(value, name)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"`{name}` must be a list of token-id lists, got {type(value).__name__}.")
    rows = []
    for i, row in enumerate(value):
        row = _array_to_list(row, f"{name}[{i}]")
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"`{name}[{i}]` must be a list of int token ids, got {type(row).__name__} {row!r:.60}.")
        for j, t in enumerate(row):
            if not _is_int(t):
                raise ValueError(f"`{name}[{i}][{j}]` must be an int token id, got {type(t).__name__} {t!r}.")
        rows.append([int(t) for t in row])
    return rows


def check_prompts(prompt_ids, vocab_size: int) -> list[list[int]]:
    """`prompt_ids` as a list of non-empty lists of ints in [0, vocab_size)."""
    rows = _int_rows(prompt_ids, "prompt_ids")
    if not rows:
        raise ValueError("`prompt_ids` must hold at least one prompt (a list of token-id lists).")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"`prompt_ids[{i}]` is empty: every prompt needs at least one token.")
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"`prompt_ids[{i}]` holds token id {bad[0]} outside the model's vocabulary [0, {vocab_size}).")
    return rows


def check_eos(eos_token_ids: list[int], vocab_size: int) -> None:
    """Every EOS id (already ints, see `SamplingParams`) lies in [0, vocab_size)."""
    bad = [t for t in eos_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"`eos_token_ids` holds {bad[0]}, outside the model's vocabulary [0, {vocab_size}).")


def eos_list(value) -> list[int]:
    """`SamplingParams.eos_token_ids` as a list of ints: an int, a list / tuple / 1D tensor of ints, or None."""
    if value is None:
        return []
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        value = value.tolist()
    if _is_int(value):
        return [int(value)]
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"`eos_token_ids` must be an int or a list of int token ids, got {type(value).__name__} "
                         f"{value!r:.60}; pass the tokenizer's `eos_token_id`.")
    for t in value:
        if not _is_int(t):
            raise ValueError(f"`eos_token_ids` must hold int token ids, got {type(t).__name__} {t!r}.")
        if t < 0:
            raise ValueError(f"`eos_token_ids` must hold token ids >= 0, got {t}.")
    return [int(t) for t in value]
