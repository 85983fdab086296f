// Int8 hashing (yoso_cpu_simd.h): an AVX-512 VNNI body (u8 x s8 dot products, 64 per instruction: about 3x
// the fp32 tiles on the Xeon it was tuned on), else an exact fp32 GEMM of the integers through the fp32
// primitives. Every body gives the same codes; a given machine always runs the same one.

#include "yoso_cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define YOSO_HAVE_VNNI_BODY 1
#define YOSO_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define YOSO_INLINE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline
#define YOSO_AVX2_ROW __attribute__((target("avx2,fma")))
#endif

namespace yoso::simd {
namespace {

// The int8 hashing body: AVX-512 VNNI (u8 x s8 dot products, 64 per instruction) unless YOSO_CPU_PORTABLE=1
// or YOSO_CPU_NO_VNNI=1 (the tests use it to cover the AVX2 body on a VNNI machine).
bool use_vnni() {
  static const bool vnni = [] {
    if (env_flag("YOSO_CPU_PORTABLE") || env_flag("YOSO_CPU_NO_VNNI")) return false;
#ifdef YOSO_HAVE_VNNI_BODY
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
  }();
  return vnni;
}

#ifdef YOSO_HAVE_VNNI_BODY
// ---- int8 hashing, AVX-512 VNNI ----

// u = x8 + 128 as bytes (x8 as in the header), zero past d up to dpad.
YOSO_VNNI void quantize_u8_vnni(const float* x, int64_t d, int64_t dpad, uint8_t* u) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = d - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - c)) - 1);
    top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + c)));
  }
  float s = _mm512_reduce_max_ps(top);
  if (!(s > 0.f)) s = 1.f;
  const __m512 vs = _mm512_set1_ps(s), levels = _mm512_set1_ps(127.f);
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = d - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (d - c)) - 1);
    const __m512 q = _mm512_mul_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(k, x + c), vs), levels);
    _mm512_mask_cvtepi32_storeu_epi8(u + c, k, _mm512_add_epi32(_mm512_cvtps_epi32(q), bias));  // nearest even
  }
  for (int64_t c = d; c < dpad; ++c) u[c] = 0;
}

// R rows of u (stride dpad) against one 16-column group of packed planes: 16 sign bits per row.
template <int R>
YOSO_INLINE_VNNI void tile_i8(const uint8_t* u, int64_t dpad, const int8_t* wg, __m512i offset, uint16_t* bits,
                              int64_t nb) {
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t p = 0; p < dpad / 4; ++p) {
    const __m512i b = _mm512_loadu_si512(wg + p * 64);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, u + r * dpad + 4 * p, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(four), b);
    }
  }
  // sum (x8 + 128) w - 128 sum w = sum x8 w > 0
  for (int r = 0; r < R; ++r) bits[r * nb] = uint16_t(_mm512_cmpgt_epi32_mask(acc[r], offset));
}

YOSO_VNNI void hash_vnni(const float* x, int64_t ldx, int64_t rows, int64_t d, const PackedPlanes& pp,
                         int64_t head, int64_t m, int bits, int32_t* codes, int64_t code_stride) {
  const int64_t dpad = pp.dpad, groups = pp.cols16 / 16, nb = groups + 1;
  thread_local std::vector<uint8_t> u;
  thread_local std::vector<uint16_t> sign_bits;
  u.resize(rows * dpad);
  sign_bits.assign(rows * nb, 0);
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_ahead(x, ldx, r, rows, d);  // timed on AVX2 only (quantize_rows_ahead)
    quantize_u8_vnni(x + r * ldx, d, dpad, u.data() + r * dpad);
  }
  const int8_t* w = pp.w + head * pp.cols16 * dpad;
  const int32_t* off = pp.offset + head * pp.cols16;
  constexpr int kRows = 8;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* wg = w + g * dpad * 16;
    const __m512i o = _mm512_loadu_si512(off + g * 16);
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) tile_i8<kRows>(u.data() + r * dpad, dpad, wg, o, &sign_bits[r * nb + g], nb);
    const uint8_t* ur = u.data() + r * dpad;
    uint16_t* br = &sign_bits[r * nb + g];
    switch (rows - r) {
      case 7: tile_i8<7>(ur, dpad, wg, o, br, nb); break;
      case 6: tile_i8<6>(ur, dpad, wg, o, br, nb); break;
      case 5: tile_i8<5>(ur, dpad, wg, o, br, nb); break;
      case 4: tile_i8<4>(ur, dpad, wg, o, br, nb); break;
      case 3: tile_i8<3>(ur, dpad, wg, o, br, nb); break;
      case 2: tile_i8<2>(ur, dpad, wg, o, br, nb); break;
      case 1: tile_i8<1>(ur, dpad, wg, o, br, nb); break;
      default: break;
    }
  }
  const uint32_t low = (1u << bits) - 1;
  for (int64_t h = 0; h < m; ++h) {  // hash-major, as pack_avx2
    const int64_t g = h * bits / 16, shift = h * bits % 16;
    int32_t* out = codes + h * code_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t two = uint32_t(sign_bits[r * nb + g]) | uint32_t(sign_bits[r * nb + g + 1]) << 16;
      out[r] = int32_t((two >> shift) & low);
    }
  }
}
#endif  // YOSO_HAVE_VNNI_BODY

// x8 of one row as floats (the exact integers), as the header defines it.
void quantize_row(const float* x, int64_t d, float* out) {
  float s = 0.f;
  for (int64_t c = 0; c < d; ++c) s = std::max(s, std::fabs(x[c]));
  if (!(s > 0.f)) s = 1.f;
  for (int64_t c = 0; c < d; ++c) out[c] = std::nearbyint((x[c] / s) * 127.f);
}

#ifdef YOSO_HAVE_VNNI_BODY
// quantize_row, 8 lanes at a time: the same max (exact in any order), division, product and rounding to nearest
// even, so the same integers. Built for the baseline, the loop above called libm's nearbyintf per element.
YOSO_AVX2_ROW void quantize_row_avx2(const float* x, int64_t d, float* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)));
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float s = 0.f;
  for (const float lane : lanes) s = std::max(s, lane);
  for (int64_t t = c; t < d; ++t) s = std::max(s, std::fabs(x[t]));
  if (!(s > 0.f)) s = 1.f;
  const __m256 vs = _mm256_set1_ps(s), levels = _mm256_set1_ps(127.f);
  for (c = 0; c + 8 <= d; c += 8) {
    const __m256 q = _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(x + c), vs), levels);
    _mm256_storeu_ps(out + c, _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; c < d; ++c) out[c] = std::nearbyint((x[c] / s) * 127.f);
}
#endif

void quantize_rows_ahead(const float* x, int64_t ldx, int64_t rows, int64_t d, float* out) {
#ifdef YOSO_HAVE_VNNI_BODY
  const bool avx2 = use_avx2();
#else
  constexpr bool avx2 = false;
#endif
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_ahead(x, ldx, r, rows, d);
#ifdef YOSO_HAVE_VNNI_BODY
    if (avx2) {
      quantize_row_avx2(x + r * ldx, d, out + r * d);
      continue;
    }
#endif
    quantize_row(x + r * ldx, d, out + r * d);
  }
}

}  // namespace

bool int8_packs() { return use_vnni(); }

void pack_planes_i8(const float* w, int64_t heads, int64_t d, int64_t cols, int8_t* w8, int32_t* offset) {
  const int64_t dpad = packed_dpad(d), cols16 = packed_cols16(cols);
  std::fill(w8, w8 + heads * cols16 * dpad, int8_t(0));
  std::fill(offset, offset + heads * cols16, 0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < d; ++c)
      for (int64_t j = 0; j < cols; ++j) {
        const int32_t value = int32_t(w[(h * d + c) * cols + j]);
        // (head, group, c / 4, column in group, c % 4)
        w8[((h * cols16 + j / 16 * 16) * dpad) + (c / 4) * 64 + (j % 16) * 4 + c % 4] = int8_t(value);
        offset[h * cols16 + j] += 128 * value;
      }
}

void hash_rows_i8(const float* x, int64_t ldx, int64_t rows, int64_t d, const float* w, const PackedPlanes& packed,
                  int64_t head, int64_t m, int bits, int32_t* codes, int64_t code_stride) {
#ifdef YOSO_HAVE_VNNI_BODY
  if (use_vnni()) return hash_vnni(x, ldx, rows, d, packed, head, m, bits, codes, code_stride);
#endif
  // Other bodies: an fp32 GEMM of the integers (every partial sum an integer below 2^24: exact) and the
  // sign packing of the fp32 hashing.
  const int64_t cols = m * bits, ld = (cols + 15) / 16 * 16 + 16;  // pack_codes reads 16 past a hash
  thread_local std::vector<float> xq, scores;
  xq.resize(rows * d);
  scores.resize(rows * ld);
  quantize_rows_ahead(x, ldx, rows, d, xq.data());
  gemm(xq.data(), d, w + head * d * cols, cols, rows, d, cols, scores.data(), ld, false);
  pack_codes(scores.data(), ld, rows, m, bits, codes, code_stride);
}

const char* int8_level() { return use_vnni() ? "avx512-vnni" : level(); }

}  // namespace yoso::simd
