"""Paged attention backends by name (`EngineConfig.attention_backend`): "torch" (the reference) and "triton"
(cascade decode kernels, `triton_backend.py`, imported only when first used)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_infinite.engine.attention.metadata import MaskKey, PagedAttentionMetadata, with_context
from trl_infinite.engine.attention.torch_backend import torch_paged_attention
from trl_infinite.engine.config.registry import ATTENTION_BACKENDS


@dataclass(frozen=True)
class AttentionBackend:
    """`prepare` once per forward, `attend` once per layer (see `attention/__init__`). `gathers_columns`: the
    work grows with the block tables' width (a gather of every column), not with each row's context length."""

    attend: Callable
    prepare: Callable[[PagedAttentionMetadata, tuple[MaskKey, ...]], PagedAttentionMetadata] = with_context
    gathers_columns: bool = True


def register_attention_backend(name: str, attend: Callable, prepare: Callable = with_context,
                               gathers_columns: bool = True, replace: bool = False) -> None:
    """Make `attend` (with its once-per-forward `prepare`) selectable as `EngineConfig.attention_backend=name`."""
    ATTENTION_BACKENDS.register(name, replace=replace)(AttentionBackend(attend, prepare, gathers_columns))


register_attention_backend("torch", torch_paged_attention)


def resolve_backend(name: str, device: torch.device) -> AttentionBackend:
    """"auto" picks Triton on CUDA when it is importable, the torch reference otherwise."""
    if name == "auto":
        if device.type == "cuda":
            try:
                return ATTENTION_BACKENDS.get_or_raise("triton")
            except ImportError:
                pass
        name = "torch"
    return ATTENTION_BACKENDS.get_or_raise(name)
