// YOSO LSH cumulation on CUDA (the forward, and grad V by the role-swapped call).
// Design notes: docs/cuda.md.
//
//   out[i] = (1/m) sum_h sum_j [k_codes[h,j] == q_codes[h,i]] v[j]
//
// Per pass (a group of hashes for a slice of batch*head rows that fits the scratch budget; the
// group size never depends on batch*head, see plan() in yoso_cuda_common.cuh):
//   1. bucket tables T[bh, h, code, :] = sum of v over the keys with that code, built
//      - in shared memory with shared atomics when 2^tau rows of a column chunk fit (each lane
//        loads a run of keys' values before adding them), else
//      - (deterministic, or tau too large for shared memory) by a stable bucket sort of the
//        keys and an in-order sum per bucket; these tables have min(2^tau, Nk) rows;
//   2. a gather: a few lanes per query (vector loads) sum T[bh, h, q_code[h], :] over the group's
//      hashes in increasing h — no atomics, every output row has one writer.
// The weighted cumulation is in yoso_cuda_weighted.cu, the hash codes in yoso_cuda_hash.cu.

#include "yoso_cuda_common.cuh"

namespace {

// ---- forward: bucket tables (sets, table_rows, dv) fp32 ----

struct TableArgs {
  const int32_t* k_codes;
  const void* v;
  float* tables;
  const int32_t* perm;     // sorted build only
  const int32_t* offsets;  // sorted build only
  int64_t m, nk, dv, h0, group, sets, table_rows;
  int nb, chunk;  // chunk: table columns per block (shared-memory build)
  bool packed;    // sorted build with Nk < 2^tau: a bucket's table row is its start in perm
};

// Keys a lane loads before it adds any of them: the loads are in flight together, where an add's
// shared-memory compare-and-swap loop (sm_80/sm_90 have no native shared fp32 add) would otherwise
// hold back the next key's load.
constexpr int kTableAhead = 4;

__host__ __device__ __forceinline__ void shared_add(float* p, float x) {
#ifdef __CUDA_ARCH__
  atomicAdd(p, x);
#else
  *p += x;  // the CPU emulation runs one thread at a time
#endif
}

// One block of the shared-memory build: the 2^tau-row table of one (set, column chunk) in `tab`
// (nb * chunk floats), then written out once, coalesced. Written as phases between block_sync() so
// the CPU can run it thread by thread (tests/kernels/test_cuda_tables.py). Warp w takes the runs of
// kTableAhead keys starting at (w + k * kWarps) * kTableAhead; lane l adds column l of the chunk (and
// l + 32, ...). A lane reads its run's codes itself (one broadcast load per key for the warp), loads
// its column of the run's values, then adds them to the table with shared-memory atomics. Four keys
// a run keep the kernel at 48 registers (8 took 96, and capping those spilled).
template <typename T>
__host__ __device__ void table_smem_block(const TableArgs& a, int64_t block, float* tab) {
  const int64_t chunks = (a.dv + a.chunk - 1) / a.chunk;
  const int64_t set = block / chunks, d0 = (block % chunks) * a.chunk;
  const int64_t bh = set / a.group, hs = set % a.group;
  const int width = static_cast<int>(min64(a.chunk, a.dv - d0));
  const int32_t* codes = a.k_codes + (bh * a.m + a.h0 + hs) * a.nk;
  const T* v = static_cast<const T*>(a.v) + bh * a.nk * a.dv + d0;
  each_thread([&](int t) {
    for (int i = t; i < a.nb * width; i += kThreads) tab[i] = 0.f;
  });
  block_sync();
  each_thread([&](int t) {
    const int lane = t % 32, warp = t / 32;
    for (int dc = 0; dc < width; dc += 32) {
      const int d = dc + lane;
      const bool col = d < width;
      for (int64_t j0 = int64_t(warp) * kTableAhead; j0 < a.nk; j0 += int64_t(kWarps) * kTableAhead) {
        const int run = static_cast<int>(min64(kTableAhead, a.nk - j0));
        const int32_t* cr = codes + j0;
        const T* vr = v + j0 * a.dv + d;
        int c[kTableAhead];
        float x[kTableAhead];
        YOSO_UNROLL
        for (int u = 0; u < kTableAhead; ++u) {
          c[u] = u < run ? cr[u] : -1;
          x[u] = col && live(c[u], a.nb) ? load(vr, u * a.dv) : 0.f;
        }
        YOSO_UNROLL
        for (int u = 0; u < kTableAhead; ++u)
          if (col && live(c[u], a.nb)) shared_add(&tab[c[u] * width + d], x[u]);
      }
    }
  });
  block_sync();
  each_thread([&](int t) {
    float* out = a.tables + set * a.nb * a.dv + d0;
    for (int i = t; i < a.nb * width; i += kThreads) out[int64_t(i / width) * a.dv + i % width] = tab[i];
  });
}

template <typename T>
__global__ void __launch_bounds__(kThreads) table_smem_kernel(TableArgs a) {
  extern __shared__ float tab[];
  table_smem_block<T>(a, blockIdx.x, tab);
}

// One warp per bucket sums its keys in sorted (= index) order: no atomics, fixed order. Warps
// walk the 2^tau buckets, or (packed) the Nk positions of perm, where the warp at a bucket's
// first key serves it and writes table row = that position: rows never outnumber the keys.
// Empty buckets write nothing; the gather reads the offsets and skips them.
template <typename T>
__global__ void __launch_bounds__(kThreads) table_sorted_kernel(TableArgs a) {
  const int64_t item = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32;
  if (item >= a.sets * a.table_rows) return;
  const int64_t set = item / a.table_rows, t = item % a.table_rows, bh = set / a.group, hs = set % a.group;
  const int32_t* perm = a.perm + set * a.nk;
  const int32_t* off = a.offsets + set * (a.nb + 1);
  int64_t first, last;
  if (a.packed) {
    if (t >= off[a.nb]) return;  // past the live (unmasked) keys
    const int32_t* codes = a.k_codes + (bh * a.m + a.h0 + hs) * a.nk;
    const int c = codes[perm[t]];
    if (t > 0 && codes[perm[t - 1]] == c) return;  // not the first key of its bucket
    first = t;
    last = off[c + 1];
  } else {
    first = off[t];
    last = off[t + 1];
    if (first == last) return;
  }
  const T* v = static_cast<const T*>(a.v) + bh * a.nk * a.dv;
  float* row = a.tables + (set * a.table_rows + t) * a.dv;
  for (int64_t d = threadIdx.x % 32; d < a.dv; d += 32) {
    float acc = 0.f;
    for (int64_t p = first; p < last; ++p) acc += load(v, int64_t(perm[p]) * a.dv + d);
    row[d] = acc;
  }
}

struct GatherArgs {
  const int32_t* q_codes;
  const float* tables;
  const int32_t* offsets;  // sorted tables: bucket bounds (empty buckets have no row); else null
  float* out;
  int64_t bh, m, nq, dv, h0, group, table_rows;
  int nb;
  bool packed;
  float scale;
  bool first;  // the first pass stores, later passes add
};

// The gather, written once for the GPU and for the CPU (tests/kernels/test_cuda_gather.py drives the
// host form): `lanes` consecutive threads serve one query row, each lane `vec` adjacent columns at a
// time (float4 / float2 loads where dv allows). Per group of kGatherAhead hashes a lane first resolves
// every hash's table row (code, then the bucket bounds of sorted tables), then issues the row loads,
// which no longer wait on one another. The sum runs over the group's hashes in increasing order, one
// fp32 add each, as a single scalar loop would: the vector width changes no bit.
constexpr int kGatherAhead = 8;

// Columns a lane reads at once: 4 when dv and the output's address allow 16-byte accesses, else 2
// or 1. Table rows start at multiples of dv floats from a 256-byte aligned workspace.
int gather_vec(int64_t dv, const float* out) {
  const auto addr = reinterpret_cast<uintptr_t>(out);
  if (dv % 4 == 0 && addr % 16 == 0) return 4;
  if (dv % 2 == 0 && addr % 8 == 0) return 2;
  return 1;
}

// Lanes per query row: a power of two, enough for dv / vec columns in one sweep, at most a warp.
int gather_lanes(int64_t dv, int vec) {
  const int64_t need = (dv + vec - 1) / vec;
  int lanes = 1;
  while (lanes < 32 && lanes < need) lanes *= 2;
  return lanes;
}

// The element offset of hash hs's table row for this query's code in `sets`, or -1 when the query
// reads nothing there (masked code, or an empty bucket of sorted tables).
__host__ __device__ __forceinline__ int64_t gather_at(const GatherArgs& a, const int32_t* codes, const int32_t* off,
                                                      int64_t hs) {
  int64_t c = codes[hs * a.nq];
  if (!live(c, a.nb)) return -1;
  if (off) {
    const int32_t start = off[hs * (a.nb + 1) + c];
    if (start == off[hs * (a.nb + 1) + c + 1]) return -1;  // no key in this bucket
    if (a.packed) c = start;
  }
  return (hs * a.table_rows + c) * a.dv;
}

template <int VEC>
__host__ __device__ __forceinline__ void add_row(float* acc, const float* p) {
#ifdef __CUDA_ARCH__
  if constexpr (VEC == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    acc[0] += x.x; acc[1] += x.y; acc[2] += x.z; acc[3] += x.w;
  } else if constexpr (VEC == 2) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    acc[0] += x.x; acc[1] += x.y;
  } else {
    acc[0] += p[0];
  }
#else
  for (int k = 0; k < VEC; ++k) acc[k] += p[k];
#endif
}

// Lane `lane` of the `lanes` serving query row `row`: out = (first pass ? 0 : out) + scale * sum over
// the group's hashes, for columns lane*VEC + j*lanes*VEC + (0..VEC-1). dv % VEC == 0.
template <int VEC>
__host__ __device__ void gather_row(const GatherArgs& a, int64_t row, int lane, int lanes) {
  const int64_t bh = row / a.nq, i = row % a.nq;
  const int32_t* codes = a.q_codes + (bh * a.m + a.h0) * a.nq + i;
  const float* sets = a.tables + bh * a.group * a.table_rows * a.dv;
  const int32_t* off = a.offsets ? a.offsets + bh * a.group * (a.nb + 1) : nullptr;
  float* o = a.out + row * a.dv;
  for (int64_t d0 = int64_t(lane) * VEC; d0 < a.dv; d0 += int64_t(lanes) * VEC) {
    float acc[VEC];
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    for (int64_t h0 = 0; h0 < a.group; h0 += kGatherAhead) {
      int64_t at[kGatherAhead];
      YOSO_UNROLL
      for (int u = 0; u < kGatherAhead; ++u) at[u] = h0 + u < a.group ? gather_at(a, codes, off, h0 + u) : -1;
      YOSO_UNROLL
      for (int u = 0; u < kGatherAhead; ++u)
        if (at[u] >= 0) add_row<VEC>(acc, sets + at[u] + d0);
    }
    for (int k = 0; k < VEC; ++k) o[d0 + k] = a.first ? a.scale * acc[k] : o[d0 + k] + a.scale * acc[k];
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherArgs a, int lanes) {
  const int64_t row = blockIdx.x * int64_t(kThreads / lanes) + threadIdx.x / lanes;
  if (row >= a.bh * a.nq) return;
  gather_row<VEC>(a, row, static_cast<int>(threadIdx.x % lanes), lanes);
}

const char* gather(const GatherArgs& g, cudaStream_t stream) {
  const int vec = gather_vec(g.dv, g.out), lanes = gather_lanes(g.dv, vec);
  const unsigned blocks = blocks_for(g.bh * g.nq, kThreads / lanes);
  if (vec == 4) gather_kernel<4><<<blocks, kThreads, 0, stream>>>(g, lanes);
  else if (vec == 2) gather_kernel<2><<<blocks, kThreads, 0, stream>>>(g, lanes);
  else gather_kernel<1><<<blocks, kThreads, 0, stream>>>(g, lanes);
  return launched();
}

template <typename T>
const char* cumulate(const YosoCumulateParams& p, cudaStream_t stream) {
  const int nb = 1 << p.hash_bits;
  const Layout l = plan(p, false);
  // the gather's float4 loads read table rows at multiples of dv floats from here
  if (reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) return "yoso: the workspace is not 256-byte aligned";
  char* ws = static_cast<char*>(p.workspace);
  float* tables = reinterpret_cast<float*>(ws);
  int32_t* perm = reinterpret_cast<int32_t*>(ws + l.tables);
  int32_t* offsets = reinterpret_cast<int32_t*>(ws + l.tables + l.perm_k);
  int32_t* cursors = l.cursors ? reinterpret_cast<int32_t*>(ws + l.tables + l.perm_k + l.offsets_k) : nullptr;
  const int chunk = l.sorted ? 0 : smem_table_cols(p.dv, nb);
  for (int64_t r0 = 0; r0 < p.bh; r0 += l.rows) {
    const YosoCumulateParams s = rows_of(p, r0, std::min<int64_t>(l.rows, p.bh - r0), sizeof(T));
    for (int64_t h0 = 0; h0 < p.m; h0 += l.group) {
      const int64_t group = std::min<int64_t>(l.group, p.m - h0), sets = s.bh * group;
      const TableArgs a{s.k_codes, s.v, tables, perm, offsets, p.m, p.nk, p.dv, h0, group, sets, l.table_rows,
                        nb, chunk, l.packed};
      if (l.sorted) {
        if (const char* err = sort_codes(s.k_codes, s.bh, p.m, p.nk, h0, group, nb, perm, offsets, cursors, stream))
          return err;
        table_sorted_kernel<T><<<blocks_for(sets * l.table_rows, kWarps), kThreads, 0, stream>>>(a);
      } else {
        const int64_t chunks = (p.dv + chunk - 1) / chunk;
        table_smem_kernel<T><<<blocks_for(sets * chunks, 1), kThreads, size_t(nb) * chunk * sizeof(float), stream>>>(a);
      }
      if (const char* err = launched()) return err;
      const GatherArgs g{s.q_codes, tables, l.sorted ? offsets : nullptr, s.out, s.bh, p.m, p.nq, p.dv, h0, group,
                         l.table_rows, nb, l.packed, 1.f / float(p.m), h0 == 0};
      if (const char* err = gather(g, stream)) return err;
    }
  }
  return nullptr;
}

}  // namespace

size_t yoso_cumulate_workspace_bytes(const YosoCumulateParams& p) { return plan(p, false).total(); }

YosoPlan yoso_cumulate_plan(const YosoCumulateParams& p) { return describe(plan(p, false)); }

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
