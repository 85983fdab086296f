// YOSO CPU kernels (OpenMP): the weighted LSH cumulation, out[i] = sum over hashes and colliding keys j
// of (q_w[i] . k_w[j]) v[j] / m, with the same ownership rules as yoso_cpu_kernels.cpp: every output row is
// summed by one thread, hash by hash in increasing h, and every bucket's keys in increasing j, so results are
// bit-identical across runs and thread counts on a given machine. No torch headers here.

#include "yoso_cpu.h"
#include "yoso_cpu_kernels.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace yoso {
namespace {

using kern::kRowBlock;

// The weighted table (Dw x Dv per bucket) is used only while it stays under this size; past
// it (large tau, long sequences) the per-bucket key lists are walked directly.
constexpr int64_t kWeightedTableBudgetBytes = int64_t(64) << 20;

inline void axpy_row(float* __restrict dst, float a, const float* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] += a * src[d];
}

inline void scale_row(float* __restrict dst, float a, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] *= a;
}

inline float dot_row(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Keys of one hash grouped by bucket (a counting sort that keeps j increasing in a bucket).
struct BucketLists {
  std::vector<int32_t> slot_of;  // code -> slot, -1 when no key has that code
  std::vector<int64_t> start;    // slot -> first index into order; start[used] = keys kept
  std::vector<int32_t> order;    // key indices, bucket by bucket
  int32_t used = 0;

  BucketLists(int64_t buckets, int64_t nk) : slot_of(buckets, -1), start(std::min(buckets, nk) + 1), order(nk) {}

  void build(const int32_t* codes, int64_t nk) {
    used = 0;
    std::fill(start.begin(), start.end(), 0);
    for (int64_t j = 0; j < nk; ++j) {
      const int32_t c = codes[j];
      if (c < 0) continue;
      if (slot_of[c] < 0) slot_of[c] = used++;
      ++start[slot_of[c] + 1];
    }
    for (int32_t s = 0; s < used; ++s) start[s + 1] += start[s];
    std::vector<int64_t> next(start.begin(), start.begin() + used);
    for (int64_t j = 0; j < nk; ++j)
      if (codes[j] >= 0) order[next[slot_of[codes[j]]]++] = int32_t(j);
  }

  int32_t slot(int32_t code) const { return code < 0 ? -1 : slot_of[code]; }
};

// Rows [a0, a1) of bucket s's Dw x Dv table: sum over its keys of k_w[j][a] * v[j].
YOSO_SIMD_CLONES
void fill_weighted_table(const CumulateParams& p, const BucketLists& lists, const float* kw, const float* v,
                         int64_t s, int64_t a0, int64_t a1, float* table) {
  std::fill(table + a0 * p.dv, table + a1 * p.dv, 0.f);
  for (int64_t e = lists.start[s]; e < lists.start[s + 1]; ++e) {
    const int64_t j = lists.order[e];
    for (int64_t a = a0; a < a1; ++a) axpy_row(table + a * p.dv, kw[j * p.dw + a], v + j * p.dv, p.dv);
  }
}

// Rows [i0, i1) of one hash: out[i] += q_w[i] @ T[bucket(i)] (table) or walk the bucket's keys.
YOSO_SIMD_CLONES
void gather_weighted_rows(const CumulateParams& p, const BucketLists& lists, const int32_t* qc, const float* qw,
                          const float* kw, const float* v, const float* table, float* out, int64_t i0, int64_t i1,
                          float scale) {
  const int64_t cell = p.dw * p.dv;
  for (int64_t i = i0; i < i1; ++i) {
    float* o = out + i * p.dv;
    const int32_t s = lists.slot(qc[i]);
    if (s >= 0 && table != nullptr) {
      const float* t = table + int64_t(s) * cell;
      for (int64_t a = 0; a < p.dw; ++a) axpy_row(o, qw[i * p.dw + a], t + a * p.dv, p.dv);
    } else if (s >= 0) {
      for (int64_t e = lists.start[s]; e < lists.start[s + 1]; ++e) {
        const int64_t j = lists.order[e];
        axpy_row(o, dot_row(qw + i * p.dw, kw + j * p.dw, p.dw), v + j * p.dv, p.dv);
      }
    }
    if (scale != 1.f) scale_row(o, scale, p.dv);
  }
}

// Scratch of one team for the weighted cumulation: bucket lists and the Dw x Dv tables.
struct WeightedTables {
  BucketLists lists;
  std::vector<float> table;  // (used, Dw, Dv), grown on demand up to the budget

  explicit WeightedTables(const CumulateParams& p) : lists(p.buckets, p.nk) {}
};

void weighted_cumulate_head(const CumulateParams& p, int64_t b, WeightedTables& ws, int team) {
  const float* qw = p.q_w + b * p.nq * p.dw;
  const float* kw = p.k_w + b * p.nk * p.dw;
  const float* v = p.v + b * p.nk * p.dv;
  float* out = p.out + b * p.nq * p.dv;
  const int64_t cell = p.dw * p.dv;
  constexpr int64_t kTableRows = 8;  // Dw rows of one bucket table per work item
  const int64_t chunks = (p.dw + kTableRows - 1) / kTableRows;
  const int64_t blocks = (p.nq + kRowBlock - 1) / kRowBlock;
  BucketLists& lists = ws.lists;
  bool use_table = false;
#pragma omp parallel num_threads(team) if (team > 1)
  for (int64_t h = 0; h < p.m; ++h) {
    const int32_t* qc = p.q_codes + (b * p.m + h) * p.nq;
    const int32_t* kc = p.k_codes + (b * p.m + h) * p.nk;
    const float scale = h + 1 == p.m ? 1.f / float(p.m) : 1.f;
#pragma omp single
    {
      lists.build(kc, p.nk);
      // The cheaper exact scheme for this hash, from its bucket sizes: a Dw x Dv table per
      // bucket costs (keys + queries) * Dw * Dv; walking each query's bucket costs
      // (colliding pairs) * (Dw + Dv). The data decides, never the thread count, and both
      // sum each output row in the same order whichever thread runs it.
      int64_t pairs = 0;
      for (int64_t i = 0; i < p.nq; ++i) {
        const int32_t s = lists.slot(qc[i]);
        if (s >= 0) pairs += lists.start[s + 1] - lists.start[s];
      }
      const int64_t table_cost = (lists.start[lists.used] + p.nq + lists.used) * cell;
      const int64_t table_bytes = lists.used * cell * int64_t(sizeof(float));
      use_table = table_cost < pairs * (p.dw + p.dv) && table_bytes <= kWeightedTableBudgetBytes;
      if (use_table && int64_t(ws.table.size()) < lists.used * cell) ws.table.resize(lists.used * cell);
    }
    if (use_table) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < lists.used * chunks; ++item) {
        const int64_t s = item / chunks, a0 = (item % chunks) * kTableRows;
        fill_weighted_table(p, lists, kw, v, s, a0, std::min(p.dw, a0 + kTableRows), ws.table.data() + s * cell);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t blk = 0; blk < blocks; ++blk)
      gather_weighted_rows(p, lists, qc, qw, kw, v, use_table ? ws.table.data() : nullptr, out, blk * kRowBlock,
                           std::min(p.nq, (blk + 1) * kRowBlock), scale);
#pragma omp single
    kern::clear_slots(kc, p.nk, lists.slot_of.data());
  }
}

}  // namespace

void lsh_weighted_cumulate(const CumulateParams& p, int nthreads) {
  const int64_t ops = p.bh * p.m * (p.nq + p.nk) * (p.dw + p.dv);
  kern::over_heads<WeightedTables>(p, kern::threads_for(ops, nthreads), weighted_cumulate_head);
}

}  // namespace yoso
