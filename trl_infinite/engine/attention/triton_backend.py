"""Triton paged attention backend ("triton"): shared-prefix (cascade) decode kernels, torch reference otherwise.

What runs where:
- decode forwards (every segment has one query token): `_prefix_kernel` once per group of segments sharing a
  prompt, then `_suffix_kernel` once per segment, merged by log-sum-exp (see `triton_kernels`). The kernels
  implement every `LayerAttention` feature: sliding windows and chunked attention (per-query lowest visible
  position), logit soft-capping, attention sinks, MQA / GQA, and keys wider than values (MLA);
- multi-token forwards (prompt prefill, recompute, speculative verification with drafts): the torch reference
  `torch_paged_attention` (prefill is compute-bound and runs once per prompt; the decode step is where the
  memory-bound time goes).

The launch grids depend on shapes only (rows, KV heads, the device's SM count), never on device data, so a decode
step is capturable in a CUDA graph: split-K programs past a row's context simply write an empty partial.

Importing this module registers the backend, so `EngineConfig.attention_backend="auto"` picks it on CUDA. The kernels
need CUDA tensors, or `TRITON_INTERPRET=1` set before `triton` is imported (Triton's CPU interpreter, for tests).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import triton

from .backends import register_attention_backend
from .layer import LayerAttention
from .metadata import PagedAttentionMetadata, with_context
from .torch_backend import torch_paged_attention
from .triton_kernels import _merge_kernel, _prefix_kernel, _suffix_kernel

BLOCK_M_PREFIX = 64  # query rows (samples x GQA heads) per prefix tile
BLOCK_N = 32  # KV positions per tile
MAX_PREFIX_SPLITS = 4  # programs sharing the row tiles of one large group
MAX_SUFFIX_SPLITS = 16  # split-K of long own contexts when there are too few (segment, KV head) programs


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else False


def cascade_plan(meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of segments that share one prompt, without a host sync.

    Returns `order` [S] (segments sorted by group, stable) and `run_len` [S]: at sorted position i, the number of
    segments in the run starting there, 0 where no run starts. A run is a maximal stretch of sorted segments with the
    same `seg_group`, `prompt_lens` and `prefix_table` row (so a caller that leaves every `group_index` at 0 still
    gets correct, just unshared, prefixes). Computed once per forward by `prepare_cascade`."""
    order = torch.argsort(meta.seg_group, stable=True)
    group, plen, table = meta.seg_group[order], meta.prompt_lens[order], meta.prefix_table[order]
    starts = torch.ones_like(group, dtype=torch.bool)
    if group.numel() > 1:
        same = (group[1:] == group[:-1]) & (plen[1:] == plen[:-1]) & (table[1:] == table[:-1]).all(1)
        starts[1:] = ~same
    run_id = torch.cumsum(starts.long(), 0) - 1
    counts = torch.zeros_like(run_id).scatter_add_(0, run_id, torch.ones_like(run_id))
    run_len = torch.where(starts, counts[run_id], torch.zeros_like(run_id))
    return order.contiguous(), run_len.contiguous()


def prepare_cascade(meta: PagedAttentionMetadata, mask_keys: tuple) -> PagedAttentionMetadata:
    """Once per forward: the cascade plan of a decode forward, the torch reference's context plan otherwise."""
    if meta.is_decode:
        return replace(meta, cascade=cascade_plan(meta))
    return with_context(meta, mask_keys)


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not (query.is_cuda or _interpreting()):
        raise RuntimeError(
            "attention_backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton); "
            "use attention_backend='torch' or 'auto' on this device."
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise RuntimeError("triton paged attention needs unit-stride head dims for the query and the K/V caches.")


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere)."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def suffix_splits(num_seg: int, num_kv_heads: int, sms: int) -> int:
    """Power-of-two split-K factor of the suffix kernel: enough programs for about two waves over `sms`
    multiprocessors. A function of shapes only (no context length: that is device data), so graphs can capture it."""
    programs = num_seg * num_kv_heads
    want = min(MAX_SUFFIX_SPLITS, -(-2 * sms // programs))
    return 1 << (max(want, 1).bit_length() - 1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def triton_paged_attention(
    query: torch.Tensor,  # [T, H, Dk]
    k_cache: torch.Tensor,  # [num_slots, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]
    meta: PagedAttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:  # [T, H, Dv]
    """Backend entry point (same contract as `torch_paged_attention`)."""
    if not meta.is_decode:
        return torch_paged_attention(query, k_cache, v_cache, meta, layer)
    return cascade_decode_attention(query, k_cache, v_cache, meta, layer)


def cascade_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
    layer: LayerAttention,
) -> torch.Tensor:
    """Decode attention (one query token per segment) with the prompt part shared across each group."""
    _check(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim_k = query.shape
    num_kv_heads, head_dim_v = k_cache.shape[1], v_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads.")
    gqa = num_heads // num_kv_heads
    num_seg = meta.prompt_lens.shape[0]
    query = query.to(k_cache.dtype)
    order, run_len = meta.cascade
    f32 = dict(dtype=torch.float32, device=query.device)
    o_pre = torch.empty(num_tokens, num_heads, head_dim_v, **f32)
    lse_pre = torch.empty(num_tokens, num_heads, **f32)
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=query.dtype, device=query.device)
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    dims = dict(HEAD_DIM_K=head_dim_k, BLOCK_DK=max(16, triton.next_power_of_2(head_dim_k)), HEAD_DIM_V=head_dim_v,
                BLOCK_DV=block_dv)
    common = dict(**dims, GQA=gqa, PAGE=meta.block_size, BLOCK_N=BLOCK_N, PRECISION=_precision(query.dtype),
                  UPCAST=_interpreting() and query.dtype == torch.bfloat16, SOFTCAP=layer.softcap is not None,
                  HAS_WINDOW=bool(layer.sliding_window), HAS_CHUNK=bool(layer.chunk_size))
    features = (float(layer.scale), float(layer.softcap or 0.0), int(layer.sliding_window or 0),
                int(layer.chunk_size or 0))
    kv_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    sinks = layer.sinks.float().contiguous() if layer.sinks is not None else lse_pre  # placeholder when absent
    row_splits = min(MAX_PREFIX_SPLITS, math.ceil(num_seg * gqa / BLOCK_M_PREFIX))
    _prefix_kernel[(num_seg, num_kv_heads, row_splits)](
        query, k_cache, v_cache, o_pre, lse_pre, sinks,
        order, run_len, meta.q_start, meta.q_pos, meta.prompt_lens, meta.prefix_table,
        query.stride(0), query.stride(1), *kv_strides,
        o_pre.stride(0), o_pre.stride(1), lse_pre.stride(0), meta.prefix_table.stride(0),
        *features, BLOCK_M=BLOCK_M_PREFIX, HAS_SINKS=layer.sinks is not None, **common,
    )
    splits = suffix_splits(num_seg, num_kv_heads, device_sms(query.device))
    part_o, part_lse = o_pre, lse_pre  # unused when splits == 1
    if splits > 1:
        part_o = torch.empty(num_tokens, num_heads, splits, head_dim_v, **f32)
        part_lse = torch.empty(num_tokens, num_heads, splits, **f32)
    _suffix_kernel[(num_seg, num_kv_heads, splits)](
        query, k_cache, v_cache, o_pre, lse_pre, out, part_o, part_lse,
        meta.q_start, meta.q_pos, meta.prompt_lens, meta.suffix_table,
        query.stride(0), query.stride(1), *kv_strides,
        o_pre.stride(0), o_pre.stride(1), lse_pre.stride(0), out.stride(0), out.stride(1),
        max(meta.suffix_table.stride(0), 1),
        *features, BLOCK_M=max(16, triton.next_power_of_2(gqa)), SPLITS=splits, **common,
    )
    if splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
            SPLITS=splits,
        )
    return out


register_attention_backend("triton", triton_paged_attention, prepare_cascade, gathers_columns=False)
