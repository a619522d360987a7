"""The C++ source of the CPU decode-attention kernel (`cpu_decode.py` builds and registers it, and says what it
computes). Per (row, KV head): the visible positions' pool slots; the scores, `T` keys at a time transposed so that
the products over the head dimension run as vector FMAs across keys; the softmax weights in place; the weighted sum of
the value rows, keys in blocks of `VB` (each value row read from memory once for all query heads of the KV head), two
chains per element (even and odd keys) added at the end. Rows a few tiles ahead are prefetched in software.
"""

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
constexpr int64_t KAHEAD = 64;  // keys ahead of the score pass's tile whose rows are prefetched
constexpr int64_t VB = 64;  // keys per block of the value pass (even: the two chains' pairs never straddle blocks)

struct Shape {
  int64_t rows, heads, kv_heads, dk, dv, block_size, pcols, scols, window, chunk;
  int64_t k_slot, k_head, v_slot, v_head;
  float scale;
};

// Software prefetch of the pool rows of positions [c0, c1) (no effect on any value): a head's rows lie one slot
// apart (Hkv heads per slot), so a 4 KB page holds a few of them and the hardware's stream prefetcher, which stops
// at page boundaries, leaves most of a long context's reads waiting on memory.
inline void prefetch_rows(const float* base, const int64_t* slot, int64_t c0, int64_t c1, int64_t stride,
                          int64_t offset, int64_t width) {
  for (int64_t c = c0; c < c1; ++c) {
    const char* row = reinterpret_cast<const char*>(base + slot[c] * stride + offset);
    for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(row + b, 0, 3);
  }
}

void decode(const Shape& s, const float* q, const float* k, const float* v, const int64_t* ptab, const int64_t* stab,
            const int64_t* plens, const int64_t* positions, float* out) {
  constexpr int64_t T = Vec::size();
  const int64_t g = s.heads / s.kv_heads;
  at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * s.dk), scores, tile(T * s.dk), tile_t(s.dk * T), acc;
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
        prefetch_rows(k, slot.data(), c0 + KAHEAD, std::min(ctx, c0 + KAHEAD + T), s.k_slot, h * s.k_head, s.dk);
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
      // out[j] = sum_c w[j, c] v[c]: two vectors of Dv and two keys per iteration in registers, per element two
      // chains (even and odd keys) added at the end. The keys run in blocks of VB whose value rows stay in L1 while
      // every head j and vector pair d0 reads them (the chains' sums wait in `acc` between blocks): each value row
      // comes from memory once, not once per (j, d0), and every sum is taken in the same order as unblocked
      acc.assign(g * 2 * s.dv, 0.f);
      prefetch_rows(v, slot.data(), 0, std::min(ctx, VB), s.v_slot, h * s.v_head, s.dv);
      for (int64_t cb = 0; cb < ctx; cb += VB) {
        const int64_t ce = std::min(ctx, cb + VB);
        prefetch_rows(v, slot.data(), ce, std::min(ctx, ce + VB), s.v_slot, h * s.v_head, s.dv);
        for (int64_t j = 0; j < g; ++j) {
          const float* w = scores.data() + j * padded;
          float* even = acc.data() + j * 2 * s.dv;
          float* odd = even + s.dv;
          for (int64_t d0 = 0; d0 < s.dv; d0 += 2 * T) {
            const bool two = d0 + T < s.dv;
            Vec a0 = Vec::loadu(even + d0), b0 = Vec::loadu(odd + d0);
            Vec a1 = two ? Vec::loadu(even + d0 + T) : Vec(0.f), b1 = two ? Vec::loadu(odd + d0 + T) : Vec(0.f);
            int64_t c = cb;
            for (; c + 2 <= ce; c += 2) {
              const float* v0 = v + slot[c] * s.v_slot + h * s.v_head + d0;
              const float* v1 = v + slot[c + 1] * s.v_slot + h * s.v_head + d0;
              a0 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0), a0);
              b0 = at::vec::fmadd(Vec(w[c + 1]), Vec::loadu(v1), b0);
              if (two) {
                a1 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0 + T), a1);
                b1 = at::vec::fmadd(Vec(w[c + 1]), Vec::loadu(v1 + T), b1);
              }
            }
            if (c < ce) {  // the last key of an odd context (blocks hold an even number of keys)
              const float* v0 = v + slot[c] * s.v_slot + h * s.v_head + d0;
              a0 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0), a0);
              if (two) a1 = at::vec::fmadd(Vec(w[c]), Vec::loadu(v0 + T), a1);
            }
            a0.store(even + d0); b0.store(odd + d0);
            if (two) { a1.store(even + d0 + T); b1.store(odd + d0 + T); }
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        const float* even = acc.data() + j * 2 * s.dv;
        float* o = out + (n * s.heads + h * g + j) * s.dv;
        for (int64_t d = 0; d < s.dv; d += T) (Vec::loadu(even + d) + Vec::loadu(even + s.dv + d)).store(o + d);
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
