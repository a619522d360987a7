"""The autocast state a forward runs under, read explicitly from torch (the engine takes no autocast setting).

Under `torch.autocast(device_type, dtype)` the model's matmuls and attention (`scaled_dot_product_attention`,
`matmul`: ops on autocast's lower-precision list) cast their inputs to `dtype`, while element-wise ops keep float32;
so the keys and values an attention layer receives may be float32 (promoted by a float32 norm weight or RoPE table)
or `dtype`, but the attention itself consumes them in `dtype`. The engine therefore stores K/V in the autocast dtype
and hands every attention backend query, keys and values in it (`attention.paged_attention_forward`): the same
rounding as the model's own attention, and half the KV memory of float32 weights under bf16 autocast.

Why detected rather than configured: the autocast a forward runs under is decided by the caller (an enclosing
`torch.autocast`) or by the model itself (accelerate's mixed precision wraps the prepared model's `forward` in
`torch.autocast`, which is how TRL's `bf16=True` / `fp16=True` reach every forward, `generate`'s included). A
configuration field could only repeat that state, or contradict it, and a contradiction could not be obeyed (the
wrapper re-enters autocast inside `forward` whatever the engine sets outside). So the support probe reads the state
inside the model's own forward (`probe.py`), and the engine records the enclosing state at construction and requires
the same one at every `generate` (`RolloutEngine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matmul / attention inputs to on `device_type` at this point, None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def describe(dtype: torch.dtype | None) -> str:
    """'under bfloat16 autocast' / 'without autocast' (for messages)."""
    return "without autocast" if dtype is None else f"under {str(dtype).removeprefix('torch.')} autocast"


@contextlib.contextmanager
def uncached_casts(device_type: str) -> Iterator[None]:
    """The enclosing autocast state with autocast's cast cache off (every cast a dispatched op), for the engine's
    forwards. Autocast caches a float32 leaf Parameter's cast for the rest of its outermost region, and torch 2.6 does
    so under `inference_mode` too: an engine call in a region that spans an in-place weight update (an optimizer
    step) read the old weights' casts, and a CUDA graph captured after an eager step that cached them replayed the
    cached tensors, stale after the update and freed when the region ends (tests/engine/runner/test_weight_copy.py,
    CI's oldest job). Without the cache each step casts the weights it reads, as torch 2.13's `inference_mode` does."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield
