// Host launchers of the YOSO CUDA kernels (yoso_cuda.cu, yoso_cuda_weighted.cu, yoso_cuda_hash.cu):
// raw pointers and one params struct, no torch types, so every .cu compiles with nvcc alone (CI
// compiles them for sm_80/86/89/90 without a GPU) and the binding (yoso_cpu.cpp, built with
// -DWITH_CUDA) owns all tensor validation.
//
// Semantics are the CPU contract (kernels/yoso.py lsh_cumulate / lsh_weighted_cumulate):
//   lsh_cumulate:          out[i] = (1/m) sum_h sum_j [k_codes[h,j] == q_codes[h,i]] v[j]
//   lsh_weighted_cumulate: out[i] = (1/m) sum_h sum_j [codes equal] (q_w[i] . k_w[j]) v[j]
// A negative code masks: such a key adds nothing, such a query reads zeros for that hash.
//
// Every launcher returns nullptr on success, or a static message naming the limit that was
// broken (or the CUDA error) — the binding turns it into a RuntimeError.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// For the .cu files' __host__ __device__ bodies (tests run them on the CPU through host drivers):
// loops unrolled on the device only, since g++ rejects nvcc's unroll pragma.
#ifdef __CUDA_ARCH__
#define YOSO_UNROLL _Pragma("unroll")
#else
#define YOSO_UNROLL
#endif

// Kernel-side limits, checked by the launchers (and quoted in their messages).
constexpr int kYosoMaxHashBits = 16;
constexpr int kYosoMaxRotateDim = 2048;  // P, the padded dimension of the fast rotation
constexpr int kYosoMaxInt8KernelDim = 64;  // D, the head dimension yoso_hash_int8 takes (wider: GEMM)

enum class YosoDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct YosoCumulateParams {
  const int32_t* q_codes;  // (bh, m, nq)
  const int32_t* k_codes;  // (bh, m, nk)
  const void* v;           // (bh, nk, dv), dtype `dtype`
  const void* q_w;         // (bh, nq, dw), dtype `dtype`; weighted only
  const void* k_w;         // (bh, nk, dw), dtype `dtype`; weighted only
  float* out;              // (bh, nq, dv) fp32, written (not accumulated into)
  YosoDtype dtype;
  int64_t bh, m, nq, nk, dv, dw;
  int hash_bits;
  // Forward only: build bucket tables by a stable bucket sort and in-order sums instead of
  // float atomics, so the output is bit-identical from run to run. Every caller in the project
  // sets it (false only where the GPU bench opts in to the atomic build). The weighted
  // cumulation is always deterministic.
  bool deterministic;
  void* workspace;  // device scratch of yoso_*_workspace_bytes(params) bytes, 256-byte aligned
};

// Device scratch a call needs; depends on shapes, hash_bits and `deterministic` only.
size_t yoso_cumulate_workspace_bytes(const YosoCumulateParams& p);
size_t yoso_weighted_cumulate_workspace_bytes(const YosoCumulateParams& p);

// How a call is cut into passes (host only, no device work; tests and docs read it). The hashes
// per pass depend on Nq, Nk, Dv, Dw, m and hash_bits, never on bh, so a row's sums are grouped
// alike alone or in any batch; the scratch budget (256 MiB) is met by taking fewer rows per pass.
struct YosoPlan {
  int64_t hashes_per_pass, rows_per_pass;
  int64_t table_rows;  // rows of one (row, hash) bucket table: 2^tau, or Nk when Nk < 2^tau (sorted)
  bool sorted;         // bucket tables by the stable sort (deterministic, or 2^tau too big for smem)
  size_t workspace_bytes;
};
YosoPlan yoso_cumulate_plan(const YosoCumulateParams& p);
YosoPlan yoso_weighted_cumulate_plan(const YosoCumulateParams& p);

const char* yoso_lsh_cumulate(const YosoCumulateParams& p, cudaStream_t stream);
const char* yoso_lsh_weighted_cumulate(const YosoCumulateParams& p, cudaStream_t stream);

// Gaussian hyperplane codes from precomputed projections:
//   proj (bh, n, m*hash_bits) fp32, column h*hash_bits + t = bit t of hash h
//   codes (bh, m, n) int32 = sum_t 2^t [proj > 0]
const char* yoso_hash_pack(const float* proj, int32_t* codes, int64_t bh, int64_t n, int64_t m, int hash_bits,
                           cudaStream_t stream);

// Fast approximate rotation H.D3.H.D2.H.D1 per hash on x zero-padded to p (a power of two):
//   x (bh, n, d) fp32; signs (heads, m, 3, p) fp32 +-1 with [.., 0, :] = D1 (applied first);
//   row bh uses head bh % heads; codes (bh, m, n) int32 = sum_t 2^t [(R x)_t > 0], t < hash_bits.
// Butterflies run in the order of hashing.walsh_hadamard (half = 1, 2, 4, ...) with rounded
// (never fused) adds, so the codes equal hashing.hash_codes_ref bit for bit.
const char* yoso_hash_rotate(const float* x, const float* signs, int32_t* codes, int64_t bh, int64_t heads,
                             int64_t n, int64_t d, int64_t m, int64_t p, int hash_bits, cudaStream_t stream);

// Int8 hashing of rows x (bh, n, d) fp32, 1 <= d <= 64, in one kernel: each row quantized to
// x8 = round(x / max|x| * 127) (round half to even; a zero row stays zero), then codes (bh, m, n) int32
// with bit t of hash h = [sum_c x8[c] * planes[bh % heads][c][h * hash_bits + t] > 0]; planes
// (heads, d, m * hash_bits) fp32 integers in [-127, 127] (not checked: reading them back would sync).
// The sums are exact, so the codes equal hashing.hash_codes(int8=True)'s bit for bit.
const char* yoso_hash_int8(const float* x, const float* planes, int32_t* codes, int64_t bh, int64_t heads, int64_t n,
                           int64_t d, int64_t m, int hash_bits, cudaStream_t stream);
