"""Triton paged attention backend ("triton"): shared-prefix (cascade) decode kernels, torch reference otherwise.

What runs where:
- decode forwards (every segment has one query token): `_prefix_kernel` once per group of segments sharing a
  prompt and per KV split of that prompt (flash-decoding style), then `_suffix_kernel` once per segment (and tile
  of its GQA heads, split over its own tokens when programs are few), merged by log-sum-exp (see
  `triton_kernels`). The kernels implement every `LayerAttention` feature: sliding windows and chunked attention
  (per-query lowest visible position), logit soft-capping, attention sinks, MQA / GQA, and keys wider than values
  (MLA, up to 576 / 512);
- multi-token forwards (prompt prefill, recompute, speculative verification with drafts): the torch reference
  `torch_paged_attention` (prefill is compute-bound and runs once per prompt; the decode step is where the
  memory-bound time goes).

The decode path runs as one `torch.library` custom op (`triton_op`: the metadata and layer settings flattened into
tensors and scalars), so a compiled decode step traces it as a black box; its body, `launch_cascade`, is never traced.

The launch grids depend on shapes only (rows, KV heads, the device's SM count, the table widths), never on device
data, so a decode step is capturable in a CUDA graph: split programs past a row's context simply write an empty
partial. Tiles, warps and pipeline stages come from `triton_tiles` (autotuned among its candidates on CUDA), the
dot products' dtype and precision from the pool dtype, autocast and torch's float32 matmul precision
(`triton_tiles.dot_mode`).

Importing this module registers the backend, so `EngineConfig.attention_backend="auto"` picks it on CUDA. The kernels
need CUDA tensors, or `TRITON_INTERPRET=1` set before `triton` is imported (Triton's CPU interpreter, for tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch
import triton

from trl_infinite.engine.attention import triton_tiles as tiles
from trl_infinite.engine.attention.backends import register_attention_backend
from trl_infinite.engine.attention.layer import LayerAttention
from trl_infinite.engine.attention.metadata import PagedAttentionMetadata, with_context
from trl_infinite.engine.attention.torch_backend import torch_paged_attention
from trl_infinite.engine.attention.triton_kernels import _merge_kernel, _prefix_kernel, _suffix_kernel
from trl_infinite.engine.attention.triton_op import AUTOCAST_DTYPES, autocast_code, cascade_decode, set_body
from trl_infinite.engine.attention.triton_tiles import prefix_splits, suffix_splits  # (tests patch them here)

# on CUDA, time the tile candidates on each configuration's first call (off: the first candidate, as
# TRL_INFINITE_TRITON_AUTOTUNE=0 sets it: benchmarks/gpu_suite.sh checks the kernels without the tuning time)
AUTOTUNE = os.environ.get("TRL_INFINITE_TRITON_AUTOTUNE", "1") != "0"


def _interpret_flag() -> bool:
    """Whether Triton runs kernels in its CPU interpreter. Decided when `triton.jit` decorates a kernel (at the import
    of `triton_kernels`), so read once, at import: it never changes afterwards."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETING = _interpret_flag()


def _interpreting() -> bool:
    return INTERPRETING


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


@functools.cache
def _tuned(kernel, candidates: tuple[tiles.Tiles, ...]):
    """`kernel` autotuned over `candidates` (keyed on the constexprs that shape the work; dtypes are in the key)."""
    configs = [triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps,
                             num_stages=t.num_stages) for t in candidates]
    key = ["row_class", "HEAD_DIM_K", "HEAD_DIM_V", "GQA", "NUM_HEADS", "KV_SPLITS", "PREFIX_SPLITS", "SPLITS",
           "SOFTCAP", "HAS_WINDOW", "HAS_CHUNK", "HAS_SINKS", "CAST", "PRECISION"]
    return triton.autotune(configs=configs, key=key)(kernel)


def _launch(kernel, grid, candidates: list[tiles.Tiles], device: torch.device, *args, **kwargs) -> None:
    if AUTOTUNE and device.type == "cuda" and not _interpreting() and len(candidates) > 1:
        _tuned(kernel, tuple(candidates))[grid](*args, **kwargs)
        return
    t = candidates[0]
    kernel[grid](*args, **kwargs, BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
                 num_stages=t.num_stages)


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
    layer: LayerAttention, kv_splits: int | None = None, splits: int | None = None,
) -> torch.Tensor:
    """Decode attention (one query token per segment) with the prompt part shared across each group: the custom op
    `triton_op.triton_cascade_decode` (opaque to `torch.compile`), which runs `launch_cascade`.
    `kv_splits` / `splits` override the prompt's KV splits and the own tokens' split-K (tests)."""
    return cascade_decode(query, k_cache, v_cache, meta, layer, kv_splits or 0, splits or 0)


def _dot_mode(pool_dtype: torch.dtype, device_type: str, autocast: int) -> tuple[int, str]:
    """`triton_tiles.dot_mode` under the autocast state the caller traced (`triton_op.autocast_code`), which the op's
    body does not see inside a compiled graph."""
    if autocast == autocast_code(device_type):  # eager calls, and autocast entered outside a compiled step
        return tiles.dot_mode(pool_dtype, device_type, _interpreting())
    with torch.autocast(device_type, dtype=AUTOCAST_DTYPES[autocast], enabled=autocast != 0):
        return tiles.dot_mode(pool_dtype, device_type, _interpreting())


def launch_cascade(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, order: torch.Tensor, run_len: torch.Tensor,
    q_start: torch.Tensor, q_pos: torch.Tensor, prompt_lens: torch.Tensor, prefix_table: torch.Tensor,
    suffix_table: torch.Tensor, sinks: torch.Tensor | None, block_size: int, scale: float, softcap: float | None,
    sliding_window: int, chunk_size: int, autocast: int, kv_splits: int, splits: int, num_groups: int,
) -> torch.Tensor:
    """The kernel launches of `cascade_decode_attention` (the op's body, run eagerly; see `triton_op` for the
    arguments)."""
    _check(query, k_cache, v_cache)
    if sinks is not None and sinks.device != query.device:
        raise ValueError(f"the attention sinks are on {sinks.device}, the query on {query.device}: the Triton kernels "
                         "read both on the query's device.")
    num_tokens, num_heads, head_dim_k = query.shape
    num_kv_heads, head_dim_v = k_cache.shape[1], v_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads.")
    gqa = num_heads // num_kv_heads
    num_seg = prompt_lens.shape[0]
    device = query.device
    query = query.to(k_cache.dtype)
    sms = device_sms(device)
    block_dk, dk_chunks = tiles.key_chunks(head_dim_k)
    block_dv = tiles.value_block(head_dim_v)
    cast, precision = _dot_mode(k_cache.dtype, device.type, autocast)
    common = dict(HEAD_DIM_K=head_dim_k, BLOCK_DK=block_dk, DK_CHUNKS=dk_chunks, HEAD_DIM_V=head_dim_v,
                  BLOCK_DV=block_dv, NUM_HEADS=num_heads, GQA=gqa, PAGE=block_size, PRECISION=precision,
                  CAST=cast, SOFTCAP=softcap is not None, HAS_WINDOW=bool(sliding_window),
                  HAS_CHUNK=bool(chunk_size))
    features = (float(scale), float(softcap or 0.0), int(sliding_window), int(chunk_size), tiles.row_class(num_seg))
    kv_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    f32 = dict(dtype=torch.float32, device=device)
    prompt_capacity = prefix_table.shape[1] * block_size
    kv_splits = kv_splits or prefix_splits(num_seg, num_kv_heads, num_heads, head_dim_v, prompt_capacity, sms,
                                           num_groups or None)
    pre_o = torch.empty(num_tokens, num_heads, kv_splits, head_dim_v, **f32)
    pre_lse = torch.empty(num_tokens, num_heads, kv_splits, **f32)
    has_sinks = sinks is not None
    sinks = sinks.float().contiguous() if has_sinks else pre_lse  # placeholder when absent
    _launch(_prefix_kernel, (num_seg, num_kv_heads, kv_splits), tiles.prefix_tiles(head_dim_k, head_dim_v), device,
            query, k_cache, v_cache, pre_o, pre_lse, sinks,
            order, run_len, q_start, q_pos, prompt_lens, prefix_table,
            query.stride(0), query.stride(1), *kv_strides, prefix_table.stride(0),
            *features, KV_SPLITS=kv_splits, HAS_SINKS=has_sinks, **common)
    _, head_tiles = tiles.suffix_rows(gqa, head_dim_v)
    splits = splits or suffix_splits(num_seg, num_kv_heads, sms, head_tiles)
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=query.dtype, device=device)
    part_o, part_lse = pre_o, pre_lse  # unused when splits == 1
    if splits > 1:
        part_o = torch.empty(num_tokens, num_heads, splits, head_dim_v, **f32)
        part_lse = torch.empty(num_tokens, num_heads, splits, **f32)
    _launch(_suffix_kernel, (num_seg, num_kv_heads * head_tiles, splits),
            tiles.suffix_tiles(gqa, head_dim_k, head_dim_v), device,
            query, k_cache, v_cache, pre_o, pre_lse, out, part_o, part_lse,
            q_start, q_pos, prompt_lens, suffix_table,
            query.stride(0), query.stride(1), *kv_strides, out.stride(0), out.stride(1),
            max(suffix_table.stride(0), 1),
            *features, HEAD_TILES=head_tiles, PREFIX_SPLITS=kv_splits, SPLITS=splits, **common)
    if splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
            SPLITS=splits,
        )
    return out


set_body(launch_cascade)
register_attention_backend("triton", triton_paged_attention, prepare_cascade, gathers_columns=False)
