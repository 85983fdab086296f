// Shared by the YOSO CUDA translation units (yoso_cuda.cu, yoso_cuda_weighted.cu): constants,
// loads, the stable bucket sort and the scratch layout. Everything is internal to each unit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "yoso_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr size_t kStaticSmem = 48 * 1024;  // no opt-in needed on any target
constexpr size_t kWorkspaceBudget = size_t(256) << 20;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

__device__ __forceinline__ bool live(int code, int nb) { return code >= 0 && code < nb; }

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Exclusive prefix sum over a kThreads-thread block; `scratch` holds kWarps ints.
__device__ int block_exclusive_scan(int value, int* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
  for (int off = 1; off < 32; off *= 2) {
    const int up = __shfl_up_sync(kFull, inclusive, off);
    if (lane >= off) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  __syncthreads();
  return before + inclusive - value;
}

// ---- stable bucket sort: per (bh, hash) set, perm lists live keys bucket by bucket in
// increasing index; offsets[b]..offsets[b+1] is bucket b. Masked keys are left out. ----

struct SortArgs {
  const int32_t* codes;  // (bh, m, n)
  int32_t* perm;         // (sets, n)
  int32_t* offsets;      // (sets, nb + 1)
  int32_t* cursors;      // (sets, kWarps, nb) in global memory, or nullptr: shared memory
  int64_t m, n, h0, group;
  int nb;
};

__global__ void __launch_bounds__(kThreads) bucket_sort_kernel(SortArgs a) {
  extern __shared__ int smem_cursors[];
  __shared__ int scan_scratch[kWarps];
  const int64_t set = blockIdx.x, bh = set / a.group, hs = set % a.group;
  const int32_t* codes = a.codes + (bh * a.m + a.h0 + hs) * a.n;
  int32_t* perm = a.perm + set * a.n;
  int32_t* offsets = a.offsets + set * (a.nb + 1);
  int* cnt = a.cursors ? a.cursors + set * kWarps * a.nb : smem_cursors;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int i = threadIdx.x; i < kWarps * a.nb; i += kThreads) cnt[i] = 0;
  __syncthreads();

  // Each warp owns one contiguous chunk of keys, so chunk order is index order.
  const int64_t chunk = ((a.n + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t begin = warp * chunk, end = min64(a.n, begin + chunk);
  int* mine = cnt + warp * a.nb;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t j = base + lane;
    const int c = j < end ? codes[j] : -1;
    const bool ok = live(c, a.nb);
    const unsigned peers = __match_any_sync(kFull, ok ? c : -1);
    if (ok && lane == __ffs(peers) - 1) mine[c] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();

  // Bucket starts (exclusive scan over buckets), then each warp's cursor inside its buckets.
  const int per = (a.nb + kThreads - 1) / kThreads;
  const int b0 = min(a.nb, static_cast<int>(threadIdx.x) * per), b1 = min(a.nb, b0 + per);
  int total = 0;
  for (int b = b0; b < b1; ++b)
    for (int w = 0; w < kWarps; ++w) total += cnt[w * a.nb + b];
  int running = block_exclusive_scan(total, scan_scratch);
  for (int b = b0; b < b1; ++b) {
    offsets[b] = running;
    for (int w = 0; w < kWarps; ++w) {
      const int here = cnt[w * a.nb + b];
      cnt[w * a.nb + b] = running;
      running += here;
    }
  }
  if (threadIdx.x == kThreads - 1) offsets[a.nb] = running;
  __syncthreads();

  for (int64_t base = begin; base < end; base += 32) {
    const int64_t j = base + lane;
    const int c = j < end ? codes[j] : -1;
    const bool ok = live(c, a.nb);
    const unsigned peers = __match_any_sync(kFull, ok ? c : -1);
    if (ok) perm[mine[c] + __popc(peers & ((1u << lane) - 1u))] = static_cast<int32_t>(j);
    __syncwarp();
    if (ok && lane == __ffs(peers) - 1) mine[c] += __popc(peers);
    __syncwarp();
  }
}

const char* launched() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Grid size; 0 (which the launch rejects as an invalid configuration) past CUDA's 2^31 - 1
// blocks, so an oversized problem fails loudly instead of being cut short.
unsigned blocks_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return blocks > 0x7fffffff ? 0u : static_cast<unsigned>(blocks);
}

const char* check_params(const YosoCumulateParams& p) {
  if (p.hash_bits < 1 || p.hash_bits > kYosoMaxHashBits) return "hash_bits must be in 1..16";
  if (p.m < 1) return "number of hashes m must be at least 1";
  if (p.nq >= (int64_t(1) << 31) || p.nk >= (int64_t(1) << 31)) return "Nq and Nk must be below 2^31";
  return nullptr;
}

// Shared-memory cursors of the bucket sort when kWarps rows of 2^tau ints fit.
bool sort_in_smem(int nb) { return size_t(kWarps) * nb * sizeof(int) <= kStaticSmem; }

struct Layout {
  int64_t group = 1;  // hashes per pass
  size_t tables = 0, perm_q = 0, perm_k = 0, offsets = 0, cursors = 0;
  size_t total() const { return tables + perm_q + perm_k + 2 * offsets + cursors; }
};

Layout plan(const YosoCumulateParams& p, bool weighted) {
  const int64_t nb = int64_t(1) << p.hash_bits;
  const bool sorted = weighted || p.deterministic;
  auto sized = [&](int64_t g) {
    Layout l;
    l.group = g;
    const int64_t sets = p.bh * g;
    if (!weighted) l.tables = align256(size_t(sets) * nb * p.dv * sizeof(float));
    if (sorted) {
      l.perm_k = align256(size_t(sets) * p.nk * sizeof(int32_t));
      l.perm_q = weighted ? align256(size_t(sets) * p.nq * sizeof(int32_t)) : 0;
      l.offsets = align256(size_t(sets) * (nb + 1) * sizeof(int32_t));
      l.cursors = sort_in_smem(static_cast<int>(nb)) ? 0 : align256(size_t(sets) * kWarps * nb * sizeof(int32_t));
    }
    return l;
  };
  const size_t one = std::max<size_t>(sized(1).total(), 1);
  return sized(std::max<int64_t>(1, std::min<int64_t>(p.m, kWorkspaceBudget / one)));
}

const char* sort_codes(const int32_t* codes, int64_t bh, int64_t m, int64_t n, int64_t h0, int64_t group, int nb,
                       int32_t* perm, int32_t* offsets, int32_t* cursors, cudaStream_t stream) {
  const SortArgs a{codes, perm, offsets, cursors, m, n, h0, group, nb};
  const size_t smem = cursors ? 0 : size_t(kWarps) * nb * sizeof(int);
  bucket_sort_kernel<<<blocks_for(bh * group, 1), kThreads, smem, stream>>>(a);
  return launched();
}

}  // namespace
