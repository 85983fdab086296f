// Plain parameter structs and entry points of the YOSO CPU kernels (yoso_cpu_kernels.cpp).
// Validation lives in the binding (yoso_cpu.cpp); the kernels trust these fields.
#pragma once

#include <cstdint>

namespace yoso {

constexpr int kMaxHashBits = 16;

struct CumulateParams {
  const int32_t* q_codes;  // (BH, m, Nq), negative = masked query
  const int32_t* k_codes;  // (BH, m, Nk), negative = masked key
  const float* q_w;        // (BH, Nq, Dw), weighted only
  const float* k_w;        // (BH, Nk, Dw), weighted only
  const float* v;          // (BH, Nk, Dv)
  float* out;              // (BH, Nq, Dv), zero on entry
  int64_t bh, m, nq, nk, dw, dv;
  int64_t buckets;  // 2^hash_bits; every code is below it
};

struct HashParams {
  const float* x;     // (B, H, N, D)
  const float* proj;  // (H, D, m * hash_bits): column h*hash_bits + t is bit t of hash h
  int32_t* codes;     // (B, H, m, N)
  int64_t batch, heads, n, d, m;
  int hash_bits;
};

// out[i] = (1/m) sum_h sum_j [k_codes[h,j] == q_codes[h,i]] v[j]
void lsh_cumulate(const CumulateParams& p, int nthreads);
// out[i] = (1/m) sum_h sum_j [codes equal] (q_w[i] . k_w[j]) v[j]
void lsh_weighted_cumulate(const CumulateParams& p, int nthreads);
// codes[b, head, h, i] = sum_t 2^t [x[b, head, i] . proj[head, :, h*hash_bits + t] > 0]
void hash_codes(const HashParams& p, int nthreads);

}  // namespace yoso
