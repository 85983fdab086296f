// Block primitives (yoso_cpu_simd.h): AVX2+FMA bodies picked once per process by CPUID, and
// portable loops for other CPUs (or YOSO_CPU_PORTABLE=1, which the tests use to cover them).
// (AVX-512 fp32 tiles were tried: no faster on the 2-core Xeon this was tuned on.) Int8 hashing:
// yoso_cpu_simd_i8.cpp.
// A given machine always runs the same bodies, so results never depend on thread counts.

#include "yoso_cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define YOSO_HAVE_AVX2_BODIES 1
#define YOSO_AVX2 __attribute__((target("avx2,fma")))
#define YOSO_INLINE_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline
#endif

namespace yoso::simd {

bool use_avx2() {
  static const bool avx2 = [] {
    if (env_flag("YOSO_CPU_PORTABLE")) return false;
#ifdef YOSO_HAVE_AVX2_BODIES
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
  }();
  return avx2;
}

namespace {

constexpr float kPi = 3.14159265358979323846f;
// arccos(a) = sqrt(1 - a) * sum_i kAcos[i] a^i on [0, 1], |error| <= 2e-8 (A&S 4.4.46)
constexpr float kAcos[8] = {1.5707963050f, -0.2145988016f, 0.0889789874f, -0.0501743046f,
                            0.0308918810f, -0.0170881256f, 0.0066700901f, -0.0012624911f};

// ---- portable bodies ----

void gemm_portable(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t k, int64_t n,
                   float* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < rows; ++i) {
    float* ci = c + i * ldc;
    if (!accumulate) std::fill(ci, ci + n, 0.f);
    for (int64_t p = 0; p < k; ++p) {
      const float x = a[i * lda + p];
      const float* bp = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) ci[j] += x * bp[j];
    }
  }
}

void pack_portable(const float* scores, int64_t ld, int64_t rows, int64_t m, int bits, int32_t* codes,
                   int64_t code_stride) {
  for (int64_t h = 0; h < m; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      int32_t code = 0;
      for (int t = 0; t < bits; ++t) code |= int32_t(scores[r * ld + h * bits + t] > 0.f) << t;
      codes[h * code_stride + r] = code;
    }
}

void gather_portable(const float* const* rows, int64_t nrows, int64_t count, int64_t dv, float* out, int64_t ldo,
                     float scale) {
  for (int64_t r = 0; r < nrows; ++r) {
    float* o = out + r * ldo;
    for (int64_t t = 0; t < count; ++t)
      if (const float* src = rows[r * count + t])
        for (int64_t d = 0; d < dv; ++d) o[d] += src[d];
    if (scale != 1.f)
      for (int64_t d = 0; d < dv; ++d) o[d] *= scale;
  }
}

inline float power(float x, int e) {
  float result = 1.f;
  for (; e; e >>= 1, x *= x)
    if (e & 1) result *= x;
  return result;
}

void weights_portable(float* c, float* slope, const float* keep, int64_t n, int tau, bool true_grad,
                      float min_sine) {
  for (int64_t j = 0; j < n; ++j) {
    const float x = std::min(1.f, std::max(-1.f, c[j])), a = std::fabs(x);
    float poly = kAcos[7];
    for (int i = 6; i >= 0; --i) poly = poly * a + kAcos[i];
    const float r = std::sqrt(1.f - a) * poly;
    const float base = 1.f - (x < 0.f ? kPi - r : r) * (1.f / kPi);
    const float kp = keep ? keep[j] : 1.f;
    const float below = power(base, tau - 1) * kp;
    c[j] = below * base;
    if (slope == nullptr) continue;
    if (true_grad)
      slope[j] = below * (float(tau) / kPi) / std::sqrt(std::max(1.f - x * x, min_sine * min_sine));
    else
      slope[j] = c[j] * (0.5f * float(tau));
  }
}

#ifdef YOSO_HAVE_AVX2_BODIES
// ---- AVX2 + FMA bodies ----

// A (R x 16) tile of c: R rows of a against 16 columns of b, two 8-lane accumulators per row.
template <int R, bool kMasked>
YOSO_INLINE_AVX2 void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k, float* c,
                           int64_t ldc, bool accumulate, __m256i m0, __m256i m1) {
  __m256 c0[R], c1[R];
  for (int r = 0; r < R; ++r) {
    if (accumulate) {
      c0[r] = kMasked ? _mm256_maskload_ps(c + r * ldc, m0) : _mm256_loadu_ps(c + r * ldc);
      c1[r] = kMasked ? _mm256_maskload_ps(c + r * ldc + 8, m1) : _mm256_loadu_ps(c + r * ldc + 8);
    } else {
      c0[r] = c1[r] = _mm256_setzero_ps();
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    const __m256 b0 = kMasked ? _mm256_maskload_ps(bp, m0) : _mm256_loadu_ps(bp);
    const __m256 b1 = kMasked ? _mm256_maskload_ps(bp + 8, m1) : _mm256_loadu_ps(bp + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + p);
      c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (kMasked) {
      _mm256_maskstore_ps(c + r * ldc, m0, c0[r]);
      _mm256_maskstore_ps(c + r * ldc + 8, m1, c1[r]);
    } else {
      _mm256_storeu_ps(c + r * ldc, c0[r]);
      _mm256_storeu_ps(c + r * ldc + 8, c1[r]);
    }
  }
}

constexpr int kTileRows = 6;  // 12 accumulators + 2 b vectors + 1 broadcast: 15 of 16 registers

template <bool kMasked>
YOSO_AVX2 void column_strip(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t k,
                            float* c, int64_t ldc, bool accumulate, __m256i m0, __m256i m1) {
  int64_t i = 0;
  for (; i + kTileRows <= rows; i += kTileRows)
    tile<kTileRows, kMasked>(a + i * lda, lda, b, ldb, k, c + i * ldc, ldc, accumulate, m0, m1);
  const float* ai = a + i * lda;
  float* ci = c + i * ldc;
  switch (rows - i) {
    case 5: tile<5, kMasked>(ai, lda, b, ldb, k, ci, ldc, accumulate, m0, m1); break;
    case 4: tile<4, kMasked>(ai, lda, b, ldb, k, ci, ldc, accumulate, m0, m1); break;
    case 3: tile<3, kMasked>(ai, lda, b, ldb, k, ci, ldc, accumulate, m0, m1); break;
    case 2: tile<2, kMasked>(ai, lda, b, ldb, k, ci, ldc, accumulate, m0, m1); break;
    case 1: tile<1, kMasked>(ai, lda, b, ldb, k, ci, ldc, accumulate, m0, m1); break;
    default: break;
  }
}

YOSO_AVX2 void gemm_avx2(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t k, int64_t n,
                         float* c, int64_t ldc, bool accumulate) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t width = std::min<int64_t>(16, n - j);
    if (width == 16) {
      column_strip<false>(a, lda, b + j, ldb, rows, k, c + j, ldc, accumulate, lanes, lanes);
    } else {  // masked lanes are neither read nor written
      const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(width)), lanes);
      const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(width) - 8), lanes);
      column_strip<true>(a, lda, b + j, ldb, rows, k, c + j, ldc, accumulate, m0, m1);
    }
  }
}

YOSO_AVX2 void pack_avx2(const float* scores, int64_t ld, int64_t rows, int64_t m, int bits, int32_t* codes,
                         int64_t code_stride) {
  const __m256 zero = _mm256_setzero_ps();
  const int32_t low = int32_t((1u << bits) - 1);
  // Hash-major over the rows: a row-major sweep would store to m lines code_stride apart, which
  // share an L1 set when code_stride is a large power of two and evict each other.
  for (int64_t h = 0; h < m; ++h) {
    int32_t* out = codes + h * code_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const float* sh = scores + r * ld + h * bits;
      // bit t of the 8-lane sign mask is column h*bits + t; ld leaves 16 readable columns past the last hash
      int32_t code = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(sh), zero, _CMP_GT_OQ));
      if (bits > 8) code |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(sh + 8), zero, _CMP_GT_OQ)) << 8;
      out[r] = code & low;
    }
  }
}

// 32 columns of a row at a time in four registers: the output is read and written once per row.
YOSO_AVX2 void gather_avx2(const float* const* rows, int64_t nrows, int64_t count, int64_t dv, float* out,
                           int64_t ldo, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < nrows; ++r) {
    const float* const* src = rows + r * count;
    float* o = out + r * ldo;
    for (int64_t d0 = 0; d0 < dv; d0 += 32) {
      __m256i m[4];
      __m256 acc[4];
      for (int u = 0; u < 4; ++u) {
        m[u] = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(32, dv - d0)) - 8 * u), lanes);
        acc[u] = _mm256_maskload_ps(o + d0 + 8 * u, m[u]);
      }
      for (int64_t t = 0; t < count; ++t) {
        const float* x = src[t];
        if (x == nullptr) continue;
        for (int u = 0; u < 4; ++u) acc[u] = _mm256_add_ps(acc[u], _mm256_maskload_ps(x + d0 + 8 * u, m[u]));
      }
      for (int u = 0; u < 4; ++u)
        _mm256_maskstore_ps(o + d0 + 8 * u, m[u], scale != 1.f ? _mm256_mul_ps(acc[u], s) : acc[u]);
    }
  }
}

YOSO_INLINE_AVX2 __m256 power_avx2(__m256 x, int e) {
  __m256 result = _mm256_set1_ps(1.f);
  for (; e; e >>= 1, x = _mm256_mul_ps(x, x))
    if (e & 1) result = _mm256_mul_ps(result, x);
  return result;
}

// kUnroll independent vectors per step, each step interleaved across them: one vector alone is a
// ~70-cycle dependency chain (Horner, sqrt, the power), which would leave the FMA units idle.
constexpr int kUnroll = 4;

YOSO_AVX2 void weights_avx2(float* c, float* slope, const float* keep, int64_t n, int tau, bool true_grad,
                            float min_sine) {
  const __m256 one = _mm256_set1_ps(1.f), minus_one = _mm256_set1_ps(-1.f), zero = _mm256_setzero_ps();
  const __m256 pi = _mm256_set1_ps(kPi), inv_pi = _mm256_set1_ps(1.f / kPi);
  const __m256 sign = _mm256_set1_ps(-0.f), floor2 = _mm256_set1_ps(min_sine * min_sine);
  const __m256 true_scale = _mm256_set1_ps(float(tau) / kPi), bound_scale = _mm256_set1_ps(0.5f * float(tau));
  int64_t j = 0;
  for (; j + 8 * kUnroll <= n; j += 8 * kUnroll) {
    __m256 x[kUnroll], a[kUnroll], poly[kUnroll], base[kUnroll], below[kUnroll], sq[kUnroll];
    for (int u = 0; u < kUnroll; ++u) {
      x[u] = _mm256_min_ps(one, _mm256_max_ps(minus_one, _mm256_loadu_ps(c + j + 8 * u)));
      a[u] = _mm256_andnot_ps(sign, x[u]);
      poly[u] = _mm256_set1_ps(kAcos[7]);
    }
    for (int i = 6; i >= 0; --i)
      for (int u = 0; u < kUnroll; ++u) poly[u] = _mm256_fmadd_ps(poly[u], a[u], _mm256_set1_ps(kAcos[i]));
    for (int u = 0; u < kUnroll; ++u) {
      const __m256 r = _mm256_mul_ps(_mm256_sqrt_ps(_mm256_sub_ps(one, a[u])), poly[u]);
      const __m256 theta = _mm256_blendv_ps(r, _mm256_sub_ps(pi, r), _mm256_cmp_ps(x[u], zero, _CMP_LT_OQ));
      base[u] = _mm256_fnmadd_ps(theta, inv_pi, one);
      below[u] = one;
      sq[u] = base[u];
    }
    for (int e = tau - 1; e; e >>= 1) {  // base^(tau-1) by squaring, all vectors in step
      for (int u = 0; u < kUnroll; ++u) {
        if (e & 1) below[u] = _mm256_mul_ps(below[u], sq[u]);
        sq[u] = _mm256_mul_ps(sq[u], sq[u]);
      }
    }
    for (int u = 0; u < kUnroll; ++u) {
      if (keep) below[u] = _mm256_mul_ps(below[u], _mm256_loadu_ps(keep + j + 8 * u));
      const __m256 w = _mm256_mul_ps(below[u], base[u]);
      _mm256_storeu_ps(c + j + 8 * u, w);
      if (slope == nullptr) continue;
      if (true_grad) {
        const __m256 sine = _mm256_sqrt_ps(_mm256_max_ps(_mm256_fnmadd_ps(x[u], x[u], one), floor2));
        _mm256_storeu_ps(slope + j + 8 * u, _mm256_div_ps(_mm256_mul_ps(below[u], true_scale), sine));
      } else {
        _mm256_storeu_ps(slope + j + 8 * u, _mm256_mul_ps(w, bound_scale));
      }
    }
  }
  if (j < n)
    weights_portable(c + j, slope ? slope + j : nullptr, keep ? keep + j : nullptr, n - j, tau, true_grad, min_sine);
}
#endif  // YOSO_HAVE_AVX2_BODIES

}  // namespace

bool env_flag(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "1") == 0;
}

void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t k, int64_t n, float* c,
          int64_t ldc, bool accumulate) {
#ifdef YOSO_HAVE_AVX2_BODIES
  if (use_avx2()) return gemm_avx2(a, lda, b, ldb, rows, k, n, c, ldc, accumulate);
#endif
  gemm_portable(a, lda, b, ldb, rows, k, n, c, ldc, accumulate);
}

void pack_codes(const float* scores, int64_t ld, int64_t rows, int64_t m, int bits, int32_t* codes,
                int64_t code_stride) {
#ifdef YOSO_HAVE_AVX2_BODIES
  if (use_avx2()) return pack_avx2(scores, ld, rows, m, bits, codes, code_stride);
#endif
  pack_portable(scores, ld, rows, m, bits, codes, code_stride);
}

void collision_weights(float* c, float* slope, const float* keep, int64_t n, int tau, bool true_grad,
                       float min_sine) {
#ifdef YOSO_HAVE_AVX2_BODIES
  if (use_avx2()) return weights_avx2(c, slope, keep, n, tau, true_grad, min_sine);
#endif
  weights_portable(c, slope, keep, n, tau, true_grad, min_sine);
}

void gather_rows(const float* const* rows, int64_t nrows, int64_t count, int64_t dv, float* out, int64_t ldo,
                 float scale) {
#ifdef YOSO_HAVE_AVX2_BODIES
  if (use_avx2()) return gather_avx2(rows, nrows, count, dv, out, ldo, scale);
#endif
  gather_portable(rows, nrows, count, dv, out, ldo, scale);
}

const char* level() { return use_avx2() ? "avx2" : "portable"; }

}  // namespace yoso::simd
