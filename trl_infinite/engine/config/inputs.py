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
    return int(text_config(model).vocab_size)


def text_config(model_or_config):
    """The language model's config of a model or of a config (`get_text_config()`: a multimodal config's text part),
    else the config itself (a config without that method, or whose text part is ambiguous)."""
    config = getattr(model_or_config, "config", model_or_config)
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):
        return config


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _array_to_list(value, name: str):
    """A torch tensor / numpy array of integers as nested lists; anything else unchanged."""
    if not (hasattr(value, "tolist") and hasattr(value, "dtype")):
        return value
    torch = sys.modules.get("torch")  # a tensor means torch is imported; this module does not import it
    if torch is not None and isinstance(value, torch.Tensor):
        integral = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
    else:  # numpy: signed / unsigned integer kinds
        integral = getattr(value.dtype, "kind", None) in ("i", "u")
    if not integral:
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
            if not is_int(t):
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


def check_request(prompt_ids: list[list[int]], num_generations, max_new_tokens: int | None,
                  max_model_len: int | None, forced_lengths: list[list[int]] | None) -> int:
    """`generate`'s other arguments checked; returns the call's `max_new` (`max_new_tokens`, else what the longest
    prompt leaves of the model's `max_position_embeddings`)."""
    if not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations < 1:
        raise ValueError(f"`num_generations` must be an integer >= 1, got {num_generations!r}.")
    if forced_lengths is not None:
        if len(forced_lengths) != len(prompt_ids) or any(len(f) != num_generations for f in forced_lengths):
            raise ValueError("`forced_lengths` must be a list of one list of G lengths per prompt.")
        if any(n < 1 for f in forced_lengths for n in f):
            raise ValueError("`forced_lengths` entries must be >= 1.")
    if max_new_tokens is not None:
        return max_new_tokens
    if max_model_len is None:
        raise ValueError("`max_new_tokens` is None and the model config has no `max_position_embeddings`.")
    if max_model_len - max(len(p) for p in prompt_ids) < 1:
        raise ValueError("a prompt fills the model's `max_position_embeddings`: no room to generate.")
    return max_model_len - max(len(p) for p in prompt_ids)


def eos_list(value) -> list[int]:
    """`SamplingParams.eos_token_ids` as a list of ints: an int, a list / tuple / 1D tensor of ints, or None."""
    if value is None:
        return []
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        value = value.tolist()
    if is_int(value):
        return [int(value)]
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"`eos_token_ids` must be an int or a list of int token ids, got {type(value).__name__} "
                         f"{value!r:.60}; pass the tokenizer's `eos_token_id`.")
    for t in value:
        if not is_int(t):
            raise ValueError(f"`eos_token_ids` must hold int token ids, got {type(t).__name__} {t!r}.")
        if t < 0:
            raise ValueError(f"`eos_token_ids` must hold token ids >= 0, got {t}.")
    return [int(t) for t in value]
