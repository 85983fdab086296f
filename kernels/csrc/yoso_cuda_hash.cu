// YOSO hash codes on CUDA (launchers declared in yoso_cuda.h). Design notes: docs/cuda.md.
//
// The Gaussian family is one GEMM (torch.matmul / cuBLAS on the Python side) and then
// hash_pack_kernel, which turns the m*tau projections of a row into m packed codes. The fast
// family runs H.D3.H.D2.H.D1 per (row, hash) in one warp, on shared memory.

#include "yoso_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

const char* launched() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

unsigned blocks_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return blocks > 0x7fffffff ? 0u : static_cast<unsigned>(blocks);
}

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
  const size_t smem = size_t(kRotateWarps) * p * sizeof(float);
  hash_rotate_kernel<<<blocks_for(bh * n * m, kRotateWarps), kRotateWarps * 32, smem, stream>>>(
      x, signs, codes, bh, heads, n, d, m, static_cast<int>(p), hash_bits);
  return launched();
}
