"""Launch configurations of the Triton decode kernels: tiles, warps, pipeline stages, split counts, dot precision.

Everything here is a function of shapes, dtypes and host ints only (never of device data; the prompt splits also of
the batch's group count, bucketed, which the static decode step keys its graphs on), so a CUDA graph replays the
launch it captured. The tile candidates per head-dim class are the ones `triton_compile` compiles for sm_90 and sm_80
in CI (registers, shared memory and spills checked against the hardware limits; every candidate is spill-free
under Triton 3.6 and 3.9, whose register allocations differ by up to ~40 per thread): the first of each list is what
runs without autotuning (Triton's CPU interpreter); on CUDA `triton.autotune` times the candidates on the first call
of each (head dims, GQA, splits, dtype) and keeps the fastest (in the warm-up that precedes a graph capture).

Register budget behind the lists: the fp32 accumulator holds BLOCK_M x BLOCK_DV values and the score tile
BLOCK_M x BLOCK_N, spread over 32 x num_warps threads; both together stay under ~96 registers per thread, so the
row tile shrinks as the value width grows (64 rows up to Dv 128, 32 at 256, 16 at MLA's 512), and the prompt kernel
runs 8 warps by default from Dv 256 (with 4, Triton 3.6 spills there at 255 registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PREFIX_SPLITS = 16  # KV splits of a shared prompt
MIN_SPLIT_TOKENS = 256  # a prompt split covers at least this many positions (fewer: not worth a program)
PREFIX_GROUP_ESTIMATE = 16  # samples per prompt assumed for the prompt splits when the group count is unknown
MAX_SUFFIX_SPLITS = 16  # split-K of long own contexts when there are too few (segment, KV head) programs
MAX_PARTIAL_BYTES = 64 << 20  # fp32 partial outputs of one layer's split prompt: a cap on the splits


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: rows per tile, KV positions per tile, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def key_chunks(head_dim_k: int) -> tuple[int, int]:
    """(BLOCK_DK, DK_CHUNKS): keys up to 128 wide in one power-of-two chunk (padded), wider ones in equal chunks
    of 128, 64, 32 or 16 columns (576 = 9 x 64), so nothing is padded to the next power of two."""
    if head_dim_k <= 128:
        return max(16, 1 << (head_dim_k - 1).bit_length()), 1
    for block in (128, 64, 32, 16):
        if head_dim_k % block == 0:
            return block, head_dim_k // block
    return 64, -(-head_dim_k // 64)


def value_block(head_dim_v: int) -> int:
    return max(16, 1 << (head_dim_v - 1).bit_length())


def prefix_tiles(head_dim_k: int, head_dim_v: int) -> list[Tiles]:
    """Candidates of `_prefix_kernel` (rows = samples x GQA heads of a group)."""
    block_dv = value_block(head_dim_v)
    if block_dv <= 64:
        return [Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 3), Tiles(64, 32, 8, 2)]
    if block_dv <= 128:
        return [Tiles(32, 64, 4, 3), Tiles(32, 64, 8, 3), Tiles(32, 32, 4, 2)]
    if block_dv <= 256:
        return [Tiles(32, 32, 8, 2), Tiles(16, 64, 8, 2), Tiles(16, 32, 4, 2)]
    return [Tiles(16, 32, 8, 2), Tiles(16, 64, 8, 2), Tiles(16, 16, 4, 2)]


def suffix_rows(gqa: int, head_dim_v: int) -> tuple[int, int]:
    """(BLOCK_M, HEAD_TILES) of `_suffix_kernel`: the GQA heads of one KV head in tiles of at most the row cap."""
    block_dv = value_block(head_dim_v)  # the row cap: 64 up to Dv 128, 32 at 256, 16 beyond (module docstring)
    block_m = min(max(16, 1 << (gqa - 1).bit_length()), 64 if block_dv <= 128 else 32 if block_dv <= 256 else 16)
    return block_m, -(-gqa // block_m)


def suffix_tiles(gqa: int, head_dim_k: int, head_dim_v: int) -> list[Tiles]:
    """Candidates of `_suffix_kernel` (rows = the GQA heads of one KV head, `suffix_rows`)."""
    block_m, _ = suffix_rows(gqa, head_dim_v)
    if value_block(head_dim_v) >= 512:
        return [Tiles(block_m, 32, 4, 2), Tiles(block_m, 64, 8, 2), Tiles(block_m, 16, 4, 3)]
    return [Tiles(block_m, 32, 4, 2), Tiles(block_m, 64, 4, 2), Tiles(block_m, 16, 4, 3)]


def row_class(num_seg: int) -> int:
    """Size class of a decode batch for the autotuner's key: 0 up to 8 rows, 1 up to 64, 2 beyond."""
    return 0 if num_seg <= 8 else 1 if num_seg <= 64 else 2


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def group_bucket(num_groups: int) -> int:
    """The number of distinct prompts (groups) of a decode batch rounded up to a power of two: the host int the
    prompt splits are sized by, and part of the static decode step's graph / compile key (so a captured graph
    replays the split count it captured, and a few buckets cover every batch)."""
    return 1 << (max(num_groups, 1) - 1).bit_length()


def prefix_splits(num_seg: int, num_kv_heads: int, num_heads: int, head_dim_v: int, prompt_capacity: int,
                  sms: int, num_groups: int | None = None) -> int:
    """Power-of-two KV splits of the shared prompts: enough programs for about two waves over `sms` with one
    program per (group, KV head, split), at least `MIN_SPLIT_TOKENS` of the table's prompt capacity per split, partial
    outputs under `MAX_PARTIAL_BYTES`. `num_groups`: the batch's distinct prompts (host int, bucketed by
    `group_bucket`); None: unknown, groups of `PREFIX_GROUP_ESTIMATE` samples assumed."""
    groups = group_bucket(num_groups) if num_groups is not None else -(-num_seg // PREFIX_GROUP_ESTIMATE)
    want = min(MAX_PREFIX_SPLITS, -(-2 * sms // (num_kv_heads * groups)), -(-prompt_capacity // MIN_SPLIT_TOKENS))
    memory = MAX_PARTIAL_BYTES // max(num_seg * num_heads * head_dim_v * 4, 1)
    return _pow2_floor(max(1, min(want, memory)))


def suffix_splits(num_seg: int, num_kv_heads: int, sms: int, head_tiles: int = 1) -> int:
    """Power-of-two split-K factor of the suffix kernel: enough programs for about two waves over `sms`
    multiprocessors. A function of shapes only (no context length: that is device data), so graphs can capture it."""
    programs = num_seg * num_kv_heads * head_tiles
    want = min(MAX_SUFFIX_SPLITS, -(-2 * sms // programs))
    return _pow2_floor(want)


def dot_mode(pool_dtype: torch.dtype, device_type: str, interpreting: bool) -> tuple[int, str]:
    """(CAST, PRECISION) of the kernels' dot products (see `triton_kernels`):
    - a bf16 / fp16 pool: its own dtype, on tensor cores;
    - an fp32 pool under autocast (bf16 / fp16) on this device: the autocast dtype, on tensor cores: the rounding the
      model's own attention matmuls have under autocast;
    - an fp32 pool otherwise: fp32 with the precision `torch.get_float32_matmul_precision()` gives torch's matmuls
      ('highest': 'ieee'; 'high' / 'medium': 'tf32', tensor cores);
    - Triton's CPU interpreter computes bf16 dots wrongly: fp32 'ieee' there."""
    if interpreting and pool_dtype == torch.bfloat16:
        return 3, "ieee"
    if pool_dtype in (torch.bfloat16, torch.float16):
        return 0, "tf32"  # (precision is ignored for 16-bit inputs)
    if torch.is_autocast_enabled(device_type) and not interpreting:
        autocast = torch.get_autocast_dtype(device_type)
        if autocast in (torch.bfloat16, torch.float16):
            return (1 if autocast == torch.bfloat16 else 2), "tf32"
    return 0, ("ieee" if torch.get_float32_matmul_precision() == "highest" or interpreting else "tf32")

