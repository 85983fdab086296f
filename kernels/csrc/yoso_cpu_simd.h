// Block primitives of the YOSO CPU kernels (yoso_cpu_simd.cpp): a small GEMM, sign-bit packing
// and the collision probability with its slopes; int8 hashing (yoso_cpu_simd_i8.cpp). Each call does a whole block (thousands of
// multiply-adds), so the one indirect call per block costs nothing; the bodies are AVX2+FMA
// when the CPU has it (checked once) and portable loops otherwise.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace yoso::simd {

// c (rows, n) = a (rows, k) @ b (k, n), or += when accumulate; row strides lda, ldb, ldc.
// Every c[i][j] is summed over p = 0..k-1 in order, one FMA chain, whatever rows and n are.
void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t k, int64_t n, float* c,
          int64_t ldc, bool accumulate);

// codes[h * code_stride + r] = sum_t 2^t [scores[r * ld + h * bits + t] > 0] for r < rows, h < m.
void pack_codes(const float* scores, int64_t ld, int64_t rows, int64_t m, int bits, int32_t* codes,
                int64_t code_stride);

// In place over n cosines c: weight = (1 - arccos(clamp(c))/pi)^tau * keep[j] (keep may be null).
// When slope is given it receives d weight / dc (true_grad: tau (1 - theta/pi)^(tau-1) keep /
// (pi max(sin theta, min_sine))) or the paper's bound tau/2 * weight.
void collision_weights(float* c, float* slope, const float* keep, int64_t n, int tau, bool true_grad,
                       float min_sine);

// For each of rows output rows r: out[r] = (out[r] + sum_t rows[r * count + t]) * scale, the
// sum taken in t order over the non-null table rows (dv floats each); out row stride ldo.
void gather_rows(const float* const* rows, int64_t nrows, int64_t count, int64_t dv, float* out, int64_t ldo,
                 float scale);

// Int8 hashing. A row x of d floats is quantized to x8 = round((x / max|x|) * 127) (round half to even;
// a zero row stays zero), and bit t of hash h is [sum_c x8[c] * w[c][h * bits + t] > 0], summed exactly
// in integers; w (d, m * bits) holds integers in [-127, 127] as floats (the quantized planes).
// The VNNI body reads every head's w packed once (pack_planes_i8: the binding caches it per projection):
// w8 (heads, cols16 / 16, dpad / 4, 16, 4) bytes and offset (heads, cols16) = 128 * column sums (its u8
// inputs are x8 + 128). Other bodies read w itself and need no packing (int8_packs() false).
struct PackedPlanes {
  const int8_t* w = nullptr;
  const int32_t* offset = nullptr;
  int64_t dpad = 0, cols16 = 0;  // d rounded up to 4, m * bits rounded up to 16
};
bool int8_packs();
inline int64_t packed_dpad(int64_t d) { return (d + 3) / 4 * 4; }
inline int64_t packed_cols16(int64_t cols) { return (cols + 15) / 16 * 16; }
// w8 and offset as above, sized (heads * cols16 * dpad) and (heads * cols16).
void pack_planes_i8(const float* w, int64_t heads, int64_t d, int64_t cols, int8_t* w8, int32_t* offset);

// codes[h * code_stride + r] for rows r < rows of x (row stride ldx), hashed as above with head `head`
// of `w` (heads, d, m * bits) / `packed`. Every body gives the same codes (exact integer sums).
void hash_rows_i8(const float* x, int64_t ldx, int64_t rows, int64_t d, const float* w, const PackedPlanes& packed,
                  int64_t head, int64_t m, int bits, int32_t* codes, int64_t code_stride);

// Which body hash_rows_i8 runs: "avx512-vnni", "avx2" (an exact fp32 GEMM of the integers) or "portable".
const char* int8_level();

// Largest |arccos error| of the polynomial used above, in radians (Abramowitz & Stegun 4.4.46).
constexpr double kArccosMaxError = 2e-8;

// x (count bf16 values: each the top 16 bits of an fp32) -> to (count fp32), exactly.
inline void widen_bf16(const uint16_t* x, int64_t count, float* to) {
  for (int64_t c = 0; c < count; ++c) {
    const uint32_t bits = uint32_t(x[c]) << 16;
    std::memcpy(to + c, &bits, sizeof bits);
  }
}

// fp32 -> bf16 bits, rounded to nearest with ties to even as c10::BFloat16 does (a NaN becomes its quiet NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// x (count fp32) -> to (count bf16 bits), each rounded by bf16_bits (yoso_cpu_quant.cpp, SIMD clones).
void to_bf16(const float* x, int64_t count, uint16_t* to);

// Exact mode from bf16 rows, with AVX-512 BF16 dot products (vdpbf16ps: each product exact in fp32, summed in fp32);
// only where bf16_dots() (the CPU has them, and neither YOSO_CPU_PORTABLE=1 nor YOSO_CPU_NO_BF16_DOT=1 is set).
bool bf16_dots();
// c[r][j] = (sum_p q[r][2p] k[j][2p] + q[r][2p+1] k[j][2p+1]) * ik[j] * iq[r] for r < rows, j < cols: q (rows,
// 2 * pairs) bf16 bits with row stride ldq, the keys packed in pairs kp (pairs, ldk), kp[p][j] = k[j][2p] |
// k[j][2p+1] << 16. The sum runs over the pairs in order, one lane each, so c[r][j] depends on neither rows nor cols.
void cosines_bf16(const uint16_t* q, int64_t ldq, const float* iq, const uint32_t* kp, int64_t ldk, const float* ik,
                  int64_t rows, int64_t pairs, int64_t cols, float* c, int64_t ldc);
// For rows of x (2 * pairs bf16 bits, row stride ldx): inv[r] = 1 / max(|x_r|, 1e-12), the squares summed by the
// same dot products, and, when kp is given, kp[p * ldk + r] the row's pair p as cosines_bf16 reads keys.
void prepare_bf16_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t pairs, float* inv, uint32_t* kp,
                       int64_t ldk);

// A head's rows of q, k or v are its slice of each token's Q/K/V output, thousands of bytes apart, and the first read
// of each waited on memory: a quarter of exact mode's time at 16 x 128 tokens (AMD EPYC Zen 3, perf). So the loops
// that read them row by row ask for the row kRowsAhead ahead: prefetch_ahead(x, ld, row, rows, count) asks for every
// 64-byte line of row + kRowsAhead of x (row stride ld, count elements), where that row is below rows.
constexpr int64_t kRowsAhead = 8;

template <typename T>
inline void prefetch_ahead(const T* x, int64_t ld, int64_t row, int64_t rows, int64_t count) {
  if (row + kRowsAhead >= rows) return;
  const char* p = reinterpret_cast<const char*>(x + (row + kRowsAhead) * ld);
  for (int64_t off = 0; off < count * int64_t(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// Which bodies run: "avx2" or "portable" (YOSO_CPU_PORTABLE=1 in the environment forces the latter).
const char* level();

// Whether the AVX2 bodies run (level() is "avx2").
bool use_avx2();

// Whether the environment sets name to exactly "1" (the YOSO_CPU_* switches the tests use to pick bodies).
bool env_flag(const char* name);

}  // namespace yoso::simd
