// YOSO LSH cumulation on CUDA (the forward, and grad V by the role-swapped call).
// Design notes: docs/cuda.md.
//
//   out[i] = (1/m) sum_h sum_j [k_codes[h,j] == q_codes[h,i]] v[j]
//
// Per group of hashes that fits the scratch budget:
//   1. bucket tables T[bh, h, code, :] = sum of v over the keys with that code, built
//      - in shared memory with shared atomics when 2^tau rows of a column chunk fit, else
//      - in global memory with global atomics, or
//      - (deterministic) by a stable bucket sort of the keys and an in-order sum per bucket;
//   2. a gather: one warp per query sums T[bh, h, q_code[h], :] over the group's hashes in
//      increasing h — no atomics, every output row has one writer.
// The weighted cumulation is in yoso_cuda_weighted.cu, the hash codes in yoso_cuda_hash.cu.

#include "yoso_cuda_common.cuh"

namespace {

constexpr int kMinSmemCols = 8;  // narrower shared-memory tables lose to global atomics

// ---- forward: bucket tables (sets, nb, dv) fp32 ----

struct TableArgs {
  const int32_t* k_codes;
  const void* v;
  float* tables;
  const int32_t* perm;     // deterministic build only
  const int32_t* offsets;  // deterministic build only
  int64_t m, nk, dv, h0, group, sets;
  int nb, chunk;  // chunk: table columns per block (shared-memory build)
};

template <typename T>
__global__ void __launch_bounds__(kThreads) table_smem_kernel(TableArgs a) {
  extern __shared__ float tab[];
  const int64_t chunks = (a.dv + a.chunk - 1) / a.chunk;
  const int64_t set = blockIdx.x / chunks, d0 = (blockIdx.x % chunks) * a.chunk;
  const int64_t bh = set / a.group, hs = set % a.group;
  const int width = static_cast<int>(min64(a.chunk, a.dv - d0));
  const int32_t* codes = a.k_codes + (bh * a.m + a.h0 + hs) * a.nk;
  const T* v = static_cast<const T*>(a.v) + bh * a.nk * a.dv + d0;
  for (int i = threadIdx.x; i < a.nb * width; i += kThreads) tab[i] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t base = int64_t(warp) * 32; base < a.nk; base += kThreads) {
    const int mine = base + lane < a.nk ? codes[base + lane] : -1;
    const int count = static_cast<int>(min64(32, a.nk - base));
#pragma unroll 4
    for (int t = 0; t < count; ++t) {
      const int c = __shfl_sync(kFull, mine, t);
      if (!live(c, a.nb)) continue;
      for (int d = lane; d < width; d += 32) atomicAdd(&tab[c * width + d], load(v, (base + t) * a.dv + d));
    }
  }
  __syncthreads();
  float* out = a.tables + set * a.nb * a.dv + d0;
  for (int i = threadIdx.x; i < a.nb * width; i += kThreads) out[int64_t(i / width) * a.dv + i % width] = tab[i];
}

template <typename T>
__global__ void __launch_bounds__(kThreads) table_global_kernel(TableArgs a) {
  const int64_t total = a.sets * a.nk * a.dv;
  for (int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t d = idx % a.dv, j = (idx / a.dv) % a.nk, set = idx / (a.dv * a.nk);
    const int64_t bh = set / a.group, hs = set % a.group;
    const int c = a.k_codes[(bh * a.m + a.h0 + hs) * a.nk + j];
    if (!live(c, a.nb)) continue;
    atomicAdd(&a.tables[(set * a.nb + c) * a.dv + d], load(static_cast<const T*>(a.v), (bh * a.nk + j) * a.dv + d));
  }
}

// One warp per bucket sums its keys in sorted (= index) order: no atomics, fixed order.
template <typename T>
__global__ void __launch_bounds__(kThreads) table_sorted_kernel(TableArgs a) {
  const int64_t blocks_per_set = (a.nb + kWarps - 1) / kWarps;
  const int64_t set = blockIdx.x / blocks_per_set, bh = set / a.group;
  const int b = static_cast<int>((blockIdx.x % blocks_per_set) * kWarps + threadIdx.x / 32);
  if (b >= a.nb) return;
  const int32_t* perm = a.perm + set * a.nk;
  const int32_t* off = a.offsets + set * (a.nb + 1);
  const T* v = static_cast<const T*>(a.v) + bh * a.nk * a.dv;
  float* row = a.tables + (set * a.nb + b) * a.dv;
  for (int64_t d = threadIdx.x % 32; d < a.dv; d += 32) {
    float acc = 0.f;
    for (int p = off[b]; p < off[b + 1]; ++p) acc += load(v, int64_t(perm[p]) * a.dv + d);
    row[d] = acc;
  }
}

// One warp per query: out = (first group ? 0 : out) + scale * sum over the group's hashes.
__global__ void __launch_bounds__(kThreads) gather_kernel(const int32_t* q_codes, const float* tables, float* out,
                                                          int64_t bh_count, int64_t m, int64_t nq, int64_t dv,
                                                          int64_t h0, int64_t group, int nb, float scale,
                                                          bool first) {
  const int64_t row = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  if (row >= bh_count * nq) return;
  const int64_t bh = row / nq, i = row % nq;
  const int lane = threadIdx.x % 32;
  const int32_t* codes = q_codes + (bh * m + h0) * nq + i;
  const float* sets = tables + bh * group * nb * dv;
  float* o = out + row * dv;
  for (int64_t d = lane; d < dv; d += 32) {
    float acc = 0.f;
#pragma unroll 4
    for (int64_t hs = 0; hs < group; ++hs) {
      const int c = codes[hs * nq];
      if (live(c, nb)) acc += sets[(hs * nb + c) * dv + d];
    }
    o[d] = first ? scale * acc : o[d] + scale * acc;
  }
}

template <typename T>
const char* cumulate(const YosoCumulateParams& p, cudaStream_t stream) {
  const int nb = 1 << p.hash_bits;
  const Layout l = plan(p, false);
  char* ws = static_cast<char*>(p.workspace);
  float* tables = reinterpret_cast<float*>(ws);
  int32_t* perm = reinterpret_cast<int32_t*>(ws + l.tables);
  int32_t* offsets = reinterpret_cast<int32_t*>(ws + l.tables + l.perm_k);
  int32_t* cursors = l.cursors ? reinterpret_cast<int32_t*>(ws + l.tables + l.perm_k + l.offsets) : nullptr;
  // Shared-memory tables pay off only while a block covers a useful slice of the columns;
  // past that (tau >= 11 at 48 KiB) the table goes to global memory with global atomics.
  const int smem_cols = static_cast<int>(std::min<int64_t>(p.dv, kStaticSmem / (sizeof(float) * nb)));
  const int chunk = smem_cols >= 32 ? smem_cols / 32 * 32
                                     : (smem_cols >= std::min<int64_t>(p.dv, kMinSmemCols) ? smem_cols : 0);
  for (int64_t h0 = 0; h0 < p.m; h0 += l.group) {
    const int64_t group = std::min<int64_t>(l.group, p.m - h0), sets = p.bh * group;
    TableArgs a{p.k_codes, p.v, tables, perm, offsets, p.m, p.nk, p.dv, h0, group, sets, nb, chunk};
    if (p.deterministic) {
      if (const char* err = sort_codes(p.k_codes, p.bh, p.m, p.nk, h0, group, nb, perm, offsets, cursors, stream))
        return err;
      table_sorted_kernel<T><<<blocks_for(sets * ((nb + kWarps - 1) / kWarps), 1), kThreads, 0, stream>>>(a);
    } else if (chunk > 0) {
      const int64_t chunks = (p.dv + chunk - 1) / chunk;
      table_smem_kernel<T><<<blocks_for(sets * chunks, 1), kThreads, size_t(nb) * chunk * sizeof(float), stream>>>(a);
    } else {
      if (cudaMemsetAsync(tables, 0, size_t(sets) * nb * p.dv * sizeof(float), stream) != cudaSuccess) return launched();
      const int64_t blocks = std::min<int64_t>((sets * p.nk * p.dv + kThreads - 1) / kThreads, 1 << 20);
      table_global_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);  // grid-stride
    }
    if (const char* err = launched()) return err;
    gather_kernel<<<blocks_for(p.bh * p.nq, kWarps), kThreads, 0, stream>>>(
        p.q_codes, tables, p.out, p.bh, p.m, p.nq, p.dv, h0, group, nb, 1.f / float(p.m), h0 == 0);
    if (const char* err = launched()) return err;
  }
  return nullptr;
}

}  // namespace

size_t yoso_cumulate_workspace_bytes(const YosoCumulateParams& p) { return plan(p, false).total(); }

const char* yoso_lsh_cumulate(const YosoCumulateParams& p, cudaStream_t stream) {
  if (const char* err = check_params(p)) return err;
  if (p.bh == 0 || p.nq == 0 || p.dv == 0) return nullptr;
  if (p.nk == 0) {
    return cudaMemsetAsync(p.out, 0, size_t(p.bh) * p.nq * p.dv * sizeof(float), stream) == cudaSuccess
               ? nullptr
               : launched();
  }
  switch (p.dtype) {
    case YosoDtype::kFloat32: return cumulate<float>(p, stream);
    case YosoDtype::kFloat16: return cumulate<__half>(p, stream);
    case YosoDtype::kBFloat16: return cumulate<__nv_bfloat16>(p, stream);
  }
  return "v must be float32, float16 or bfloat16";
}
