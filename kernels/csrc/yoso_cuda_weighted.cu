// YOSO weighted LSH cumulation on CUDA (the backward of eq. 13-14). Design notes: docs/cuda.md.
//
//   out[i] = (1/m) sum_h sum_j [codes equal] (q_w[i] . k_w[j]) v[j]
//
// One launch per hash; in it one block at a time owns a (bh, bucket) and its queries, so each
// output row has one writer per launch and is accumulated hash by hash in increasing h, without
// atomics: the result is bit-identical from run to run and the same alone or in a batch. A bucket is served pairwise (cost
// nq*nk*(dw+dv), linear in D) when that is cheaper than building its dw x dv table (cost
// (nq+nk)*dw*dv, quadratic in D but independent of the bucket's pair count).

#include "yoso_cuda_common.cuh"

namespace {

constexpr int kKeyTile = 16;    // keys staged per step of the staged schemes
constexpr int kQueryTile = 64;  // queries staged per step of the staged schemes
constexpr int kMicro = 4;       // register block edge of the staged schemes

struct WeightedArgs {
  const void* q_w;
  const void* k_w;
  const void* v;
  float* out;
  const int32_t *q_perm, *q_off, *k_perm, *k_off;
  int64_t nq, nk, dw, dv, group, hs;
  int nb, table_cols;  // table_cols: dv columns per table pass, 0 = tables do not fit
  float scale;
};

// The rows one (bh, hash) reads: q_w, k_w, v of row bh, and its sorted query and key indices.
template <typename T>
struct Rows {
  const T *qw, *kw, *v;
  const int32_t *qp, *kp;
  __host__ __device__ Rows(const WeightedArgs& a, int64_t bh)
      : qw(static_cast<const T*>(a.q_w) + bh * a.nq * a.dw),
        kw(static_cast<const T*>(a.k_w) + bh * a.nk * a.dw),
        v(static_cast<const T*>(a.v) + bh * a.nk * a.dv),
        qp(a.q_perm + (bh * a.group + a.hs) * a.nq),
        kp(a.k_perm + (bh * a.group + a.hs) * a.nk) {}
};

// A bucket too wide for shared-memory staging (dw above ~140): a warp per query walks the keys
// from global memory, the weight by a shuffle reduction (broadcast from lane 0, so every column
// uses the same rounded weight).
template <typename T>
__device__ void weighted_pairwise_wide(const WeightedArgs& a, int64_t bh, int qs, int qe, int ks, int ke) {
  const Rows<T> in(a, bh);
  const int lane = threadIdx.x % 32;
  for (int p = qs + threadIdx.x / 32; p < qe; p += kWarps) {
    const int64_t i = in.qp[p];
    float* o = a.out + (bh * a.nq + i) * a.dv;
    for (int64_t d0 = 0; d0 < a.dv; d0 += 128) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int pk = ks; pk < ke; ++pk) {
        const int64_t j = in.kp[pk];
        float dot = 0.f;
        for (int64_t w = lane; w < a.dw; w += 32) dot += load(in.qw, i * a.dw + w) * load(in.kw, j * a.dw + w);
        for (int off = 16; off > 0; off /= 2) dot += __shfl_down_sync(kFull, dot, off);
        dot = __shfl_sync(kFull, dot, 0);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int64_t d = d0 + lane + 32 * t;
          if (d < a.dv) acc[t] += dot * load(in.v, j * a.dv + d);
        }
      }
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int64_t d = d0 + lane + 32 * t;
        if (d < a.dv) o[d] += a.scale * acc[t];
      }
    }
  }
}

// Shared-memory regions of a block (floats), the same for the staged pairwise and the table
// scheme: tab (dw, cols); kws (kKeyTile, dw + 1); vs (kKeyTile, cols); qws (kQueryTile, dw + 1);
// ss (kQueryTile, kKeyTile + 1). The +1 pads spread rows read down a column over banks.
struct Smem {
  float *tab, *kws, *vs, *qws, *ss;
  __host__ __device__ Smem(float* base, int dw, int cols)
      : tab(base),
        kws(tab + dw * cols),
        vs(kws + kKeyTile * (dw + 1)),
        qws(vs + kKeyTile * cols),
        ss(qws + kQueryTile * (dw + 1)) {}
};

// One phase: rows perm[first + r] of x (row length `len`, columns [c0, c0 + width)) into dst (row
// stride `stride`), for r < rows; rows n .. rows - 1 are zero, so partial tiles compute on zeros.
template <typename T>
__host__ __device__ void stage(float* dst, int stride, const T* x, int64_t len, int64_t c0, int width,
                               const int32_t* perm, int first, int n, int rows) {
  each_thread([&](int tid) {
    for (int e = tid; e < rows * width; e += kThreads) {
      const int r = e / width, c = e % width;
      dst[r * stride + c] = r < n ? load(x, int64_t(perm[first + r]) * len + c0 + c) : 0.f;
    }
  });
}

// A thread's kMicro x kMicro register block, grown by outer products of two kMicro-vectors.
struct Micro {
  float x[kMicro][kMicro];
  __host__ __device__ __forceinline__ void zero() {
    YOSO_UNROLL
    for (int i = 0; i < kMicro; ++i)
      YOSO_UNROLL
      for (int j = 0; j < kMicro; ++j) x[i][j] = 0.f;
  }
  __host__ __device__ __forceinline__ void add_outer(const float (&a)[kMicro], const float (&b)[kMicro]) {
    YOSO_UNROLL
    for (int i = 0; i < kMicro; ++i)
      YOSO_UNROLL
      for (int j = 0; j < kMicro; ++j) x[i][j] += a[i] * b[j];
  }
};

// One phase: out rows qp[qb + r] (r < nq) += scale * the threads' kMicro x kMicro blocks, the block
// of thread t < tiles (at most kThreads) at rows (t / tiles_d) * kMicro, columns d0 + (t % tiles_d) * kMicro.
__host__ __device__ inline void write_blocks(const WeightedArgs& a, int64_t bh, const int32_t* qp, int qb, int nq,
                                             int64_t d0, int width, int tiles, PerThread<Micro>& acc) {
  const int tiles_d = (width + kMicro - 1) / kMicro;
  each_thread([&](int tid) {
    if (tid >= tiles) return;
    const int r0 = (tid / tiles_d) * kMicro, c0 = (tid % tiles_d) * kMicro;
    for (int i = 0; i < kMicro; ++i) {
      if (r0 + i >= nq) continue;
      float* o = a.out + (bh * a.nq + qp[qb + r0 + i]) * a.dv + d0 + c0;
      for (int j = 0; j < kMicro; ++j)
        if (c0 + j < width) o[j] += a.scale * acc[tid].x[i][j];
    }
  });
}

// Small buckets, cost nq*nk*(dw + dv): the bucket's weights S = q_w k_w^T and then S v, tile by
// tile from shared memory. Per tile of kQueryTile queries, each thread keeps a kMicro x kMicro
// block of the output in registers across the key tiles; per key tile the kQueryTile x kKeyTile
// weights are computed 2 x 2 per thread into ss. Sums run in a fixed order (keys in sorted order).
template <typename T>
__host__ __device__ void weighted_pairwise(const WeightedArgs& a, int64_t bh, int qs, int qe, int ks, int ke,
                                           float* smem) {
  const int cols = a.table_cols, dw = static_cast<int>(a.dw), rs = dw + 1, ss_stride = kKeyTile + 1;
  const Smem sm(smem, dw, cols);
  const Rows<T> in(a, bh);
  static_assert(kQueryTile * kKeyTile == 4 * kThreads, "one 2 x 2 block of weights per thread");
  static_assert(kQueryTile / kMicro * (64 / kMicro) <= kThreads, "one output block per thread at 64 columns");
  PerThread<Micro> acc;
  for (int64_t d0 = 0; d0 < a.dv; d0 += cols) {
    const int width = static_cast<int>(min64(cols, a.dv - d0));
    const int tiles_d = (width + kMicro - 1) / kMicro, tiles = (kQueryTile / kMicro) * tiles_d;
    for (int qb = qs; qb < qe; qb += kQueryTile) {
      const int nqt = min32(kQueryTile, qe - qb);
      stage(sm.qws, rs, in.qw, a.dw, 0, dw, in.qp, qb, nqt, kQueryTile);
      each_thread([&](int tid) { acc[tid].zero(); });
      for (int kb = ks; kb < ke; kb += kKeyTile) {
        const int n = min32(kKeyTile, ke - kb);
        stage(sm.kws, rs, in.kw, a.dw, 0, dw, in.kp, kb, n, kKeyTile);
        stage(sm.vs, cols, in.v, a.dv, d0, width, in.kp, kb, n, kKeyTile);
        block_sync();
        each_thread([&](int tid) {
          const int si = (tid / (kKeyTile / 2)) * 2, sj = (tid % (kKeyTile / 2)) * 2;
          float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;
          for (int w = 0; w < dw; ++w) {
            const float q0 = sm.qws[si * rs + w], q1 = sm.qws[(si + 1) * rs + w];
            const float k0 = sm.kws[sj * rs + w], k1 = sm.kws[(sj + 1) * rs + w];
            s00 += q0 * k0;
            s01 += q0 * k1;
            s10 += q1 * k0;
            s11 += q1 * k1;
          }
          sm.ss[si * ss_stride + sj] = s00;
          sm.ss[si * ss_stride + sj + 1] = s01;
          sm.ss[(si + 1) * ss_stride + sj] = s10;
          sm.ss[(si + 1) * ss_stride + sj + 1] = s11;
        });
        block_sync();
        each_thread([&](int tid) {
          if (tid >= tiles) return;
          const int r0 = (tid / tiles_d) * kMicro, c0 = (tid % tiles_d) * kMicro;
          for (int r = 0; r < n; ++r) {
            float sv[kMicro], vv[kMicro];
YOSO_UNROLL
            for (int i = 0; i < kMicro; ++i) {
              sv[i] = sm.ss[(r0 + i) * ss_stride + r];
              vv[i] = c0 + i < width ? sm.vs[r * cols + c0 + i] : 0.f;
            }
            acc[tid].add_outer(sv, vv);
          }
        });
        block_sync();  // the next key tile (or query tile, or bucket) overwrites kws, vs, ss, qws
      }
      write_blocks(a, bh, in.qp, qb, nqt, d0, width, tiles, acc);
    }
  }
}

// Big buckets, cost (nq + nk)*dw*dv: the bucket's dw x cols table T = sum_j k_w[j] (x) v[j] is built
// from key tiles, each thread holding one kMicro x kMicro block of it in registers across the
// tiles (weighted_table_cols keeps the blocks within one per thread), then stored to shared memory
// and applied to query tiles. Every table entry and output is summed in a fixed order.
template <typename T>
__host__ __device__ void weighted_table(const WeightedArgs& a, int64_t bh, int qs, int qe, int ks, int ke,
                                        float* smem) {
  const int cols = a.table_cols, dw = static_cast<int>(a.dw), rs = dw + 1;
  const Smem sm(smem, dw, cols);
  const Rows<T> in(a, bh);
  const int tiles_w = (dw + kMicro - 1) / kMicro;
  PerThread<Micro> part;
  for (int64_t d0 = 0; d0 < a.dv; d0 += cols) {
    const int width = static_cast<int>(min64(cols, a.dv - d0));
    const int tiles_d = (width + kMicro - 1) / kMicro;
    each_thread([&](int tid) { part[tid].zero(); });
    for (int kb = ks; kb < ke; kb += kKeyTile) {
      const int n = min32(kKeyTile, ke - kb);
      stage(sm.kws, rs, in.kw, a.dw, 0, dw, in.kp, kb, n, n);
      stage(sm.vs, cols, in.v, a.dv, d0, width, in.kp, kb, n, n);
      block_sync();
      each_thread([&](int tid) {
        if (tid >= tiles_w * tiles_d) return;
        const int w0 = (tid / tiles_d) * kMicro, t0 = (tid % tiles_d) * kMicro;
        for (int r = 0; r < n; ++r) {
          float kv[kMicro], vv[kMicro];
YOSO_UNROLL
          for (int i = 0; i < kMicro; ++i) {
            kv[i] = w0 + i < dw ? sm.kws[r * rs + w0 + i] : 0.f;
            vv[i] = t0 + i < width ? sm.vs[r * cols + t0 + i] : 0.f;
          }
          part[tid].add_outer(kv, vv);
        }
      });
      block_sync();
    }
    each_thread([&](int tid) {
      if (tid >= tiles_w * tiles_d) return;
      const int w0 = (tid / tiles_d) * kMicro, t0 = (tid % tiles_d) * kMicro;
      for (int i = 0; i < kMicro; ++i)
        for (int j = 0; j < kMicro; ++j)
          if (w0 + i < dw && t0 + j < width) sm.tab[(w0 + i) * width + t0 + j] = part[tid].x[i][j];
    });
    block_sync();
    for (int qb = qs; qb < qe; qb += kQueryTile) {
      const int n = min32(kQueryTile, qe - qb);
      stage(sm.qws, rs, in.qw, a.dw, 0, dw, in.qp, qb, n, n);
      block_sync();
      const int tiles_r = (n + kMicro - 1) / kMicro;
      each_thread([&](int tid) {
        for (int t = tid; t < tiles_r * tiles_d; t += kThreads) {
          const int r0 = (t / tiles_d) * kMicro, c0 = (t % tiles_d) * kMicro;
          Micro acc;
          acc.zero();
          for (int w = 0; w < dw; ++w) {
            float qv[kMicro], tv[kMicro];
YOSO_UNROLL
            for (int i = 0; i < kMicro; ++i) {
              qv[i] = r0 + i < n ? sm.qws[(r0 + i) * rs + w] : 0.f;
              tv[i] = c0 + i < width ? sm.tab[w * width + c0 + i] : 0.f;
            }
            acc.add_outer(qv, tv);
          }
          for (int i = 0; i < kMicro; ++i) {
            if (r0 + i >= n) continue;
            float* o = a.out + (bh * a.nq + in.qp[qb + r0 + i]) * a.dv + d0 + c0;
            for (int j = 0; j < kMicro; ++j)
              if (c0 + j < width) o[j] += a.scale * acc.x[i][j];
          }
        }
      });
      block_sync();
    }
  }
}

// The scheme of a bucket of nq queries and nk keys: pairwise costs nq*nk*(dw + dv), the table
// (nq + nk)*dw*dv.
__host__ __device__ inline bool pairwise_is_cheaper(int64_t nq, int64_t nk, int64_t dw, int64_t dv) {
  return nq * nk * (dw + dv) <= (nq + nk) * dw * dv;
}

// One (bh, bucket) of one hash, by a whole block; returns having passed a barrier, so the block
// may stage the next bucket into the same shared memory. `item` = bh * nb + bucket.
template <typename T>
__host__ __device__ void weighted_bucket(const WeightedArgs& a, int64_t item, float* smem) {
  const int64_t bh = item / a.nb;
  const int b = static_cast<int>(item % a.nb);
  const int32_t* qo = a.q_off + (bh * a.group + a.hs) * (a.nb + 1);
  const int32_t* ko = a.k_off + (bh * a.group + a.hs) * (a.nb + 1);
  const int qs = qo[b], qe = qo[b + 1], ks = ko[b], ke = ko[b + 1];
  if (qs == qe || ks == ke) return;  // block-uniform
  if (a.table_cols == 0) {
#ifdef __CUDA_ARCH__
    weighted_pairwise_wide<T>(a, bh, qs, qe, ks, ke);
#endif
  } else if (pairwise_is_cheaper(qe - qs, ke - ks, a.dw, a.dv)) {
    weighted_pairwise<T>(a, bh, qs, qe, ks, ke, smem);
  } else {
    weighted_table<T>(a, bh, qs, qe, ks, ke, smem);
  }
}

// A grid of at most kBlocksPerSm blocks per SM walks the bh * 2^tau buckets (grid-stride):
// at large tau most buckets are empty, and a block per bucket would mostly launch to exit.
template <typename T>
__global__ void __launch_bounds__(kThreads) weighted_kernel(WeightedArgs a, int64_t buckets) {
  extern __shared__ float smem[];
  for (int64_t item = blockIdx.x; item < buckets; item += gridDim.x) weighted_bucket<T>(a, item, smem);
}

constexpr int64_t kBlocksPerSm = 64;

// The regions of Smem, in bytes.
size_t weighted_smem(int64_t dw, int64_t cols) {
  return size_t(dw * cols + (kKeyTile + kQueryTile) * (dw + 1) + kKeyTile * cols + kQueryTile * (kKeyTile + 1)) *
         sizeof(float);
}

// dv columns per pass of the staged schemes: the table and its staging fit kStaticSmem, and the
// table has at most one kMicro x kMicro block per thread (they stay in registers while it is
// built). 0 = never fits (dw above ~140): every bucket then runs weighted_pairwise_wide.
int weighted_table_cols(int64_t dw, int64_t dv) {
  const int64_t floats = kStaticSmem / sizeof(float);
  const int64_t fixed = (kKeyTile + kQueryTile) * (dw + 1) + kQueryTile * (kKeyTile + 1);
  const int64_t fit = (floats - fixed) / (dw + kKeyTile);
  const int64_t blocks = kThreads / ((dw + kMicro - 1) / kMicro) * kMicro;
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>({fit, blocks, dv, 64})));
}

template <typename T>
const char* weighted(const YosoCumulateParams& p, cudaStream_t stream) {
  const int nb = 1 << p.hash_bits;
  const Layout l = plan(p, true);
  // the regions below are planned at 256-byte offsets from an aligned base (yoso_cuda.h's promise)
  if (reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) return "yoso: the workspace is not 256-byte aligned";
  char* ws = static_cast<char*>(p.workspace);
  int32_t* q_perm = reinterpret_cast<int32_t*>(ws);
  int32_t* k_perm = reinterpret_cast<int32_t*>(ws + l.perm_q);
  int32_t* q_off = reinterpret_cast<int32_t*>(ws + l.perm_q + l.perm_k);
  int32_t* k_off = reinterpret_cast<int32_t*>(ws + l.perm_q + l.perm_k + l.offsets_q);
  int32_t* cursors =
      l.cursors ? reinterpret_cast<int32_t*>(ws + l.perm_q + l.perm_k + l.offsets_q + l.offsets_k) : nullptr;
  const int cols = weighted_table_cols(p.dw, p.dv);
  const size_t smem = cols > 0 ? weighted_smem(p.dw, cols) : 0;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return launched();
  if (cudaMemsetAsync(p.out, 0, size_t(p.bh) * p.nq * p.dv * sizeof(float), stream) != cudaSuccess) return launched();
  for (int64_t r0 = 0; r0 < p.bh; r0 += l.rows) {
    const YosoCumulateParams s = rows_of(p, r0, std::min<int64_t>(l.rows, p.bh - r0), sizeof(T));
    const int64_t buckets = s.bh * nb;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(buckets, kBlocksPerSm * std::max(sms, 1)));
    for (int64_t h0 = 0; h0 < p.m; h0 += l.group) {
      const int64_t group = std::min<int64_t>(l.group, p.m - h0);
      if (const char* err = sort_codes(s.q_codes, s.bh, p.m, p.nq, h0, group, nb, q_perm, q_off, cursors, stream))
        return err;
      if (const char* err = sort_codes(s.k_codes, s.bh, p.m, p.nk, h0, group, nb, k_perm, k_off, cursors, stream))
        return err;
      for (int64_t hs = 0; hs < group; ++hs) {
        const WeightedArgs a{s.q_w, s.k_w, s.v, s.out, q_perm, q_off, k_perm, k_off, p.nq, p.nk, p.dw, p.dv,
                             group, hs, nb, cols, 1.f / float(p.m)};
        weighted_kernel<T><<<grid, kThreads, smem, stream>>>(a, buckets);
        if (const char* err = launched()) return err;
      }
    }
  }
  return nullptr;
}

}  // namespace

size_t yoso_weighted_cumulate_workspace_bytes(const YosoCumulateParams& p) { return plan(p, true).total(); }

YosoPlan yoso_weighted_cumulate_plan(const YosoCumulateParams& p) { return describe(plan(p, true)); }

const char* yoso_lsh_weighted_cumulate(const YosoCumulateParams& p, cudaStream_t stream) {
  if (const char* err = check_params(p)) return err;
  if (p.bh == 0 || p.nq == 0 || p.dv == 0) return nullptr;
  if (p.nk == 0 || p.dw == 0) {
    return cudaMemsetAsync(p.out, 0, size_t(p.bh) * p.nq * p.dv * sizeof(float), stream) == cudaSuccess
               ? nullptr
               : launched();
  }
  switch (p.dtype) {
    case YosoDtype::kFloat32: return weighted<float>(p, stream);
    case YosoDtype::kFloat16: return weighted<__half>(p, stream);
    case YosoDtype::kBFloat16: return weighted<__nv_bfloat16>(p, stream);
  }
  return "q_w, k_w and v must be float32, float16 or bfloat16";
}
