"""The Triton decode attention as one `torch.library` custom op, so a compiled decode step traces it as a black box.

Dynamo cannot trace what the kernel launch does on the host (Triton's knobs are read through a C builtin, the
autotuner is a Python object built on first use, the launch itself), so under `torch.compile(fullgraph=True)` the
call must be opaque: `cascade_decode` flattens the per-forward metadata (`PagedAttentionMetadata`) and the layer's
settings (`LayerAttention`) into tensors and plain scalars and calls the op `trl_infinite::triton_cascade_decode`,
whose body (`triton_backend.launch_cascade`) runs eagerly, also inside a compiled graph (where it builds and caches
the autotuners on its first call per configuration). Its fake implementation gives the output's shape and dtype,
all a trace needs. The op mutates none of its inputs: it writes only the output and its own partial buffers. Outside
a trace the body is called directly (the op's dispatch costs tens of microseconds per layer on the host).

The autocast state is read here, in the traced caller (Dynamo tracks it and guards on it), and passed to the body:
inside a compiled graph the body would not see an autocast region the model enters during the forward, which
decides the kernels' dot dtype (`triton_tiles.dot_mode`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trl_infinite.engine.attention.layer import LayerAttention
from trl_infinite.engine.attention.metadata import PagedAttentionMetadata

OP_NAME = "trl_infinite::triton_cascade_decode"
AUTOCAST_DTYPES = (None, torch.bfloat16, torch.float16)  # the op's `autocast` argument indexes this


def autocast_code(device_type: str) -> int:
    """The autocast state the kernels' dot products follow, as the op's `autocast` argument (0: off, or a dtype the
    kernels do not cast to)."""
    if not torch.is_autocast_enabled(device_type):
        return 0
    dtype = torch.get_autocast_dtype(device_type)
    return AUTOCAST_DTYPES.index(dtype) if dtype in AUTOCAST_DTYPES else 0


@torch.library.custom_op(OP_NAME, mutates_args=())
def triton_cascade_decode(
    query: torch.Tensor,  # [T, H, Dk] (any strides, unit-stride head dim)
    k_cache: torch.Tensor,  # [num_slots, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]
    order: torch.Tensor,  # [S] the cascade plan (`triton_backend.cascade_plan`)
    run_len: torch.Tensor,  # [S]
    q_start: torch.Tensor,  # [S]
    q_pos: torch.Tensor,  # [T]
    prompt_lens: torch.Tensor,  # [S]
    prefix_table: torch.Tensor,  # [S, Wp]
    suffix_table: torch.Tensor,  # [S, Ws]
    sinks: torch.Tensor | None,  # [H]
    block_size: int,
    scale: float,
    softcap: float | None,
    sliding_window: int,  # 0: none
    chunk_size: int,  # 0: none
    autocast: int,  # index into AUTOCAST_DTYPES
    kv_splits: int,  # 0: the heuristic's (`triton_tiles.prefix_splits`)
    splits: int,  # 0: the heuristic's (`triton_tiles.suffix_splits`)
    num_groups: int,  # the rows' distinct prompts (or a bucket above), 0: unknown (`PagedAttentionMetadata.num_groups`)
) -> torch.Tensor:  # [T, H, Dv] in the pool's dtype
    return _body(query, k_cache, v_cache, order, run_len, q_start, q_pos, prompt_lens, prefix_table, suffix_table,
                 sinks, block_size, scale, softcap, sliding_window, chunk_size, autocast, kv_splits, splits,
                 num_groups)


_launch: Callable[..., torch.Tensor] | None = None  # the body: `triton_backend.launch_cascade` (`set_body`)


def set_body(launch: Callable[..., torch.Tensor]) -> None:
    """The op's body, the kernel launches (set by `triton_backend` when it is imported: this module imports no
    backend, so the two form no cycle)."""
    global _launch
    _launch = launch


def _body(*args) -> torch.Tensor:
    if _launch is None:
        raise RuntimeError("the Triton decode op has no body: import trl_infinite.engine.attention.triton_backend.")
    return _launch(*args)  # (run eagerly: never traced)


@triton_cascade_decode.register_fake
def _(query, k_cache, v_cache, order, run_len, q_start, q_pos, prompt_lens, prefix_table, suffix_table, sinks,
      block_size, scale, softcap, sliding_window, chunk_size, autocast, kv_splits, splits, num_groups):
    return query.new_empty((query.shape[0], query.shape[1], v_cache.shape[2]), dtype=k_cache.dtype)


def cascade_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
                   layer: LayerAttention, kv_splits: int = 0, splits: int = 0) -> torch.Tensor:
    """The op on one layer's call: the metadata and layer settings flattened (traceable; `meta.cascade` is set by
    `triton_backend.prepare_cascade`)."""
    if meta.cascade is None:
        raise RuntimeError("triton decode attention needs the cascade plan: prepare the metadata with "
                           "`triton_backend.prepare_cascade` first.")
    order, run_len = meta.cascade
    args = (query, k_cache, v_cache, order, run_len, meta.q_start, meta.q_pos, meta.prompt_lens, meta.prefix_table,
            meta.suffix_table, layer.sinks, meta.block_size, float(layer.scale),
            None if layer.softcap is None else float(layer.softcap), int(layer.sliding_window or 0),
            int(layer.chunk_size or 0), autocast_code(query.device.type), kv_splits, splits, meta.num_groups or 0)
    if torch.compiler.is_compiling():
        return triton_cascade_decode(*args)
    return _body(*args)  # eager: the same body without the dispatcher's Python round trip (tens of us per layer)
