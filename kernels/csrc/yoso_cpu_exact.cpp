// YOSO-E on CPU: E[B]·V and its backward without ever holding an N×N matrix.
//
// Blockwise like flash attention: a block of queries against a block of keys, cosines by a small
// GEMM into an L1/L2-sized tile, (1 - arccos/π)^τ in place (yoso_cpu_simd.cpp, vectorised),
// then the tile times the keys' values into the block's output. Every output row is owned by
// one work item and sums its key blocks in order; the backward gives each (batch*head) to one
// thread. So results are bit-identical across thread counts on a given machine.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "yoso_cpu.h"
#include "yoso_cpu_simd.h"

namespace yoso {
namespace {

constexpr int64_t kQueryBlock = 48;  // a multiple of the GEMM's 6-row tile
constexpr int64_t kKeyBlock = 256;   // a (48 x 256) fp32 tile is 48 KiB

// x (rows, cols) row-major -> xt (cols, rows)
void transpose(const float* x, int64_t rows, int64_t cols, int64_t ldx, float* xt, int64_t ldt) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) xt[c * ldt + r] = x[r * ldx + c];
}

// 1 / max(|x|, 1e-12) of a row of d floats. The squares are summed in 8 interleaved partial sums: one
// sequential chain per row (a 4-cycle add per element) cost more than the whole attention of 16 inputs
// of 128 tokens (2.6 of 6.0 ms, AMD EPYC, 2 threads).
float inverse_norm(const float* x, int64_t d) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8)
    for (int u = 0; u < 8; ++u) part[u] += x[c + u] * x[c + u];
  float sq = 0.f;
  for (; c < d; ++c) sq += x[c] * x[c];
  for (int u = 0; u < 8; ++u) sq += part[u];
  return 1.f / std::max(std::sqrt(sq), 1e-12f);
}

// about 0.1 ms of work per extra thread, as the LSH kernels
int threads_for_heads(int64_t bh, int64_t n, int64_t d, int64_t dv, int nthreads) {
  const int64_t ops = bh * n * n * (d + dv);
  return int(std::max<int64_t>(1, std::min<int64_t>(nthreads, ops >> 18)));
}

int threads_for_heads(const ExactParams& p, int nthreads) { return threads_for_heads(p.bh, p.n, p.d, p.dv, nthreads); }

// 1 + the last position whose keep is not 0 (keep: n floats, or bytes, or null = all kept)
template <typename K>
int64_t real_length(const K* keep, int64_t n) {
  if (keep == nullptr) return n;
  while (n > 0 && keep[n - 1] == K(0)) --n;
  return n;
}

// acc (rows, dv) = sum over the key blocks of ((1 - arccos(cosines)/pi)^tau * keep) v for `rows` query rows
// against the first n keys, key blocks in order: the one loop every forward runs. cosines(j0, cols, tile) writes
// the rows' cosines with keys j0..j0+cols-1 into tile (row stride kKeyBlock); tile holds kQueryBlock x kKeyBlock
// floats, acc kQueryBlock x dv.
template <typename Cosines>
void forward_block(const Cosines& cosines, const float* v, int64_t ldv, int64_t dv, const float* keep, int64_t n,
                   int64_t rows, int tau, float* tile, float* acc) {
  std::fill(acc, acc + kQueryBlock * dv, 0.f);
  for (int64_t j0 = 0; rows > 0 && j0 < n; j0 += kKeyBlock) {
    const int64_t cols = std::min(kKeyBlock, n - j0);
    cosines(j0, cols, tile);
    for (int64_t r = 0; r < rows; ++r)
      simd::collision_weights(tile + r * kKeyBlock, nullptr, keep + j0, cols, tau, false, 0.f);
    simd::gemm(tile, kKeyBlock, v + j0 * ldv, ldv, rows, cols, dv, acc, dv, true);
  }
}

// The cosines of `rows` unit query rows q (d floats each) with unit keys kt (transposed, row stride ldk).
auto unit_cosines(const float* q, int64_t d, const float* kt, int64_t ldk, int64_t rows) {
  return [=](int64_t j0, int64_t cols, float* tile) {
    simd::gemm(q, d, kt + j0, ldk, rows, d, cols, tile, kKeyBlock, false);
  };
}

// A row as fp32: an fp32 row as it is, a bf16 row widened (exactly) into `to`
inline const float* widen(const float* x, int64_t, float*) { return x; }
inline const float* widen(const uint16_t* x, int64_t count, float* to) {
  simd::widen_bf16(x, count, to);
  return to;
}

// exact_attention over q, k, v elements of type T (float or bf16 bits): each (batch*head) is one work item that
// prepares its rows in the thread's buffers (in cache for the GEMMs right after) and writes its output rows.
// fp32 rows, and bf16 ones on CPUs without bf16 dot products (or of odd width), are made unit rows and the
// keys transposed; bf16 rows with bf16 dot products stay as they are, the keys packed in pairs, and each
// cosine is their exact products' sum scaled by the two rows' inverse norms (simd::cosines_bf16).
template <typename T>
void exact_attention_t(const AttentionParams& a, int nthreads) {
  const int64_t bh = a.batch * a.heads, n = a.n, d = a.d, dv = a.dv;
  const T *q = static_cast<const T*>(a.q), *k = static_cast<const T*>(a.k), *v = static_cast<const T*>(a.v);
  constexpr bool kWide = std::is_same<T, float>::value;  // v is read in place; bf16 values are widened first
  const bool dots = !kWide && d % 2 == 0 && simd::bf16_dots();
  const int64_t pairs = d / 2;
#pragma omp parallel num_threads(threads_for_heads(bh, n, d, dv, nthreads))
  {
    std::vector<float> qs(dots ? 0 : n * d), kt(dots ? 0 : d * n), keep(n), vs(kWide ? 0 : n * dv), row(d);
    std::vector<float> iq(dots ? n : 0), ik(dots ? n : 0);
    std::vector<uint32_t> kp(dots ? pairs * n : 0);
    std::vector<float> tile(kQueryBlock * kKeyBlock), acc(kQueryBlock * dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < bh; ++b) {
      const int64_t batch = b / a.heads, head = b % a.heads;
      const uint8_t* kept = a.keep == nullptr ? nullptr : a.keep + batch * n;
      // Only the rows and keys up to the last real position: padding past it changes neither the work's
      // shape nor its bits, so a text gives the same output alone or padded in a batch (and padding is free).
      const int64_t real = real_length(kept, n);
      const T* xq = q + batch * a.q_stride[0] + head * a.q_stride[1];
      const T* xk = k + batch * a.k_stride[0] + head * a.k_stride[1];
      for (int64_t i = 0; i < real; ++i) keep[i] = kept == nullptr || kept[i] ? 1.f : 0.f;
      const auto bits = [](const T* x) { return reinterpret_cast<const uint16_t*>(x); };  // read only when dots
      const T* xv = v + batch * a.v_stride[0] + head * a.v_stride[1];
      const float* values = vs.data();
      int64_t ldv = dv;
      if constexpr (kWide) {
        values = xv;
        ldv = a.v_stride[2];
      } else {
        for (int64_t i = 0; i < real; ++i) widen(xv + i * a.v_stride[2], dv, vs.data() + i * dv);
      }
      if (dots) {
        simd::prepare_bf16_rows(bits(xq), a.q_stride[2], real, pairs, iq.data(), nullptr, 0);
        simd::prepare_bf16_rows(bits(xk), a.k_stride[2], real, pairs, ik.data(), kp.data(), n);
      }
      for (int64_t i = 0; !dots && i < real; ++i) {
        simd::prefetch_ahead(xq, a.q_stride[2], i, real, d);
        simd::prefetch_ahead(xk, a.k_stride[2], i, real, d);
        if constexpr (kWide) simd::prefetch_ahead(xv, a.v_stride[2], i, real, dv);  // read in place by the GEMM
        const float* rq = widen(xq + i * a.q_stride[2], d, row.data());
        const float sq = inverse_norm(rq, d);
        for (int64_t c = 0; c < d; ++c) qs[i * d + c] = rq[c] * sq;
        const float* rk = widen(xk + i * a.k_stride[2], d, row.data());
        const float sk = inverse_norm(rk, d);
        for (int64_t c = 0; c < d; ++c) kt[c * n + i] = rk[c] * sk;
      }
      float* out = a.out + batch * a.out_stride[0] + head * a.out_stride[1];
      for (int64_t i0 = 0; i0 < n; i0 += kQueryBlock) {
        const int64_t rows = std::max<int64_t>(0, std::min(kQueryBlock, real - i0));
        if (rows > 0 && dots) {
          const uint16_t* rows_q = bits(xq + i0 * a.q_stride[2]);
          const auto cosines = [&](int64_t j0, int64_t cols, float* to) {
            simd::cosines_bf16(rows_q, a.q_stride[2], iq.data() + i0, kp.data() + j0, n, ik.data() + j0, rows, pairs,
                               cols, to, kKeyBlock);
          };
          forward_block(cosines, values, ldv, dv, keep.data(), real, rows, a.hash_bits, tile.data(), acc.data());
        } else if (rows > 0) {
          forward_block(unit_cosines(qs.data() + i0 * d, d, kt.data(), n, rows), values, ldv, dv, keep.data(), real,
                        rows, a.hash_bits, tile.data(), acc.data());
        }
        // padded queries give zero rows (as every row past the last real one)
        for (int64_t r = 0; r < std::min(kQueryBlock, n - i0); ++r) {
          float* o = out + (i0 + r) * a.out_stride[2];
          for (int64_t c = 0; c < dv; ++c) o[c] = r < rows ? acc[r * dv + c] * keep[i0 + r] : 0.f;
        }
      }
    }
  }
}

}  // namespace

void exact_forward(const ExactParams& p, int nthreads) {
  const int64_t blocks = (p.n + kQueryBlock - 1) / kQueryBlock;
  // keys transposed per (batch*head): (D, N), GEMM-friendly
  std::vector<float> kt(p.bh * p.d * p.n);
  std::vector<int64_t> real(p.bh);
  for (int64_t b = 0; b < p.bh; ++b) real[b] = real_length(p.keep + b * p.n, p.n);
#pragma omp parallel num_threads(threads_for_heads(p, nthreads))
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.bh; ++b) transpose(p.k + b * p.n * p.d, p.n, p.d, p.d, kt.data() + b * p.d * p.n, p.n);
    std::vector<float> tile(kQueryBlock * kKeyBlock), acc(kQueryBlock * p.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < p.bh * blocks; ++item) {
      const int64_t b = item / blocks, i0 = (item % blocks) * kQueryBlock;
      const float* keep = p.keep + b * p.n;
      const float* v = p.v + (b / p.heads) * p.v_stride[0] + (b % p.heads) * p.v_stride[1];
      float* out = p.out + (b / p.heads) * p.out_stride[0] + (b % p.heads) * p.out_stride[1];
      const int64_t rows = std::max<int64_t>(0, std::min(kQueryBlock, real[b] - i0));
      forward_block(unit_cosines(p.q + (b * p.n + i0) * p.d, p.d, kt.data() + b * p.d * p.n, p.n, rows), v,
                    p.v_stride[2], p.dv, keep, real[b], rows, p.tau, tile.data(), acc.data());
      // padded queries give zero rows (past the last real one acc is zero as well)
      for (int64_t r = 0; r < std::min(kQueryBlock, p.n - i0); ++r) {
        float* o = out + (i0 + r) * p.out_stride[2];
        for (int64_t c = 0; c < p.dv; ++c) o[c] = acc[r * p.dv + c] * keep[i0 + r];
      }
    }
  }
}

void exact_attention(const AttentionParams& a, int nthreads) {
  if (a.bf16)
    exact_attention_t<uint16_t>(a, nthreads);
  else
    exact_attention_t<float>(a, nthreads);
}

void exact_backward(const ExactParams& p, int nthreads) {
#pragma omp parallel num_threads(std::min<int64_t>(threads_for_heads(p, nthreads), p.bh))
  {
    std::vector<float> kt(p.d * p.n), vt(p.dv * p.n), g(kQueryBlock * p.dv);
    std::vector<float> w(kQueryBlock * kKeyBlock), s(kQueryBlock * kKeyBlock), slope(kQueryBlock * kKeyBlock);
    std::vector<float> st(kKeyBlock * kQueryBlock), wt(kKeyBlock * kQueryBlock);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < p.bh; ++b) {
      const float *q = p.q + b * p.n * p.d, *k = p.k + b * p.n * p.d, *v = p.v + b * p.n * p.dv;
      const float *grad = p.grad + b * p.n * p.dv, *keep = p.keep + b * p.n;
      float *gq = p.grad_q + b * p.n * p.d, *gk = p.grad_k + b * p.n * p.d, *gv = p.grad_v + b * p.n * p.dv;
      transpose(k, p.n, p.d, p.d, kt.data(), p.n);
      transpose(v, p.n, p.dv, p.dv, vt.data(), p.n);
      for (int64_t i0 = 0; i0 < p.n; i0 += kQueryBlock) {
        const int64_t rows = std::min(kQueryBlock, p.n - i0);
        for (int64_t r = 0; r < rows; ++r)  // padded queries' outputs are constant zeros: no gradient
          for (int64_t c = 0; c < p.dv; ++c) g[r * p.dv + c] = grad[(i0 + r) * p.dv + c] * keep[i0 + r];
        for (int64_t j0 = 0; j0 < p.n; j0 += kKeyBlock) {
          const int64_t cols = std::min(kKeyBlock, p.n - j0);
          // w = cos(q_i, k_j) -> E[B_ij] with its slope; s = dO_i . v_j -> s * slope
          simd::gemm(q + i0 * p.d, p.d, kt.data() + j0, p.n, rows, p.d, cols, w.data(), kKeyBlock, false);
          simd::gemm(g.data(), p.dv, vt.data() + j0, p.n, rows, p.dv, cols, s.data(), kKeyBlock, false);
          for (int64_t r = 0; r < rows; ++r) {
            float *wr = w.data() + r * kKeyBlock, *sr = s.data() + r * kKeyBlock, *lr = slope.data() + r * kKeyBlock;
            simd::collision_weights(wr, lr, keep + j0, cols, p.tau, p.true_grad, p.min_sine);
            for (int64_t c = 0; c < cols; ++c) sr[c] *= lr[c];
          }
          simd::gemm(s.data(), kKeyBlock, k + j0 * p.d, p.d, rows, cols, p.d, gq + i0 * p.d, p.d, true);
          transpose(s.data(), rows, cols, kKeyBlock, st.data(), kQueryBlock);
          transpose(w.data(), rows, cols, kKeyBlock, wt.data(), kQueryBlock);
          simd::gemm(st.data(), kQueryBlock, q + i0 * p.d, p.d, cols, rows, p.d, gk + j0 * p.d, p.d, true);
          simd::gemm(wt.data(), kQueryBlock, g.data(), p.dv, cols, rows, p.dv, gv + j0 * p.dv, p.dv, true);
        }
      }
    }
  }
}

}  // namespace yoso
