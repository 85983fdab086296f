// What the LSH cumulation files share (yoso_cpu_kernels.cpp: plain and fused cumulation, hash codes;
// yoso_cpu_weighted.cpp: the weighted cumulation): the SIMD clone attribute, the work sizes, and the
// order in which threads take (batch*head) slices. Internal to the kernels; no torch headers.
#pragma once

#include "yoso_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>

// Hot loops are compiled twice, for AVX2+FMA (x86-64-v3) and for the baseline, and the loader
// picks one per machine: the build stays portable (no -march=native) and a given machine
// always runs the same code.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define YOSO_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define YOSO_SIMD_CLONES
#endif

namespace yoso::kern {

constexpr int64_t kRowBlock = 64;  // query rows per work item
// Fewest multiply-adds worth waking another thread for (about 0.1 ms of work): like torch's
// grain size, small calls stay on the calling thread, where a shared CPU cannot stall them at
// a barrier waiting for a descheduled worker. Thread counts never change results.
constexpr int64_t kGrainOps = int64_t(1) << 18;

inline int threads_for(int64_t ops, int nthreads) {
  return int(std::max<int64_t>(1, std::min<int64_t>(nthreads, ops / kGrainOps)));
}

// Empties the slot map entries one hash's keys filled (-1 between uses).
inline void clear_slots(const int32_t* codes, int64_t nk, int32_t* slot_of) {
  for (int64_t j = 0; j < nk; ++j)
    if (codes[j] >= 0) slot_of[codes[j]] = -1;
}

// With at least as many (batch*head) slices as threads, each thread takes whole slices and runs
// them alone (no barriers, which cost most when the CPU is shared); otherwise all threads work
// on one slice at a time. Both orders give every output row the same arithmetic.
template <typename Scratch, typename Head>
void over_heads(const CumulateParams& p, int nthreads, Head head) {
  if (p.bh >= nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
      Scratch ws(p);
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < p.bh; ++b) head(p, b, ws, 1);
    }
  } else {
    Scratch ws(p);
    for (int64_t b = 0; b < p.bh; ++b) head(p, b, ws, nthreads);
  }
}

}  // namespace yoso::kern
