"""C++ decode attention for CPU: one library call per layer that reads the pool through the tables.

On CPU a decode step is host-bound at small widths, and the torch backend's decode attention costs, per layer,
two CPU flash-attention calls (each group's prompt, then the rows' own tokens) plus the gathers, masks and
log-sum-exp merge around them (`torch_backend._cascade_decode`); each flash call pays a fixed cost per (row, head).
This kernel does the whole decode attention of a layer in one call: for row `n` at position `pos` (its input token,
already written to the pool) the visible keys are positions `lo .. pos`, `lo` the lowest `layer.allowed` admits
(sliding window, chunk); position `p` lives in prefix block `prefix_table[n, p / B]` when `p < prompt_lens[n]`,
else in own block `suffix_table[n, (p - prompt_lens[n]) / B]`. Per (row, KV head), with the `g = H / Hkv` query
heads of that KV head:

    s[j, p] = scale * <q[j], k[p]>;   m[j] = max_p s[j, p];   out[j] = sum_p exp(s[j, p] - m[j]) v[p] / sum_p exp(...)

in float32. Keys are taken `T` at a time (T = the vector width) and transposed so that the products over the head
dimension run as vector FMAs across keys; values are accumulated in vector registers.

It is built with `torch.utils.cpp_extension.load_inline` when a CPU engine starts whose model passed the support
checks and has a layer the kernel serves (`serves`: float32 pool, no soft-capping or sinks, head dimensions that are
multiples of the vector width, known from the CPU's capability before building); the build takes about half a
minute once per machine and torch release and is cached on disk (`TORCH_EXTENSIONS_DIR`; `extensions.py`).
`EngineConfig.cpu_decode_kernel` (on by default) turns it off. It is registered as
`torch.ops.trl_infinite.paged_decode_attention`: eager forwards call it through the dispatcher, the compiled step
through inductor's C++ wrapper. `with_kernel` puts it in front of the torch
backend; every call it does not cover keeps the torch reference path. A failed build is logged once and changes
nothing but speed.

A 16-bit pool (16-bit weights, or float32 weights under autocast, `engine/runner/autocast.py`) keeps the torch path, which
computes in the 16-bit dtype as the model's own attention does (16-bit inputs and probabilities, 16-bit output);
this kernel would compute such a layer in float32, a different precision than the model's (under bf16 autocast on
a tiny Qwen3 its logits came out one bf16 step, 3.5e-3 relative, off the model's, and the engine was refused at the
float32 tolerance). A 16-bit variant is not written.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from trl_infinite.engine.attention.cpu_decode_source import SOURCE
from trl_infinite.engine.attention.extensions import load_extension
from trl_infinite.engine.attention.layer import LayerAttention, LayerSpec
from trl_infinite.engine.attention.metadata import PagedAttentionMetadata

logger = logging.getLogger(__name__)

_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


def vector_floats() -> int:
    """Floats per vector of the kernel as it is (or would be) built on this CPU, known without building it: the
    head dims it serves are multiples of it."""
    return 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8


# a constant of this CPU (read by `supports` inside compiled steps, where the call above would not trace)
VECTOR_FLOATS = vector_floats()


@functools.cache
def build() -> bool:
    """Compile and register the operator once per process (the build itself is cached on disk). False, with one
    warning, when it cannot be built (no compiler, no ninja, ...); the caller then keeps the torch path. Only a
    successful build puts the kernel in front of a backend (`with_kernel`)."""
    isa = torch.backends.cpu.get_cpu_capability()
    try:
        torch.ops.trl_infinite.paged_decode_attention  # noqa: B018  (registered by another copy of this module)
    except (AttributeError, RuntimeError):
        logger.info("Loading the CPU decode-attention kernel (built once per machine and torch release, about half "
                    "a minute).")
        try:
            load_extension(f"trl_infinite_cpu_decode_{isa.lower()}", cpp_sources=[SOURCE], is_python_module=False,
                           extra_cflags=["-O3", *_ISA_FLAGS.get(isa, [])])
        except Exception as err:  # compiler, headers or ninja missing, ...
            logger.warning("The CPU decode-attention kernel could not be built (%s); CPU decode steps use "
                           "the torch attention path instead.", err)
            return False

        @torch.library.register_fake("trl_infinite::paged_decode_attention")
        def _fake(query, k_cache, v_cache, prefix_table, suffix_table, prompt_lens, positions, block_size, scale,
                  window, chunk):
            return query.new_empty(query.shape[0], query.shape[1], v_cache.shape[2])

    return True


def _fits(dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
    """Float32, and head dims that are multiples of the build's vector width."""
    return dtype == torch.float32 and all(d % VECTOR_FLOATS == 0 for d in dims)


def serves(spec: LayerSpec, k_dim: int, v_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel would serve the decode attention of a layer with a pool of `dtype` (checked before any
    build: plain softmax, float32, head dims that are multiples of `vector_floats`)."""
    return not spec.needs_scores and _fits(dtype, (k_dim, v_dim))


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention) -> bool:
    """Whether the kernel covers this decode call: CPU, plain softmax, and `_fits` for every tensor. Reads only
    constants, so it traces under `torch.compile`."""
    return (query.device.type == "cpu" and not layer.needs_scores and query.dtype == k_cache.dtype == v_cache.dtype
            and _fits(query.dtype, (query.shape[-1], v_cache.shape[-1])))


def covers(layers: list[LayerSpec], k_dims: tuple[int, ...], v_dims: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether the kernel serves the decode attention of every layer of a model: `_fits` for its pool, and no layer
    with soft-capping or sinks (`LayerSpec.needs_scores`, from the support probe). The static decode step then needs
    no torch cascade plan (`StaticDecoder`)."""
    return not any(spec.needs_scores for spec in layers) and _fits(dtype, (*k_dims, *v_dims))


def paged_decode_attention(
    query: torch.Tensor,  # [S, H, Dk] one query per row
    k_cache: torch.Tensor,  # [num_slots, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]
    prefix_table: torch.Tensor,  # [S, Wp]
    suffix_table: torch.Tensor,  # [S, Ws]
    prompt_lens: torch.Tensor,  # [S]
    positions: torch.Tensor,  # [S]
    block_size: int,
    layer: LayerAttention,
) -> torch.Tensor:  # [S, H, Dv]
    """Decode attention of every row over its visible context in the pool (see the module docstring)."""
    return torch.ops.trl_infinite.paged_decode_attention(
        query, k_cache, v_cache, prefix_table, suffix_table, prompt_lens, positions, block_size, float(layer.scale),
        layer.sliding_window or 0, layer.chunk_size or 0)


def with_kernel(attend: Callable) -> Callable:
    """A backend's per-layer `attend` with this kernel in front: the decode calls it `supports` go to the kernel,
    every other call (prefill, verification, soft-capped or sink layers, bf16) to `attend`. Only once `build()` has
    returned True (the operator is registered)."""

    def attend_with_kernel(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, layer: LayerAttention) -> torch.Tensor:
        if meta.is_decode and supports(query, k_cache, v_cache, layer):
            return paged_decode_attention(query, k_cache, v_cache, meta.prefix_table, meta.suffix_table,
                                          meta.prompt_lens, meta.q_pos, meta.block_size, layer)
        return attend(query, k_cache, v_cache, meta, layer)

    return attend_with_kernel
