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
#include <memory>
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

int threads_for_heads(const ExactParams& p, int nthreads) {
  // about 0.1 ms of work per extra thread, as the LSH kernels
  const int64_t ops = p.bh * p.n * p.n * (p.d + p.dv);
  return int(std::max<int64_t>(1, std::min<int64_t>(nthreads, ops >> 18)));
}

}  // namespace

void exact_forward(const ExactParams& p, int nthreads) {
  const int64_t blocks = (p.n + kQueryBlock - 1) / kQueryBlock;
  // keys transposed per (batch*head): (D, N), GEMM-friendly; exact_attention hands them in so
  std::vector<float> own(p.kt == nullptr ? p.bh * p.d * p.n : 0);
  float* const kt = p.kt == nullptr ? own.data() : const_cast<float*>(p.kt);
  const int team = threads_for_heads(p, nthreads);
  std::vector<int64_t> real(p.bh);  // per (batch*head): 1 + the last position whose keep is not 0
  for (int64_t b = 0; b < p.bh; ++b) {
    int64_t n = p.n;
    while (n > 0 && p.keep[b * p.n + n - 1] == 0.f) --n;
    real[b] = n;
  }
#pragma omp parallel num_threads(team)
  {
    if (p.kt == nullptr) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < p.bh; ++b) transpose(p.k + b * p.n * p.d, p.n, p.d, p.d, kt + b * p.d * p.n, p.n);
    }
    std::vector<float> tile(kQueryBlock * kKeyBlock), acc(kQueryBlock * p.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < p.bh * blocks; ++item) {
      const int64_t b = item / blocks, i0 = (item % blocks) * kQueryBlock;
      const float* keep = p.keep + b * p.n;
      const float* v = p.v + (b / p.heads) * p.v_stride[0] + (b % p.heads) * p.v_stride[1];
      float* out = p.out + (b / p.heads) * p.out_stride[0] + (b % p.heads) * p.out_stride[1];
      // Only the rows and keys up to the last real position: padding past it changes neither the work's
      // shape nor its bits, so a text gives the same output alone or padded in a batch (and padding is free).
      const int64_t n = real[b], rows = std::max<int64_t>(0, std::min(kQueryBlock, n - i0));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; rows > 0 && j0 < n; j0 += kKeyBlock) {
        const int64_t cols = std::min(kKeyBlock, n - j0);
        simd::gemm(p.q + (b * p.n + i0) * p.d, p.d, kt + b * p.d * p.n + j0, p.n, rows, p.d, cols,
                   tile.data(), kKeyBlock, false);
        for (int64_t r = 0; r < rows; ++r)
          simd::collision_weights(tile.data() + r * kKeyBlock, nullptr, keep + j0, cols, p.tau, false, 0.f);
        simd::gemm(tile.data(), kKeyBlock, v + j0 * p.v_stride[2], p.v_stride[2], rows, cols, p.dv, acc.data(), p.dv,
                   true);
      }
      // padded queries give zero rows (past the last real one acc is zero as well)
      for (int64_t r = 0; r < std::min(kQueryBlock, p.n - i0); ++r) {
        float* o = out + (i0 + r) * p.out_stride[2];
        for (int64_t c = 0; c < p.dv; ++c) o[c] = acc[r * p.dv + c] * keep[i0 + r];
      }
    }
  }
}

void exact_attention(const AttentionParams& a, int nthreads) {
  ExactParams p{};
  p.bh = a.batch * a.heads;
  p.n = a.n;
  p.d = a.d;
  p.dv = a.dv;
  p.heads = a.heads;
  std::copy(a.v_stride, a.v_stride + 3, p.v_stride);
  std::copy(a.out_stride, a.out_stride + 3, p.out_stride);
  p.tau = a.hash_bits;
  p.v = a.v;
  p.out = a.out;
  // unit q rows (BH, N, D) and unit k rows written straight into the transposed (BH, D, N) layout the
  // forward multiplies by; every element is written, so the buffers are left uninitialised
  std::unique_ptr<float[]> q(new float[p.bh * p.n * p.d]), kt(new float[p.bh * p.d * p.n]), keep(new float[p.bh * p.n]);
#pragma omp parallel for num_threads(threads_for_heads(p, nthreads)) schedule(static)
  for (int64_t b = 0; b < p.bh; ++b) {
    const int64_t batch = b / a.heads, head = b % a.heads;
    float* kt_b = kt.get() + b * p.d * p.n;
    for (int64_t i = 0; i < p.n; ++i) {
      keep[b * p.n + i] = a.keep == nullptr || a.keep[batch * p.n + i] ? 1.f : 0.f;
      const float* xq = a.q + batch * a.q_stride[0] + head * a.q_stride[1] + i * a.q_stride[2];
      const float* xk = a.k + batch * a.k_stride[0] + head * a.k_stride[1] + i * a.k_stride[2];
      const float sq = inverse_norm(xq, p.d), sk = inverse_norm(xk, p.d);
      float* dst = q.get() + (b * p.n + i) * p.d;
      for (int64_t c = 0; c < p.d; ++c) dst[c] = xq[c] * sq;
      for (int64_t c = 0; c < p.d; ++c) kt_b[c * p.n + i] = xk[c] * sk;
    }
  }
  p.q = q.get();
  p.k = nullptr;  // only the transposed copy exists
  p.kt = kt.get();
  p.keep = keep.get();
  exact_forward(p, nthreads);
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
