// YOSO CPU kernels (OpenMP): LSH cumulation, the fused LSH attention, hash codes (the weighted
// cumulation: yoso_cpu_weighted.cpp).
//
// Determinism: every output row is owned by exactly one thread and is accumulated hash by
// hash in increasing h; every bucket table is filled by one thread scanning keys in
// increasing j. Threads split work only along those ownership lines, so results are
// bit-identical across runs and across OpenMP thread counts on a given machine.
//
// Tables are compact: a bucket gets a table row only when some key lands in it (slot_of maps
// code -> row, -1 when empty), so memory is min(2^tau, Nk) rows per hash however large tau is.
// No torch headers here: this file compiles in seconds.

#include "yoso_cpu.h"
#include "yoso_cpu_kernels.h"
#include "yoso_cpu_simd.h"

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace yoso {
namespace {

using kern::clear_slots;
using kern::kRowBlock;
using kern::over_heads;
using kern::threads_for;

// Bucket tables of a group of hashes are built before the queries read them; the group is as
// many hashes as fit this budget (at least one). tau=8, D=64: 64 KiB per hash, so all of m=32
// hashes fit and every output row is finished in one pass.
constexpr int64_t kTableBudgetBytes = int64_t(16) << 20;

inline void add_row(float* __restrict dst, const float* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] += src[d];
}

// Sum V rows per occupied bucket of one hash; slots are numbered by first key to arrive. kDv is the
// value width when known at compile time (32, 64: the row add unrolls into whole vectors), 0 when it
// is dv; every instance does the same adds in the same order, so the same bits.
template <int kDv>
YOSO_SIMD_CLONES void build_value_table(const int32_t* codes, const float* v, int64_t ldv, int64_t nk, int64_t dv,
                                        int32_t* slot_of, float* table) {
  const int64_t width = kDv > 0 ? kDv : dv;
  int32_t used = 0;
  for (int64_t j = 0; j < nk; ++j) {
    simd::prefetch_ahead(v, ldv, j, nk, width);
    const int32_t c = codes[j];
    if (c < 0) continue;
    int32_t s = slot_of[c];
    if (s < 0) {
      slot_of[c] = s = used++;
      std::copy(v + j * ldv, v + j * ldv + width, table + int64_t(s) * width);
    } else {
      add_row(table + int64_t(s) * width, v + j * ldv, width);
    }
  }
}

// Rows [i0, i1) of one (batch*head) add the tables of hashes h0 .. h0+hn-1, each row its hashes in
// order. ptrs (kRowBlock x hn) holds the table row each (row, hash) reads, null when none.
void gather_block(const int32_t* qc, int64_t nq, int64_t dv, int64_t buckets, int64_t h0, int64_t hn,
                  const int32_t* slot_of, const float* tables, int64_t slots, float* out, int64_t i0, int64_t i1,
                  int64_t ldo, float scale, const float** ptrs) {
  for (int64_t t = 0; t < hn; ++t) {  // hash-major: one slot map and one codes line at a time
    const int32_t* codes = qc + (h0 + t) * nq;
    const int32_t* slot_of_t = slot_of + t * buckets;
    const float* table = tables + t * slots * dv;
    for (int64_t i = i0; i < i1; ++i) {
      const int32_t c = codes[i], s = c < 0 ? -1 : slot_of_t[c];
      ptrs[(i - i0) * hn + t] = s < 0 ? nullptr : table + int64_t(s) * dv;
    }
  }
  simd::gather_rows(ptrs, i1 - i0, hn, dv, out + i0 * ldo, ldo, scale);
}

// gather_block for a head width known at compile time: each row reads its codes and slots directly
// (no pointer list) and keeps its sum in registers. Same adds, same order, same scale: same bits.
template <int DV>
YOSO_SIMD_CLONES void gather_block_fixed(const int32_t* qc, int64_t nq, int64_t buckets, int64_t h0, int64_t hn,
                                         const int32_t* slot_of, const float* tables, int64_t slots, float* out,
                                         int64_t i0, int64_t i1, int64_t ldo, float scale) {
  for (int64_t i = i0; i < i1; ++i) {
    float* __restrict o = out + i * ldo;
    float acc[DV];
    for (int d = 0; d < DV; ++d) acc[d] = o[d];
    for (int64_t t = 0; t < hn; ++t) {
      const int32_t c = qc[(h0 + t) * nq + i], s = c < 0 ? -1 : slot_of[t * buckets + c];
      if (s < 0) continue;
      const float* __restrict row = tables + (t * slots + s) * DV;
      for (int d = 0; d < DV; ++d) acc[d] += row[d];
    }
    if (scale != 1.f)
      for (int d = 0; d < DV; ++d) acc[d] *= scale;
    for (int d = 0; d < DV; ++d) o[d] = acc[d];
  }
}

// Rows [i0, i1) of one head's x (rows of d) hashed with w (d, m*bits): codes[h * stride + i].
// The scores of a block stay in the caller's L1-sized scratch (kHashBlock x score_stride).
constexpr int64_t kHashBlock = 24;

int64_t score_stride(int64_t cols) { return (cols + 15) / 16 * 16 + 16; }  // pack_codes reads 16 past a hash

void hash_block(const float* x, int64_t ldx, const float* w, int64_t d, int64_t m, int bits, int64_t i0, int64_t i1,
                int32_t* codes, int64_t stride, float* scores) {
  const int64_t cols = m * bits, ld = score_stride(cols);
  simd::gemm(x + i0 * ldx, ldx, w, cols, i1 - i0, d, cols, scores, ld, false);
  simd::pack_codes(scores, ld, i1 - i0, m, bits, codes + i0, stride);
}

// Scratch of one team working on one (batch*head): the bucket tables of a group of hashes.
struct ValueTables {
  int64_t slots, group;
  std::vector<float> tables;     // (group, slots, Dv)
  std::vector<int32_t> slot_of;  // (group, 2^tau), -1 between uses

  explicit ValueTables(const CumulateParams& p) : slots(std::min(p.buckets, p.nk)) {
    const int64_t per_hash = slots * p.dv * int64_t(sizeof(float)) + p.buckets * int64_t(sizeof(int32_t));
    group = std::max<int64_t>(1, std::min<int64_t>(p.m, kTableBudgetBytes / per_hash));
    tables.resize(group * slots * p.dv);
    slot_of.assign(group * p.buckets, -1);
  }
};

// Calls body(std::integral_constant<int, W>) with W = dv for the widths that have compiled-in bodies
// (32, 64) and W = 0 (the width known only at run time) for any other.
template <typename Body>
void with_width(int64_t dv, Body body) {
  if (dv == 32)
    body(std::integral_constant<int, 32>{});
  else if (dv == 64)
    body(std::integral_constant<int, 64>{});
  else
    body(std::integral_constant<int, 0>{});
}

// One (batch*head): codes qc (m, nq), kc (m, nk), values v (nk, dv), out (nq, dv) zero on entry,
// by a team of `team` threads (1: the calling thread alone, no barriers).
void cumulate_one(const CumulateParams& p, const int32_t* qc, const int32_t* kc, const float* v, int64_t ldv,
                  float* out, int64_t ldo, ValueTables& ws, int team) {
  const int64_t blocks = (p.nq + kRowBlock - 1) / kRowBlock;
#pragma omp parallel num_threads(team) if (team > 1)
  {
    std::vector<const float*> ptrs(kRowBlock * ws.group);
    for (int64_t h0 = 0; h0 < p.m; h0 += ws.group) {
      const int64_t hn = std::min(ws.group, p.m - h0);
      const float scale = h0 + hn == p.m ? 1.f / float(p.m) : 1.f;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < hn; ++t)
        with_width(p.dv, [&](auto width) {
          constexpr int kWidth = decltype(width)::value;
          build_value_table<kWidth>(kc + (h0 + t) * p.nk, v, ldv, p.nk, p.dv, ws.slot_of.data() + t * p.buckets,
                                    ws.tables.data() + t * ws.slots * p.dv);
        });
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t i0 = blk * kRowBlock, i1 = std::min(p.nq, (blk + 1) * kRowBlock);
        with_width(p.dv, [&](auto width) {
          constexpr int kWidth = decltype(width)::value;
          if constexpr (kWidth > 0)
            gather_block_fixed<kWidth>(qc, p.nq, p.buckets, h0, hn, ws.slot_of.data(), ws.tables.data(), ws.slots, out,
                                       i0, i1, ldo, scale);
          else
            gather_block(qc, p.nq, p.dv, p.buckets, h0, hn, ws.slot_of.data(), ws.tables.data(), ws.slots, out, i0,
                         i1, ldo, scale, ptrs.data());
        });
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < hn; ++t) clear_slots(kc + (h0 + t) * p.nk, p.nk, ws.slot_of.data() + t * p.buckets);
    }
  }
}

void cumulate_head(const CumulateParams& p, int64_t b, ValueTables& ws, int team) {
  cumulate_one(p, p.q_codes + b * p.m * p.nq, p.k_codes + b * p.m * p.nk, p.v + b * p.nk * p.dv, p.dv,
               p.out + b * p.nq * p.dv, p.dv, ws, team);
}

}  // namespace

void lsh_cumulate(const CumulateParams& p, int nthreads) {
  const int64_t ops = p.bh * p.m * (p.nq + p.nk) * p.dv;
  over_heads<ValueTables>(p, threads_for(ops, nthreads), cumulate_head);
}

// Scratch of the fused op for one team: one head's codes and bucket tables (and its values widened from bf16).
struct FusedScratch {
  ValueTables tables;
  std::vector<int32_t> q_codes, k_codes;  // (m, N) each
  std::vector<float> values;              // (N, Dv), bf16 inputs only

  explicit FusedScratch(const CumulateParams& p) : tables(p), q_codes(p.m * p.nq), k_codes(p.m * p.nk) {}
};

void lsh_attention(const AttentionParams& a, int nthreads) {
  CumulateParams p{};
  p.bh = a.batch * a.heads;
  p.m = a.m;
  p.nq = p.nk = a.n;
  p.dv = a.dv;
  p.buckets = int64_t(1) << a.hash_bits;
  const int64_t cols = a.m * a.hash_bits, blocks = (a.n + kHashBlock - 1) / kHashBlock;
  const int64_t ops = p.bh * a.n * (2 * a.d * cols + 2 * a.m * a.dv);
  const simd::PackedPlanes planes{a.packed, a.packed_offset, simd::packed_dpad(a.d), simd::packed_cols16(cols)};
  over_heads<FusedScratch>(p, threads_for(ops, nthreads), [&](const CumulateParams& p, int64_t b, FusedScratch& ws,
                                                             int team) {
    const int64_t batch = b / a.heads, head = b % a.heads;
    const float* w = a.proj + head * a.d * cols;
    const uint8_t* keep = a.keep ? a.keep + batch * a.n : nullptr;
    const int64_t v_offset = batch * a.v_stride[0] + head * a.v_stride[1];
    if (a.bf16) ws.values.resize(a.n * a.dv);
#pragma omp parallel num_threads(team) if (team > 1)
    {
      std::vector<float> scores(kHashBlock * score_stride(cols)), wide(a.bf16 ? kHashBlock * a.d : 0);
#pragma omp for schedule(static)
      for (int64_t item = 0; item < 2 * blocks; ++item) {
        const bool key = item >= blocks;
        const int64_t i0 = (item % blocks) * kHashBlock, i1 = std::min(a.n, i0 + kHashBlock);
        int32_t* codes = (key ? ws.k_codes.data() : ws.q_codes.data()) + i0;
        const int64_t offset = key ? batch * a.k_stride[0] + head * a.k_stride[1] + i0 * a.k_stride[2]
                                   : batch * a.q_stride[0] + head * a.q_stride[1] + i0 * a.q_stride[2];
        int64_t ldx = key ? a.k_stride[2] : a.q_stride[2];
        const float* x = wide.data();
        if (!a.bf16) {
          x = static_cast<const float*>(key ? a.k : a.q) + offset;
        } else {  // the block's rows widened (exactly): the codes of their fp32 values
          const uint16_t* x16 = static_cast<const uint16_t*>(key ? a.k : a.q) + offset;
          for (int64_t r = 0; r < i1 - i0; ++r) simd::widen_bf16(x16 + r * ldx, a.d, wide.data() + r * a.d);
          ldx = a.d;
        }
        if (a.int8)
          simd::hash_rows_i8(x, ldx, i1 - i0, a.d, a.proj, planes, head, a.m, a.hash_bits, codes, a.n);
        else
          hash_block(x, ldx, w, a.d, a.m, a.hash_bits, 0, i1 - i0, codes, a.n, scores.data());
        if (keep != nullptr)
          for (int64_t h = 0; h < a.m; ++h)
            for (int64_t i = i0; i < i1; ++i)
              if (!keep[i]) codes[h * a.n + i - i0] = -1;
      }
      if (a.bf16) {
        const uint16_t* v16 = static_cast<const uint16_t*>(a.v) + v_offset;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < a.n; ++j) simd::widen_bf16(v16 + j * a.v_stride[2], a.dv, ws.values.data() + j * a.dv);
      }
    }
    const float* v = a.bf16 ? ws.values.data() : static_cast<const float*>(a.v) + v_offset;
    const int64_t ldv = a.bf16 ? a.dv : a.v_stride[2];
    cumulate_one(p, ws.q_codes.data(), ws.k_codes.data(), v, ldv,
                 a.out + batch * a.out_stride[0] + head * a.out_stride[1], a.out_stride[2], ws.tables, team);
  });
}

void hash_codes(const HashParams& p, int nthreads) {
  const int64_t cols = p.m * p.hash_bits, blocks = (p.n + kHashBlock - 1) / kHashBlock;
  const simd::PackedPlanes packed{p.packed, p.packed_offset, simd::packed_dpad(p.d), simd::packed_cols16(cols)};
#pragma omp parallel num_threads(threads_for(p.batch * p.heads * p.n * p.d * cols, nthreads))
  {
    std::vector<float> scores(kHashBlock * score_stride(cols));
#pragma omp for schedule(dynamic, 32)
    for (int64_t item = 0; item < p.batch * p.heads * blocks; ++item) {
      const int64_t bh = item / blocks, head = bh % p.heads, i0 = (item % blocks) * kHashBlock;
      const int64_t i1 = std::min(p.n, i0 + kHashBlock);
      if (p.int8)
        simd::hash_rows_i8(p.x + (bh * p.n + i0) * p.d, p.d, i1 - i0, p.d, p.proj, packed, head, p.m, p.hash_bits,
                           p.codes + bh * p.m * p.n + i0, p.n);
      else
        hash_block(p.x + bh * p.n * p.d, p.d, p.proj + head * p.d * cols, p.d, p.m, p.hash_bits, i0, i1,
                   p.codes + bh * p.m * p.n, p.n, scores.data());
    }
  }
}

}  // namespace yoso
