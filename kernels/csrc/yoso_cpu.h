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
  bool int8;          // proj holds integers in [-127, 127]; rows are hashed quantized (yoso_cpu_simd.h)
  const int8_t* packed;           // int8: pack_planes_i8 of proj when the VNNI body runs, else null
  const int32_t* packed_offset;   // its column offsets
};

// q, k, v, out are (B, H, N, D|Dv) views with unit stride along D: element (b, h, i, c) of x is at
// x + b * x_stride[0] + h * x_stride[1] + i * x_stride[2] + c, so (B, N, H, D) memory, as a model's
// head split leaves it, is read and written in place.
struct AttentionParams {
  const void* q;         // (B, H, N, D), any scale: a code is a sign pattern; fp32, or bf16 where bf16 is set
  const void* k;         // (B, H, N, D)
  const void* v;         // (B, H, N, Dv)
  bool bf16;             // q, k, v hold bf16 (the top 16 bits of an fp32), read as their fp32 values
  const float* proj;     // (H, D, m * hash_bits), as HashParams
  const uint8_t* keep;   // (B, N) 0 = padded token (masked key and query), or null
  float* out;            // (B, H, N, Dv), zero on entry (exact_attention writes every row: any contents)
  int64_t batch, heads, n, d, dv, m;
  int64_t q_stride[3], k_stride[3], v_stride[3], out_stride[3];
  int hash_bits;
  bool int8;             // as HashParams
  const int8_t* packed;
  const int32_t* packed_offset;
};

struct ExactParams {
  const float* q;     // (BH, N, D) unit rows
  const float* k;     // (BH, N, D) unit rows
  const float* v;     // (BH, N, Dv)
  const float* keep;  // (BH, N) 0/1: padded keys weigh nothing, padded queries give zero rows
  const float* grad;  // (BH, N, Dv) d loss / d out, backward only
  float* out;         // (BH, N, Dv), forward
  float* grad_q;      // (BH, N, D), backward, zero on entry
  float* grad_k;      // (BH, N, D), backward, zero on entry
  float* grad_v;      // (BH, N, Dv), backward, zero on entry
  int64_t bh, n, d, dv;
  int64_t heads;                      // v and out rows of (batch*head) b start at b / heads, b % heads:
  int64_t v_stride[3], out_stride[3]; // strides as in AttentionParams (forward only)
  int tau;
  bool true_grad;     // backward: the forward's derivative instead of the paper's tau/2 E[B] bound
  float min_sine;     // floor of sin(theta) in the true derivative
};

// out[i] = (1/m) sum_h sum_j [k_codes[h,j] == q_codes[h,i]] v[j]
void lsh_cumulate(const CumulateParams& p, int nthreads);
// out[i] = (1/m) sum_h sum_j [codes equal] (q_w[i] . k_w[j]) v[j]
void lsh_weighted_cumulate(const CumulateParams& p, int nthreads);
// codes[b, head, h, i] = sum_t 2^t [x[b, head, i] . proj[head, :, h*hash_bits + t] > 0]
void hash_codes(const HashParams& p, int nthreads);

// Hash codes of q and k (kept in per-thread scratch, never returned) and the cumulation in one
// pass: equal, bit for bit, to lsh_cumulate(hash_codes(q), hash_codes(k), v) with masked codes.
void lsh_attention(const AttentionParams& p, int nthreads);
// out = ((1 - arccos(q.k)/pi)^tau * keep_k) v * keep_q, in query x key blocks (yoso_cpu_exact.cpp)
void exact_forward(const ExactParams& p, int nthreads);
// The same forward from raw (B, H, N, D) views (AttentionParams' q, k, v, keep, out, strides; q, k, v fp32
// or bf16): rows are l2-normalised here (x / max(|x|, 1e-12), as F.normalize), for inference. The same bits
// as exact_forward over the normalised rows, and for bf16 inputs as for their fp32 values.
void exact_attention(const AttentionParams& p, int nthreads);
// grad_v = W^T g, grad_q = (g v^T * slope) k, grad_k = (g v^T * slope)^T q with g = grad * keep_q
void exact_backward(const ExactParams& p, int nthreads);

}  // namespace yoso
