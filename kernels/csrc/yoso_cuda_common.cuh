// Shared by the YOSO CUDA translation units (yoso_cuda.cu, yoso_cuda_weighted.cu): constants,
// loads, the stable bucket sort and the scratch layout. Everything is internal to each unit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "yoso_cuda.h"
#include "yoso_cuda_launch.cuh"

namespace {

constexpr int kWarps = kThreads / 32;
constexpr size_t kStaticSmem = 48 * 1024;  // no opt-in needed on any target
constexpr size_t kWorkspaceBudget = size_t(256) << 20;  // scratch per call, unless one row needs more

__host__ __device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__host__ __device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__host__ __device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

__host__ __device__ __forceinline__ bool live(int64_t code, int nb) { return code >= 0 && code < nb; }

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int min32(int a, int b) { return a < b ? a : b; }

// ---- block code written once for the GPU and for a CPU emulation of one block ----
// A block-level routine is a sequence of phases separated by block_sync(). On the GPU each_thread
// runs the phase for this thread and block_sync is __syncthreads; compiled for the host, each_thread
// runs the phase for every thread index in turn and block_sync does nothing, which is the same
// computation for race-free code. Tests drive the host form on the CPU (tests/kernels/test_cuda_block.py).
__host__ __device__ __forceinline__ void block_sync() {
#ifdef __CUDA_ARCH__
  __syncthreads();
#endif
}

template <class F>
__host__ __device__ __forceinline__ void each_thread(F&& phase) {
#ifdef __CUDA_ARCH__
  phase(static_cast<int>(threadIdx.x));
#else
  for (int t = 0; t < kThreads; ++t) phase(t);
#endif
}

// What a thread keeps across barriers: its registers on the GPU, one copy per thread index in the
// emulation. Only ever a local variable, so the two layouts never meet.
template <class S>
struct PerThread {
#ifdef __CUDA_ARCH__
  S one;
  __device__ __forceinline__ S& operator[](int) { return one; }
#else
  S all[kThreads];
  S& operator[](int t) { return all[t]; }
#endif
};

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

const char* check_params(const YosoCumulateParams& p) {
  if (p.hash_bits < 1 || p.hash_bits > kYosoMaxHashBits) return "hash_bits must be in 1..16";
  if (p.m < 1) return "number of hashes m must be at least 1";
  if (p.nq >= (int64_t(1) << 31) || p.nk >= (int64_t(1) << 31)) return "Nq and Nk must be below 2^31";
  return nullptr;
}

// Shared-memory cursors of the bucket sort when kWarps rows of 2^tau ints fit.
bool sort_in_smem(int64_t nb) { return size_t(kWarps) * nb * sizeof(int) <= kStaticSmem; }

constexpr int kMinSmemCols = 8;  // narrower shared-memory tables lose to the sorted build

// Columns per block of the shared-memory table build (2^tau rows of them fit kStaticSmem), or 0
// when a useful chunk does not fit (tau >= 11 at D = 64): the sorted build is used then.
int smem_table_cols(int64_t dv, int64_t nb) {
  const int64_t fit = std::min<int64_t>(dv, kStaticSmem / (sizeof(float) * nb));
  if (fit >= 32) return static_cast<int>(fit / 32 * 32);
  return fit >= std::min<int64_t>(dv, kMinSmemCols) ? static_cast<int>(fit) : 0;
}

// Scratch of one pass: `rows` batch*head rows times `group` hashes ("sets").
struct Layout {
  int64_t group = 1;       // hashes per pass
  int64_t rows = 1;        // batch*head rows per pass
  int64_t table_rows = 0;  // rows of one bucket table: 2^tau, or Nk when packed (forward only)
  bool sorted = false;     // tables by the bucket sort (no atomics), or in shared memory
  bool packed = false;     // sorted tables with Nk < 2^tau: a bucket's row is its start in perm
  size_t tables = 0, perm_q = 0, perm_k = 0, offsets_q = 0, offsets_k = 0, cursors = 0;
  size_t total() const { return tables + perm_q + perm_k + offsets_q + offsets_k + cursors; }
};

// The hashes per pass come from the shapes alone (Nq, Nk, Dv, tau, m), never from batch*heads:
// the gather sums each group's hashes in registers and adds groups in order, so the grouping
// decides the float rounding, and a row must get the same bits alone or in any batch. The
// budget is then met by taking fewer batch*head rows per pass (rows are independent).
Layout plan(const YosoCumulateParams& p, bool weighted) {
  const int64_t nb = int64_t(1) << p.hash_bits;
  const bool sorted = weighted || p.deterministic || smem_table_cols(p.dv, nb) == 0;
  const bool packed = !weighted && sorted && p.nk < nb;
  auto sized = [&](int64_t rows, int64_t g) {
    Layout l;
    l.rows = rows;
    l.group = g;
    l.sorted = sorted;
    l.packed = packed;
    const size_t sets = size_t(rows * g);
    if (!weighted) {
      l.table_rows = packed ? p.nk : nb;  // Nk >= 1 here: the launcher returns early for Nk = 0
      l.tables = align256(sets * l.table_rows * p.dv * sizeof(float));
    }
    if (sorted) {
      l.perm_k = align256(sets * p.nk * sizeof(int32_t));
      l.offsets_k = align256(sets * (nb + 1) * sizeof(int32_t));
      if (weighted) {
        l.perm_q = align256(sets * p.nq * sizeof(int32_t));
        l.offsets_q = l.offsets_k;
      }
      l.cursors = sort_in_smem(nb) ? 0 : align256(sets * kWarps * nb * sizeof(int32_t));
    }
    return l;
  };
  const size_t per_set = std::max<size_t>(sized(1, 1).total(), 1);
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(p.m, kWorkspaceBudget / per_set));
  const size_t per_row = std::max<size_t>(sized(1, group).total(), 1);
  const int64_t rows = std::min<int64_t>(p.bh, std::max<int64_t>(1, kWorkspaceBudget / per_row));
  return sized(rows, group);
}

YosoPlan describe(const Layout& l) { return YosoPlan{l.group, l.rows, l.table_rows, l.sorted, l.total()}; }

// The params of batch*head rows [r0, r0 + count): every tensor is (bh, ...) contiguous.
YosoCumulateParams rows_of(const YosoCumulateParams& p, int64_t r0, int64_t count, size_t elem) {
  YosoCumulateParams s = p;
  s.q_codes += r0 * p.m * p.nq;
  s.k_codes += r0 * p.m * p.nk;
  s.v = static_cast<const char*>(p.v) + r0 * p.nk * p.dv * elem;
  if (p.q_w) s.q_w = static_cast<const char*>(p.q_w) + r0 * p.nq * p.dw * elem;
  if (p.k_w) s.k_w = static_cast<const char*>(p.k_w) + r0 * p.nk * p.dw * elem;
  s.out += r0 * p.nq * p.dv;
  s.bh = count;
  return s;
}

const char* sort_codes(const int32_t* codes, int64_t bh, int64_t m, int64_t n, int64_t h0, int64_t group, int nb,
                       int32_t* perm, int32_t* offsets, int32_t* cursors, cudaStream_t stream) {
  const SortArgs a{codes, perm, offsets, cursors, m, n, h0, group, nb};
  const size_t smem = cursors ? 0 : size_t(kWarps) * nb * sizeof(int);
  bucket_sort_kernel<<<blocks_for(bh * group, 1), kThreads, smem, stream>>>(a);
  return launched();
}

}  // namespace
