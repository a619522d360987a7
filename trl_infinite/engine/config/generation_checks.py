"""Checks of `SamplingParams.generation_kwargs` that `generate` would only fail on mid-call (or not at all).

`transformers.GenerationConfig` validates its values' ranges and its logits processors their own arguments, but
token ids are judged against the vocabulary only when a processor indexes the scores (`forced_eos_token_id` is an
`IndexError` at the last step, an out-of-vocabulary `suppress_tokens` id is silently ignored), and some keys need a
companion that `generate` assumes (`exponential_decay_length_penalty` without an EOS id fails inside the processor).
The engine checks both before any work: `check_generation_values` when `SamplingParams` is built (types and
companions), `check_generation_ids` when `generate` starts (every id within the model's vocabulary, which only the
engine knows). Each raises `ValueError` naming the key.
"""

from __future__ import annotations

import numbers

from trl_infinite.engine.config.inputs import is_int as _is_id

# keys holding token ids a logits processor indexes the scores with: a single id, a list of ids, a list of id lists,
# or `sequence_bias`'s (ids, bias) pairs (`pad_token_id` / `bos_token_id` only pad or start `generate`'s batches, and
# some models' generation configs set them outside the vocabulary: left as they are)
SINGLE_ID_KEYS = ("forced_bos_token_id",)
ID_LIST_KEYS = ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens")
ID_LISTS_KEYS = ("bad_words_ids",)
# keys that change nothing (or fail) without an EOS id: their companion
NEEDS_EOS = ("exponential_decay_length_penalty",)


def _ids_of(key: str, value) -> list:
    """Every token id `value` holds for `key` (not checked yet), as given."""
    if key in SINGLE_ID_KEYS:
        return [value]
    if key in ID_LIST_KEYS:
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if key in ID_LISTS_KEYS:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"`generation_kwargs['{key}']` must be a list of token-id lists, got "
                             f"{type(value).__name__} {value!r:.60}.")
        out = []
        for row in value:
            if not isinstance(row, (list, tuple)):
                raise ValueError(f"`generation_kwargs['{key}']` must be a list of token-id lists, got the entry "
                                 f"{row!r:.60}.")
            out.extend(row)
        return out
    if key == "sequence_bias":
        seqs = list(value) if isinstance(value, dict) else [p[0] for p in value if isinstance(p, (list, tuple)) and p]
        return [t for s in seqs if isinstance(s, (list, tuple)) for t in s]
    return []


def check_generation_values(kwargs: dict, eos_token_ids: list[int]) -> None:
    """Types of the token-id keys (ints, not bools, floats or strings; >= 0) and the companions `generate` assumes."""
    for key, value in kwargs.items():
        if value is None:
            continue
        for t in _ids_of(key, value):
            if not _is_id(t) or t < 0:
                raise ValueError(f"`generation_kwargs['{key}']` must hold int token ids >= 0, got "
                                 f"{type(t).__name__} {t!r:.40}.")
    for key in NEEDS_EOS:
        if kwargs.get(key) is not None and not eos_token_ids:
            raise ValueError(f"`generation_kwargs['{key}']` needs an EOS id (`eos_token_ids`): it raises the EOS "
                             "logit, and `generate` fails without one.")
    decay = kwargs.get("exponential_decay_length_penalty")
    if decay is not None and not (isinstance(decay, (list, tuple)) and len(decay) == 2 and _is_id(decay[0])
                                  and isinstance(decay[1], numbers.Real) and not isinstance(decay[1], bool)):
        raise ValueError("`generation_kwargs['exponential_decay_length_penalty']` must be a pair (start_index: int, "
                         f"decay_factor: float), got {decay!r:.60}.")


def check_generation_ids(kwargs: dict, vocab_size: int) -> None:
    """Every token id of `kwargs` (typed by `check_generation_values`) lies in [0, vocab_size)."""
    for key, value in kwargs.items():
        if value is None:
            continue
        bad = [t for t in _ids_of(key, value) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"`generation_kwargs['{key}']` holds token id {bad[0]}, outside the model's vocabulary "
                             f"[0, {vocab_size}).")
