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

from trl_infinite.engine.attention.extensions import load_extension
from trl_infinite.engine.attention.layer import LayerAttention, LayerSpec
from trl_infinite.engine.attention.metadata import PagedAttentionMetadata

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

struct Shape {
  int64_t rows, heads, kv_heads, dk, dv, block_size, pcols, scols, window, chunk;
  int64_t k_slot, k_head, v_slot, v_head;
  float scale;
};

void decode(const Shape& s, const float* q, const float* k, const float* v, const int64_t* ptab, const int64_t* stab,
            const int64_t* plens, const int64_t* positions, float* out) {
  constexpr int64_t T = Vec::size();
  const int64_t g = s.heads / s.kv_heads;
  at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * s.dk), scores, tile(T * s.dk), tile_t(s.dk * T);
    std::vector<int64_t> slot;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / s.kv_heads, h = item % s.kv_heads, pos = positions[n], plen = plens[n];
      int64_t lo = 0;
      if (s.window > 0) lo = std::max<int64_t>(lo, pos - s.window + 1);
      if (s.chunk > 0) lo = std::max<int64_t>(lo, (pos / s.chunk) * s.chunk);
      const int64_t ctx = pos - lo + 1;  // >= 1: a row always sees its own input token
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < s.dk; ++d) qf[j * s.dk + d] = q[(n * s.heads + h * g + j) * s.dk + d] * s.scale;
      // pool slot of every visible position, one table read per block run
      slot.resize(ctx);
      for (int64_t c = 0; c < ctx;) {
        const int64_t p = lo + c;
        const bool in_prompt = p < plen;
        const int64_t rel = in_prompt ? p : p - plen, col = rel / s.block_size, off = rel - col * s.block_size;
        TORCH_CHECK(col < (in_prompt ? s.pcols : s.scols), "paged_decode_attention: block table too narrow");
        const int64_t base = (in_prompt ? ptab[n * s.pcols + col] : stab[n * s.scols + col]) * s.block_size + off;
        int64_t run = std::min(s.block_size - off, ctx - c);
        if (in_prompt) run = std::min(run, plen - p);
        for (int64_t i = 0; i < run; ++i) slot[c + i] = base + i;
        c += run;
      }
      // scores [g, padded]: T keys at a time, transposed to [Dk, T]; four independent FMA chains over d
      const int64_t padded = (ctx + T - 1) / T * T;
      scores.resize(g * padded);
      for (int64_t c0 = 0; c0 < ctx; c0 += T) {
        const int64_t nt = std::min(T, ctx - c0);
        for (int64_t t = 0; t < T; ++t) {
          float* dst = tile.data() + t * s.dk;
          if (t < nt) {
            const float* src = k + slot[c0 + t] * s.k_slot + h * s.k_head;
            for (int64_t d = 0; d < s.dk; d += T) Vec::loadu(src + d).store(dst + d);
          } else {
            std::fill(dst, dst + s.dk, 0.f);
          }
        }
        at::vec::transpose_mxn<float>(tile.data(), s.dk, tile_t.data(), T, T, s.dk);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * s.dk;
          const float* kt = tile_t.data();
          Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
          int64_t d = 0;
          for (; d + 4 <= s.dk; d += 4) {
            a0 = at::vec::fmadd(Vec(qj[d]), Vec::loadu(kt + d * T), a0);
            a1 = at::vec::fmadd(Vec(qj[d + 1]), Vec::loadu(kt + (d + 1) * T), a1);
            a2 = at::vec::fmadd(Vec(qj[d + 2]), Vec::loadu(kt + (d + 2) * T), a2);
            a3 = at::vec::fmadd(Vec(qj[d + 3]), Vec::loadu(kt + (d + 3) * T), a3);
          }
          for (; d < s.dk; ++d) a0 = at::vec::fmadd(Vec(qj[d]), Vec::loadu(kt + d * T), a0);
          ((a0 + a1) + (a2 + a3)).store(scores.data() + j * padded + c0);
        }
      }
      // softmax weights in place (the padding columns past ctx are never read)
      for (int64_t j = 0; j < g; ++j) {
        float* sj = scores.data() + j * padded;
        const float m = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, sj, ctx);
        at::vec::map([m](Vec x) { return (x - Vec(m)).exp_u20(); }, sj, sj, ctx);
        const float inv = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sj, ctx);
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, sj, sj, ctx);
      }
      // out[j] = sum_c w[j, c] v[c]: two vectors of Dv and two keys per iteration in registers
      for (int64_t j = 0; j < g; ++j) {
        const float* w = scores.data() + j * padded;
        float* o = out + (n * s.heads + h * g + j) * s.dv;
        for (int64_t d0 = 0; d0 < s.dv; d0 += 2 * T) {
          const bool two = d0 + T < s.dv;
          Vec a0(0.f), a1(0.f), b0(0.f), b1(0.f);
          int64_t c = 0;
          for (; c + 2 <= ctx; c += 2) {
            const float* v0 = v + slot[c] * s.v_slot + h * s.v_head + d0;
            const float* v1 = v + slot[c + 1] * s.v_slot + h * s.v_head + d0;
            a0 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0), a0);
            b0 = at::vec::fmadd(Vec(w[c + 1]), Vec::loadu(v1), b0);
            if (two) {
              a1 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0 + T), a1);
              b1 = at::vec::fmadd(Vec(w[c + 1]), Vec::loadu(v1 + T), b1);
            }
          }
          if (c < ctx) {
            const float* v0 = v + slot[c] * s.v_slot + h * s.v_head + d0;
            a0 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0), a0);
            if (two) a1 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0 + T), a1);
          }
          (a0 + b0).store(o + d0);
          if (two) (a1 + b1).store(o + d0 + T);
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& prefix_table, const at::Tensor& suffix_table,
                                  const at::Tensor& prompt_lens, const at::Tensor& positions, int64_t block_size,
                                  double scale, int64_t window, int64_t chunk) {
  constexpr int64_t T = Vec::size();
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_decode_attention: bad ranks");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "paged_decode_attention: pool rows not contiguous");
  Shape s;
  s.rows = query.size(0); s.heads = query.size(1); s.dk = query.size(2);
  s.kv_heads = k_cache.size(1); s.dv = v_cache.size(2);
  TORCH_CHECK(s.heads % s.kv_heads == 0 && s.dk % T == 0 && s.dv % T == 0, "paged_decode_attention: unsupported shape");
  const at::Tensor q = query.contiguous(), pt = prefix_table.contiguous(), st = suffix_table.contiguous();
  const at::Tensor pl = prompt_lens.contiguous(), ps = positions.contiguous();
  s.block_size = block_size; s.pcols = pt.size(1); s.scols = st.size(1); s.window = window; s.chunk = chunk;
  s.k_slot = k_cache.stride(0); s.k_head = k_cache.stride(1); s.v_slot = v_cache.stride(0); s.v_head = v_cache.stride(1);
  s.scale = static_cast<float>(scale);
  at::Tensor out = at::empty({s.rows, s.heads, s.dv}, q.options());
  decode(s, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), pt.data_ptr<int64_t>(),
         st.data_ptr<int64_t>(), pl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(), out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(trl_infinite, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor prefix_table, "
        "Tensor suffix_table, Tensor prompt_lens, Tensor positions, int block_size, float scale, int window, "
        "int chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(trl_infinite, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
"""

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
