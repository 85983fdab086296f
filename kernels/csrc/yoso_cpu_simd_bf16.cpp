// Exact mode's cosines from bf16 rows (yoso_cpu_simd.h): AVX-512 BF16 dot products (vdpbf16ps: 32 products per
// instruction, each exact in fp32, summed in fp32 in pair order) where the CPU has them. Every c[r][j] is one
// lane's chain over the pairs, so its bits depend on neither the tile's rows nor its columns.

#include "yoso_cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define YOSO_HAVE_BF16_BODY 1
#define YOSO_BF16 __attribute__((target("avx512f,avx512bf16")))
#define YOSO_INLINE_BF16 __attribute__((target("avx512f,avx512bf16"), always_inline)) inline
#endif

namespace yoso::simd {

// AVX-512 BF16 unless YOSO_CPU_PORTABLE=1 or YOSO_CPU_NO_BF16_DOT=1 (the tests use it to cover the fp32 tiles).
bool bf16_dots() {
  static const bool dots = [] {
    if (env_flag("YOSO_CPU_PORTABLE") || env_flag("YOSO_CPU_NO_BF16_DOT")) return false;
#ifdef YOSO_HAVE_BF16_BODY
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
  }();
  return dots;
}

#ifdef YOSO_HAVE_BF16_BODY
namespace {

inline __mmask16 lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// R rows of q against 32 packed keys: two 16-lane accumulators a row, scaled by the norms as they are stored.
template <int R>
YOSO_INLINE_BF16 void tile(const uint16_t* q, int64_t ldq, const float* iq, const uint32_t* kp, int64_t ldk,
                           const float* ik, int64_t pairs, float* c, int64_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, kp + p * ldk);
    const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, kp + p * ldk + 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + r * ldq + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(pair));
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
  const __m512 s0 = _mm512_maskz_loadu_ps(m0, ik), s1 = _mm512_maskz_loadu_ps(m1, ik + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(iq[r]);
    _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_mul_ps(_mm512_mul_ps(c0[r], s0), scale));
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_mul_ps(_mm512_mul_ps(c1[r], s1), scale));
  }
}

template <int R>
YOSO_BF16 void strip(const uint16_t* q, int64_t ldq, const float* iq, const uint32_t* kp, int64_t ldk,
                     const float* ik, int64_t pairs, int64_t cols, float* c, int64_t ldc) {
  for (int64_t j = 0; j < cols; j += 32)
    tile<R>(q, ldq, iq, kp + j, ldk, ik + j, pairs, c + j, ldc, lanes(cols - j), lanes(cols - j - 16));
}

constexpr int kRows = 8;

YOSO_BF16 void cosines_avx512(const uint16_t* q, int64_t ldq, const float* iq, const uint32_t* kp, int64_t ldk,
                              const float* ik, int64_t rows, int64_t pairs, int64_t cols, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    strip<kRows>(q + r * ldq, ldq, iq + r, kp, ldk, ik, pairs, cols, c + r * ldc, ldc);
  using Strip = void (*)(const uint16_t*, int64_t, const float*, const uint32_t*, int64_t, const float*, int64_t,
                         int64_t, float*, int64_t);
  static constexpr Strip kTail[kRows] = {nullptr, strip<1>, strip<2>, strip<3>, strip<4>, strip<5>, strip<6>, strip<7>};
  if (r < rows) kTail[rows - r](q + r * ldq, ldq, iq + r, kp, ldk, ik, pairs, cols, c + r * ldc, ldc);
}

// For rows of 2 * pairs bf16 values: inv[r] = 1 / max(|x_r|, 1e-12), the squares summed by the same dot products;
// with kp the pairs also packed as the cosines read keys.
YOSO_BF16 void prepare_avx512(const uint16_t* x, int64_t ldx, int64_t rows, int64_t pairs, float* inv, uint32_t* kp,
                              int64_t ldk) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * ldx;
    __m512 sq = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p += 16) {
      const __m512i xs = _mm512_maskz_loadu_epi32(lanes(pairs - p), row + 2 * p);
      sq = _mm512_dpbf16_ps(sq, (__m512bh)xs, (__m512bh)xs);
    }
    inv[r] = 1.f / std::max(std::sqrt(_mm512_reduce_add_ps(sq)), 1e-12f);
    if (kp != nullptr)
      for (int64_t p = 0; p < pairs; ++p) std::memcpy(kp + p * ldk + r, row + 2 * p, sizeof(uint32_t));
  }
}

}  // namespace
#endif

// The callers check bf16_dots() first: without the instructions there is no body to run.
[[noreturn]] void no_bf16_dots() {
  std::fprintf(stderr, "yoso: a bf16 dot-product body was called on a CPU without AVX-512 BF16\n");
  std::abort();
}

void cosines_bf16(const uint16_t* q, int64_t ldq, const float* iq, const uint32_t* kp, int64_t ldk, const float* ik,
                  int64_t rows, int64_t pairs, int64_t cols, float* c, int64_t ldc) {
#ifdef YOSO_HAVE_BF16_BODY
  if (bf16_dots()) return cosines_avx512(q, ldq, iq, kp, ldk, ik, rows, pairs, cols, c, ldc);
#endif
  no_bf16_dots();
}

void prepare_bf16_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t pairs, float* inv, uint32_t* kp,
                       int64_t ldk) {
#ifdef YOSO_HAVE_BF16_BODY
  if (bf16_dots()) return prepare_avx512(x, ldx, rows, pairs, inv, kp, ldk);
#endif
  no_bf16_dots();
}

}  // namespace yoso::simd
