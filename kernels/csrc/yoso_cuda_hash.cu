// YOSO hash codes on CUDA (launchers declared in yoso_cuda.h). Design notes: docs/cuda.md.
//
// The Gaussian family is one GEMM (torch.matmul / cuBLAS on the Python side) and then
// hash_pack_kernel, which turns the m*tau projections of a row into m packed codes. The fast
// family runs H.D3.H.D2.H.D1 per (row, hash): in one thread's registers up to P = 64, else in
// one warp on shared memory. Int8 hashing up to D = 64 quantizes, projects and packs a row in one
// thread's registers (no scores in memory); wider heads take the GEMM.

#include <cmath>

#include "yoso_cuda.h"
#include "yoso_cuda_launch.cuh"

namespace {

__global__ void hash_pack_kernel(const float* proj, int32_t* codes, int64_t bh_count, int64_t n, int64_t m, int tau) {
  const int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (idx >= bh_count * m * n) return;
  const int64_t i = idx % n, h = (idx / n) % m, bh = idx / (n * m);
  const float* row = proj + ((bh * n + i) * m + h) * tau;
  int32_t code = 0;
  for (int t = 0; t < tau; ++t) code |= int32_t(row[t] > 0.f) << t;
  codes[idx] = code;
}

constexpr int kRotateWarps = 4;
constexpr int kRotateThreads = 128;    // the register kernels: one thread per (row, group of hashes)
constexpr int kHashesPerThread = 8;    // hashes one thread runs on its row, which stays in registers
constexpr int kMaxRegisterRotateDim = 64;

// Round-to-nearest products and sums that the compiler may not fuse (on the host, where the
// tests check rotate_code against the Python reference, the products by ±1 are exact anyway).
__host__ __device__ inline float rn_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ inline float rn_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__host__ __device__ inline float rn_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// H.D3.H.D2.H.D1 of one padded row, as the warp kernel below computes it (the same products and
// butterflies in the same order, never contracted into FMAs, so the same bits), but in one
// thread's registers: P is a compile-time constant, so every index below is one after unrolling.
template <int P>
__host__ __device__ inline int32_t rotate_code(const float (&x)[P], const float* sg, int tau) {
  float y[P];
  YOSO_UNROLL
  for (int k = 0; k < P; ++k) y[k] = x[k];
  YOSO_UNROLL
  for (int r = 0; r < 3; ++r) {
    YOSO_UNROLL
    for (int k = 0; k < P; ++k) y[k] = rn_mul(y[k], sg[r * P + k]);
    YOSO_UNROLL
    for (int half = 1; half < P; half *= 2) {
      YOSO_UNROLL
      for (int q = 0; q < P / 2; ++q) {
        const int j = (q / half) * 2 * half + q % half;
        const float lo = y[j], hi = y[j + half];
        y[j] = rn_add(lo, hi);
        y[j + half] = rn_sub(lo, hi);
      }
    }
  }
  int32_t code = 0;
  YOSO_UNROLL
  for (int t = 0; t < (P < kYosoMaxHashBits ? P : kYosoMaxHashBits); ++t)
    if (t < tau) code |= int32_t(y[t] > 0.f) << t;
  return code;
}

// One thread per (row, group of kHashesPerThread hashes); rows fastest, so a warp's code writes
// are contiguous and its sign loads (one head, one hash) are broadcasts.
template <int P>
__host__ __device__ inline void rotate_item(int64_t item, const float* x, const float* signs, int32_t* codes,
                                            int64_t bh_count, int64_t heads, int64_t n, int64_t d, int64_t m, int tau) {
  const int64_t groups = (m + kHashesPerThread - 1) / kHashesPerThread;
  if (item >= bh_count * groups * n) return;
  const int64_t i = item % n, g = (item / n) % groups, bh = item / (n * groups);  // (bh, group, i), i fastest
  const float* row = x + (bh * n + i) * d;
  float xr[P];
  YOSO_UNROLL
  for (int k = 0; k < P; ++k) xr[k] = k < d ? row[k] : 0.f;
  const int64_t h_end = (g + 1) * kHashesPerThread < m ? (g + 1) * kHashesPerThread : m;
  for (int64_t h = g * kHashesPerThread; h < h_end; ++h) {
    const float* sg = signs + ((bh % heads) * m + h) * 3 * P;
    codes[(bh * m + h) * n + i] = rotate_code<P>(xr, sg, tau);
  }
}

__host__ __device__ inline float rn_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
__host__ __device__ inline float round_half_even(float a) {
#ifdef __CUDA_ARCH__
  return rintf(a);
#else
  return std::nearbyint(a);  // the default rounding mode: to nearest, ties to even
#endif
}

// x8 = round((x / s) * 127), s = max|x| (1 where that is not > 0): hashing.quantize_rows' fp32 division,
// product and round half to even, and the CPU kernels' quantize_row (a NaN is skipped by the max, as there).
template <int P>
__host__ __device__ inline void quantize_row(const float* row, int64_t d, float (&x8)[P]) {
  float s = 0.f;
  YOSO_UNROLL
  for (int c = 0; c < P; ++c)
    if (c < d) {
      const float a = fabsf(row[c]);
      s = a > s ? a : s;
    }
  if (!(s > 0.f)) s = 1.f;
  YOSO_UNROLL
  for (int c = 0; c < P; ++c) x8[c] = c < d ? round_half_even(rn_mul(rn_div(row[c], s), 127.f)) : 0.f;
}

// One thread per (row, group of kHashesPerThread hashes), rows fastest (as rotate_item): the row is
// quantized once into registers, then bit t of hash h is [sum_c x8[c] * w[c][h * tau + t] > 0]. Every
// product and partial sum is an integer below 127 * 127 * 64 < 2^24, so the fp32 sums (fused or not,
// in any order) are exact: the codes equal hashing.hash_codes(int8=True)'s, whose GEMM sums the same
// integers. planes (heads, d, m * tau) fp32 integers in [-127, 127]; row bh uses head bh % heads.
template <int P>
__host__ __device__ inline void int8_hash_item(int64_t item, const float* x, const float* planes, int32_t* codes,
                                               int64_t bh_count, int64_t heads, int64_t n, int64_t d, int64_t m,
                                               int tau) {
  const int64_t groups = (m + kHashesPerThread - 1) / kHashesPerThread;
  if (item >= bh_count * groups * n) return;
  const int64_t i = item % n, g = (item / n) % groups, bh = item / (n * groups);  // (bh, group, i), i fastest
  float x8[P];
  quantize_row<P>(x + (bh * n + i) * d, d, x8);
  const int64_t cols = m * tau;
  const float* w = planes + (bh % heads) * d * cols;
  const int64_t h_end = (g + 1) * kHashesPerThread < m ? (g + 1) * kHashesPerThread : m;
  for (int64_t h = g * kHashesPerThread; h < h_end; ++h) {
    float acc[kYosoMaxHashBits];
    YOSO_UNROLL
    for (int t = 0; t < kYosoMaxHashBits; ++t) acc[t] = 0.f;
    const float* wc = w + h * tau;  // row c of the planes, hash h's tau columns (one pointer, bumped)
    YOSO_UNROLL
    for (int c = 0; c < P; ++c) {
      if (c < d) {
        YOSO_UNROLL
        for (int t = 0; t < kYosoMaxHashBits; ++t)
          if (t < tau) acc[t] += x8[c] * wc[t];
      }
      wc += cols;
    }
    int32_t code = 0;
    YOSO_UNROLL
    for (int t = 0; t < kYosoMaxHashBits; ++t)
      if (t < tau) code |= int32_t(acc[t] > 0.f) << t;
    codes[(bh * m + h) * n + i] = code;
  }
}

// The register kernels, one thread per (row, group of kHashesPerThread hashes): Item is
// rotate_item<P> or int8_hash_item<P>, whose arguments are the same but for what `table` holds
// (the rotation's signs, or the int8 planes).
using HashItem = void (*)(int64_t, const float*, const float*, int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int);

template <HashItem Item>
__global__ void __launch_bounds__(kRotateThreads)
    hash_groups_kernel(const float* x, const float* table, int32_t* codes, int64_t bh_count, int64_t heads, int64_t n,
                       int64_t d, int64_t m, int tau) {
  Item(blockIdx.x * int64_t(kRotateThreads) + threadIdx.x, x, table, codes, bh_count, heads, n, d, m, tau);
}

template <HashItem Item>
void launch_hash_groups(const float* x, const float* table, int32_t* codes, int64_t bh, int64_t heads, int64_t n,
                        int64_t d, int64_t m, int tau, cudaStream_t stream) {
  const int64_t groups = (m + kHashesPerThread - 1) / kHashesPerThread;
  hash_groups_kernel<Item><<<blocks_for(bh * groups * n, kRotateThreads), kRotateThreads, 0, stream>>>(
      x, table, codes, bh, heads, n, d, m, tau);
}

// One warp per (row, hash); the padded vector lives in shared memory. __fmul_rn/__fadd_rn/
// __fsub_rn are never contracted into FMAs, so each value sees the same roundings as on CPU.
__global__ void __launch_bounds__(kRotateWarps * 32)
    hash_rotate_kernel(const float* x, const float* signs, int32_t* codes, int64_t bh_count, int64_t heads,
                       int64_t n, int64_t d, int64_t m, int p, int tau) {
  extern __shared__ float rot[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t item = blockIdx.x * int64_t(kRotateWarps) + warp;  // (bh, i, h), h fastest
  if (item >= bh_count * n * m) return;  // warp-uniform: the warp only syncs itself
  const int64_t h = item % m, i = (item / m) % n, bh = item / (m * n);
  float* y = rot + warp * p;
  const float* row = x + (bh * n + i) * d;
  const float* sg = signs + ((bh % heads) * m + h) * 3 * p;
  for (int k = lane; k < p; k += 32) y[k] = k < d ? row[k] : 0.f;
  for (int r = 0; r < 3; ++r) {
    __syncwarp();
    for (int k = lane; k < p; k += 32) y[k] = __fmul_rn(y[k], sg[r * p + k]);
    for (int half = 1; half < p; half *= 2) {
      __syncwarp();
      for (int q = lane; q < p / 2; q += 32) {
        const int j = (q / half) * 2 * half + q % half;
        const float lo = y[j], hi = y[j + half];
        y[j] = __fadd_rn(lo, hi);
        y[j + half] = __fsub_rn(lo, hi);
      }
    }
  }
  __syncwarp();
  const unsigned bits = __ballot_sync(kFull, lane < tau && y[lane] > 0.f);
  if (lane == 0) codes[(bh * m + h) * n + i] = static_cast<int32_t>(bits & ((1u << tau) - 1u));
}

}  // namespace

const char* yoso_hash_pack(const float* proj, int32_t* codes, int64_t bh, int64_t n, int64_t m, int hash_bits,
                           cudaStream_t stream) {
  if (hash_bits < 1 || hash_bits > kYosoMaxHashBits) return "hash_bits must be in 1..16";
  if (bh * m * n == 0) return nullptr;
  hash_pack_kernel<<<blocks_for(bh * m * n, kThreads), kThreads, 0, stream>>>(proj, codes, bh, n, m, hash_bits);
  return launched();
}

const char* yoso_hash_rotate(const float* x, const float* signs, int32_t* codes, int64_t bh, int64_t heads,
                             int64_t n, int64_t d, int64_t m, int64_t p, int hash_bits, cudaStream_t stream) {
  if (hash_bits < 1 || hash_bits > kYosoMaxHashBits) return "hash_bits must be in 1..16";
  if (p > kYosoMaxRotateDim) return "padded dimension P = next power of two >= max(D, hash_bits) must be <= 2048";
  if (p < d || p < hash_bits || (p & (p - 1)) != 0) return "P must be a power of two >= max(D, hash_bits)";
  if (heads < 1 || bh % heads != 0) return "batch*heads must be a multiple of the heads in signs";
  if (bh * m * n == 0) return nullptr;
  // Up to P = 64 (head dimensions up to 64) a thread holds the row in registers: one warp per
  // (row, hash) on shared memory spent 87 ms of a 96 ms YOSO-32 forward at N = 65536 on an H100.
  switch (p) {
    case 1: launch_hash_groups<rotate_item<1>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    case 2: launch_hash_groups<rotate_item<2>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    case 4: launch_hash_groups<rotate_item<4>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    case 8: launch_hash_groups<rotate_item<8>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    case 16: launch_hash_groups<rotate_item<16>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    case 32: launch_hash_groups<rotate_item<32>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    case 64: launch_hash_groups<rotate_item<64>>(x, signs, codes, bh, heads, n, d, m, hash_bits, stream); return launched();
    default: break;  // P > kMaxRegisterRotateDim: the warp kernel below
  }
  static_assert(kMaxRegisterRotateDim == 64, "the switch above instantiates P up to 64");
  const size_t smem = size_t(kRotateWarps) * p * sizeof(float);
  hash_rotate_kernel<<<blocks_for(bh * n * m, kRotateWarps), kRotateWarps * 32, smem, stream>>>(
      x, signs, codes, bh, heads, n, d, m, static_cast<int>(p), hash_bits);
  return launched();
}

const char* yoso_hash_int8(const float* x, const float* planes, int32_t* codes, int64_t bh, int64_t heads, int64_t n,
                           int64_t d, int64_t m, int hash_bits, cudaStream_t stream) {
  if (hash_bits < 1 || hash_bits > kYosoMaxHashBits) return "hash_bits must be in 1..16";
  if (d < 1 || d > kYosoMaxInt8KernelDim) return "the int8 hash kernel takes head dimensions D in 1..64";
  if (heads < 1 || bh % heads != 0) return "batch*heads must be a multiple of the heads in planes";
  if (bh * m * n == 0) return nullptr;
  if (d <= 16) {
    launch_hash_groups<int8_hash_item<16>>(x, planes, codes, bh, heads, n, d, m, hash_bits, stream);
  } else if (d <= 32) {
    launch_hash_groups<int8_hash_item<32>>(x, planes, codes, bh, heads, n, d, m, hash_bits, stream);
  } else {
    static_assert(kYosoMaxInt8KernelDim == 64, "the int8 kernel is instantiated for D up to 16, 32 and 64");
    launch_hash_groups<int8_hash_item<64>>(x, planes, codes, bh, heads, n, d, m, hash_bits, stream);
  }
  return launched();
}
