// The one pybind11 binding of the YOSO CPU extension: validation, then plain params structs
// go to the OpenMP kernels in yoso_cpu_kernels.cpp.
//
//   lsh_cumulate(q_codes, k_codes, v, hash_bits)                     -> (BH, Nq, Dv) fp32
//   lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, hash_bits)  -> (BH, Nq, Dv) fp32
//   fast_hash_codes(x, proj, num_hashes, hash_bits)                  -> (B, H, m, N) int32
//   lsh_attention(q, k, v, proj, keep, num_hashes, hash_bits)        -> (B, H, N, Dv) fp32, inference
//   exact_attention(q, k, v, keep, hash_bits)                        -> (B, H, N, Dv) fp32, inference
//   exact_forward(q, k, v, keep, hash_bits)                          -> (BH, N, Dv) fp32
//   exact_backward(q, k, v, keep, grad, hash_bits, true_grad)        -> grad q, k, v
//   collision_probability(cosines, hash_bits)                        -> (1 - arccos/pi)^tau, fp32
//
// A negative code masks: such a key adds nothing, such a query reads zeros for that hash.
// Every check names the limit it enforces (TORCH_CHECK -> RuntimeError in Python).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "yoso_cpu.h"
#include "yoso_cpu_simd.h"

#ifdef WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "yoso_cuda.h"
#endif

namespace {

using yoso::kMaxHashBits;

void check_tensor(const torch::Tensor& t, const char* name, at::ScalarType dtype, int64_t rank) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.dim() == rank, name, " must have rank ", rank, ", got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_codes_range(const torch::Tensor& codes, const char* name, int64_t buckets, int64_t hash_bits) {
  if (codes.numel() == 0) return;
  const int64_t top = codes.max().item<int64_t>();
  TORCH_CHECK(top < buckets, name, " holds code ", top, " but hash_bits=", hash_bits,
              " allows codes below 2^hash_bits = ", buckets, " (negative codes mean masked)");
}

// The shape rules both devices share, once rank, dtype and device are checked, then the codes'
// range; returns the bucket count 2^hash_bits.
int64_t check_codes_against_values(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                                   int64_t hash_bits) {
  TORCH_CHECK(q_codes.size(0) == k_codes.size(0) && k_codes.size(0) == v.size(0),
              "batch*heads must match: q_codes (BH, m, Nq) ", q_codes.sizes(), ", k_codes (BH, m, Nk) ",
              k_codes.sizes(), ", v (BH, Nk, Dv) ", v.sizes());
  TORCH_CHECK(q_codes.size(1) == k_codes.size(1), "number of hashes m must match: q_codes has ", q_codes.size(1),
              ", k_codes has ", k_codes.size(1));
  TORCH_CHECK(q_codes.size(1) >= 1, "number of hashes m must be at least 1, got ", q_codes.size(1));
  TORCH_CHECK(k_codes.size(2) == v.size(1), "Nk must match: k_codes (BH, m, Nk) ", k_codes.sizes(),
              " vs v (BH, Nk, Dv) ", v.sizes());
  TORCH_CHECK(k_codes.size(2) < (int64_t(1) << 31), "Nk must be below 2^31, got ", k_codes.size(2));
  const int64_t buckets = int64_t(1) << hash_bits;
  check_codes_range(q_codes, "q_codes", buckets, hash_bits);
  check_codes_range(k_codes, "k_codes", buckets, hash_bits);
  return buckets;
}

yoso::CumulateParams check_common(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                            int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  check_tensor(q_codes, "q_codes", at::kInt, 3);
  check_tensor(k_codes, "k_codes", at::kInt, 3);
  check_tensor(v, "v", at::kFloat, 3);
  const int64_t buckets = check_codes_against_values(q_codes, k_codes, v, hash_bits);
  yoso::CumulateParams p{};
  p.q_codes = q_codes.data_ptr<int32_t>();
  p.k_codes = k_codes.data_ptr<int32_t>();
  p.v = v.data_ptr<float>();
  p.bh = q_codes.size(0);
  p.m = q_codes.size(1);
  p.nq = q_codes.size(2);
  p.nk = k_codes.size(2);
  p.dv = v.size(2);
  p.buckets = buckets;
  return p;
}

#ifdef WITH_CUDA
// ---- CUDA (yoso_cuda.cu): the same checks with CUDA devices, then the raw launchers ----

void check_cuda_tensor(const torch::Tensor& t, const char* name, int64_t rank, const torch::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), " like the other inputs, got ",
              t.device());
  TORCH_CHECK(t.dim() == rank, name, " must have rank ", rank, ", got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

YosoDtype cuda_float_dtype(const torch::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return YosoDtype::kFloat32;
  if (t.scalar_type() == at::kHalf) return YosoDtype::kFloat16;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32, float16 or bfloat16, got ",
              c10::toString(t.scalar_type()));
  return YosoDtype::kBFloat16;
}

void check_cuda_call(const char* err) { TORCH_CHECK(err == nullptr, "YOSO CUDA kernel: ", err); }

YosoCumulateParams check_common_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes,
                                     const torch::Tensor& v, int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  check_cuda_tensor(v, "v", 3, v);
  check_cuda_tensor(q_codes, "q_codes", 3, v);
  check_cuda_tensor(k_codes, "k_codes", 3, v);
  TORCH_CHECK(q_codes.scalar_type() == at::kInt, "q_codes must be int32, got ", c10::toString(q_codes.scalar_type()));
  TORCH_CHECK(k_codes.scalar_type() == at::kInt, "k_codes must be int32, got ", c10::toString(k_codes.scalar_type()));
  TORCH_CHECK(q_codes.size(2) < (int64_t(1) << 31), "Nq must be below 2^31, got ", q_codes.size(2));
  check_codes_against_values(q_codes, k_codes, v, hash_bits);
  YosoCumulateParams p{};
  p.q_codes = q_codes.data_ptr<int32_t>();
  p.k_codes = k_codes.data_ptr<int32_t>();
  p.v = v.data_ptr();
  p.dtype = cuda_float_dtype(v, "v");
  p.bh = q_codes.size(0);
  p.m = q_codes.size(1);
  p.nq = q_codes.size(2);
  p.nk = k_codes.size(2);
  p.dv = v.size(2);
  p.hash_bits = static_cast<int>(hash_bits);
  return p;
}

torch::Tensor cuda_workspace(size_t bytes, const torch::Tensor& like) {
  return torch::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

torch::Tensor lsh_cumulate_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                                int64_t hash_bits, bool deterministic) {
  const c10::cuda::CUDAGuard guard(v.device());
  YosoCumulateParams p = check_common_cuda(q_codes, k_codes, v, hash_bits);
  torch::Tensor out = torch::empty({p.bh, p.nq, p.dv}, v.options().dtype(at::kFloat));
  p.out = out.data_ptr<float>();
  p.deterministic = deterministic;
  const torch::Tensor workspace = cuda_workspace(yoso_cumulate_workspace_bytes(p), v);
  p.workspace = workspace.data_ptr();
  check_cuda_call(yoso_lsh_cumulate(p, c10::cuda::getCurrentCUDAStream()));
  return out;
}

torch::Tensor lsh_weighted_cumulate_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes,
                                         const torch::Tensor& q_w, const torch::Tensor& k_w, const torch::Tensor& v,
                                         int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(v.device());
  YosoCumulateParams p = check_common_cuda(q_codes, k_codes, v, hash_bits);
  check_cuda_tensor(q_w, "q_w", 3, v);
  check_cuda_tensor(k_w, "k_w", 3, v);
  TORCH_CHECK(q_w.scalar_type() == v.scalar_type() && k_w.scalar_type() == v.scalar_type(),
              "q_w, k_w and v must share one dtype, got ", c10::toString(q_w.scalar_type()), ", ",
              c10::toString(k_w.scalar_type()), ", ", c10::toString(v.scalar_type()));
  TORCH_CHECK(q_w.size(0) == p.bh && q_w.size(1) == p.nq, "q_w must be (BH, Nq, Dw) = (", p.bh, ", ", p.nq,
              ", Dw), got ", q_w.sizes());
  TORCH_CHECK(k_w.size(0) == p.bh && k_w.size(1) == p.nk, "k_w must be (BH, Nk, Dw) = (", p.bh, ", ", p.nk,
              ", Dw), got ", k_w.sizes());
  TORCH_CHECK(q_w.size(2) == k_w.size(2), "Dw must match: q_w has ", q_w.size(2), ", k_w has ", k_w.size(2));
  p.q_w = q_w.data_ptr();
  p.k_w = k_w.data_ptr();
  p.dw = q_w.size(2);
  torch::Tensor out = torch::empty({p.bh, p.nq, p.dv}, v.options().dtype(at::kFloat));
  p.out = out.data_ptr<float>();
  const torch::Tensor workspace = cuda_workspace(yoso_weighted_cumulate_workspace_bytes(p), v);
  p.workspace = workspace.data_ptr();
  check_cuda_call(yoso_lsh_weighted_cumulate(p, c10::cuda::getCurrentCUDAStream()));
  return out;
}

torch::Tensor hash_pack_cuda(const torch::Tensor& proj, int64_t num_hashes, int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(proj.device());
  check_cuda_tensor(proj, "proj", 3, proj);
  TORCH_CHECK(proj.scalar_type() == at::kFloat, "proj must be float32, got ", c10::toString(proj.scalar_type()));
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  TORCH_CHECK(num_hashes >= 1 && proj.size(2) == num_hashes * hash_bits,
              "proj must be (BH, N, num_hashes*hash_bits) = (BH, N, ", num_hashes * hash_bits, "), got ",
              proj.sizes());
  torch::Tensor codes = torch::empty({proj.size(0), num_hashes, proj.size(1)}, proj.options().dtype(at::kInt));
  check_cuda_call(yoso_hash_pack(proj.data_ptr<float>(), codes.data_ptr<int32_t>(), proj.size(0), proj.size(1),
                                 num_hashes, static_cast<int>(hash_bits), c10::cuda::getCurrentCUDAStream()));
  return codes;
}

torch::Tensor hash_rotate_cuda(const torch::Tensor& x, const torch::Tensor& signs, int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda_tensor(x, "x", 3, x);
  check_cuda_tensor(signs, "signs", 4, x);
  TORCH_CHECK(x.scalar_type() == at::kFloat && signs.scalar_type() == at::kFloat,
              "x and signs must be float32, got ", c10::toString(x.scalar_type()), " and ",
              c10::toString(signs.scalar_type()));
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  TORCH_CHECK(signs.size(2) == 3, "signs must be (H, m, 3, P), got ", signs.sizes());
  TORCH_CHECK(signs.size(0) >= 1 && x.size(0) % signs.size(0) == 0,
              "x rows (BH) must be a multiple of the heads H in signs (H, m, 3, P): ", x.sizes(), " vs ",
              signs.sizes());
  const int64_t p = signs.size(3);
  TORCH_CHECK(p <= kYosoMaxRotateDim, "padded dimension P must be at most ", kYosoMaxRotateDim, ", got ", p);
  TORCH_CHECK((p & (p - 1)) == 0 && p >= x.size(2) && p >= hash_bits,
              "P must be a power of two >= max(D, hash_bits), got P=", p, " for D=", x.size(2));
  torch::Tensor codes = torch::empty({x.size(0), signs.size(1), x.size(1)}, x.options().dtype(at::kInt));
  check_cuda_call(yoso_hash_rotate(x.data_ptr<float>(), signs.data_ptr<float>(), codes.data_ptr<int32_t>(),
                                   x.size(0), signs.size(0), x.size(1), x.size(2), signs.size(1), p,
                                   static_cast<int>(hash_bits), c10::cuda::getCurrentCUDAStream()));
  return codes;
}

torch::Tensor fast_hash_codes_cuda(const torch::Tensor& x, const torch::Tensor& proj, int64_t num_hashes,
                                   int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda_tensor(x, "x", 4, x);
  check_cuda_tensor(proj, "proj", 3, x);
  TORCH_CHECK(x.scalar_type() == at::kFloat && proj.scalar_type() == at::kFloat, "x and proj must be float32, got ",
              c10::toString(x.scalar_type()), " and ", c10::toString(proj.scalar_type()));
  TORCH_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  TORCH_CHECK(proj.size(0) == x.size(1) && proj.size(1) == x.size(3) && proj.size(2) == num_hashes * hash_bits,
              "proj must be (H, D, num_hashes*hash_bits) = (", x.size(1), ", ", x.size(3), ", ", num_hashes * hash_bits,
              ") for x (B, H, N, D) ", x.sizes(), ", got ", proj.sizes());
  // One batched GEMM (cuBLAS) for every projection, then one kernel packs the sign bits.
  const torch::Tensor scores = torch::matmul(x, proj).reshape({x.size(0) * x.size(1), x.size(2), proj.size(2)});
  return hash_pack_cuda(scores, num_hashes, hash_bits).view({x.size(0), x.size(1), num_hashes, x.size(2)});
}
#endif  // WITH_CUDA

torch::Tensor lsh_cumulate(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                           int64_t hash_bits) {
#ifdef WITH_CUDA
  if (v.is_cuda())
    return lsh_cumulate_cuda(q_codes, k_codes, v, hash_bits, at::globalContext().deterministicAlgorithms());
#endif
  yoso::CumulateParams p = check_common(q_codes, k_codes, v, hash_bits);
  torch::Tensor out = torch::zeros({p.bh, p.nq, p.dv}, v.options());
  if (out.numel() == 0 || p.nk == 0) return out;
  p.out = out.data_ptr<float>();
  yoso::lsh_cumulate(p, at::get_num_threads());
  return out;
}

torch::Tensor lsh_weighted_cumulate(const torch::Tensor& q_codes, const torch::Tensor& k_codes,
                                    const torch::Tensor& q_w, const torch::Tensor& k_w, const torch::Tensor& v,
                                    int64_t hash_bits) {
#ifdef WITH_CUDA
  if (v.is_cuda()) return lsh_weighted_cumulate_cuda(q_codes, k_codes, q_w, k_w, v, hash_bits);
#endif
  yoso::CumulateParams p = check_common(q_codes, k_codes, v, hash_bits);
  check_tensor(q_w, "q_w", at::kFloat, 3);
  check_tensor(k_w, "k_w", at::kFloat, 3);
  TORCH_CHECK(q_w.size(0) == p.bh && q_w.size(1) == p.nq, "q_w must be (BH, Nq, Dw) = (", p.bh, ", ", p.nq,
              ", Dw), got ", q_w.sizes());
  TORCH_CHECK(k_w.size(0) == p.bh && k_w.size(1) == p.nk, "k_w must be (BH, Nk, Dw) = (", p.bh, ", ", p.nk,
              ", Dw), got ", k_w.sizes());
  TORCH_CHECK(q_w.size(2) == k_w.size(2), "Dw must match: q_w has ", q_w.size(2), ", k_w has ", k_w.size(2));
  torch::Tensor out = torch::zeros({p.bh, p.nq, p.dv}, v.options());
  p.dw = q_w.size(2);
  if (out.numel() == 0 || p.nk == 0 || p.dw == 0) return out;
  p.q_w = q_w.data_ptr<float>();
  p.k_w = k_w.data_ptr<float>();
  p.out = out.data_ptr<float>();
  yoso::lsh_weighted_cumulate(p, at::get_num_threads());
  return out;
}

torch::Tensor fast_hash_codes(const torch::Tensor& x, const torch::Tensor& proj, int64_t num_hashes,
                              int64_t hash_bits) {
#ifdef WITH_CUDA
  if (x.is_cuda()) return fast_hash_codes_cuda(x, proj, num_hashes, hash_bits);
#endif
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  TORCH_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  check_tensor(x, "x", at::kFloat, 4);
  check_tensor(proj, "proj", at::kFloat, 3);
  TORCH_CHECK(proj.size(0) == x.size(1) && proj.size(1) == x.size(3) && proj.size(2) == num_hashes * hash_bits,
              "proj must be (H, D, num_hashes*hash_bits) = (", x.size(1), ", ", x.size(3), ", ", num_hashes * hash_bits,
              ") for x (B, H, N, D) ", x.sizes(), ", got ", proj.sizes());
  torch::Tensor codes = torch::empty({x.size(0), x.size(1), num_hashes, x.size(2)}, x.options().dtype(at::kInt));
  if (codes.numel() == 0) return codes;
  if (x.size(3) == 0) return codes.zero_();
  yoso::HashParams p{};
  p.x = x.data_ptr<float>();
  p.proj = proj.data_ptr<float>();
  p.codes = codes.data_ptr<int32_t>();
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.n = x.size(2);
  p.d = x.size(3);
  p.m = num_hashes;
  p.hash_bits = int(hash_bits);
  yoso::hash_codes(p, at::get_num_threads());
  return codes;
}

// A (B, H, N, D) fp32 CPU view whose last dimension has unit stride (a head split needs no copy).
void check_view(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be Float, got ", c10::toString(t.scalar_type()));
  TORCH_CHECK(t.dim() == 4, name, " must have rank 4 (B, H, N, D), got shape ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1, name, " must have unit stride along D, got strides ", t.strides());
}

// q, k, v (B, H, N, D|Dv) views and keep (B, N) bool or None -> params with strides and an output
// allocated as (B, N, H, Dv), returned as its (B, H, N, Dv) view so the heads merge without a copy.
std::pair<yoso::AttentionParams, torch::Tensor> attention_params(const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 const c10::optional<torch::Tensor>& keep) {
  check_view(q, "q");
  check_view(k, "k");
  check_view(v, "v");
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape (B, H, N, D) ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes().slice(0, 3) == q.sizes().slice(0, 3), "v must be (B, H, N, Dv) with q's B, H, N ",
              q.sizes(), ", got ", v.sizes());
  TORCH_CHECK(q.size(2) < (int64_t(1) << 31), "N must be below 2^31, got ", q.size(2));
  if (keep.has_value()) {
    check_tensor(*keep, "keep", at::kBool, 2);
    TORCH_CHECK(keep->size(0) == q.size(0) && keep->size(1) == q.size(2), "keep must be (B, N) = (", q.size(0),
                ", ", q.size(2), "), got ", keep->sizes());
  }
  torch::Tensor out = torch::zeros({v.size(0), v.size(2), v.size(1), v.size(3)}, v.options()).transpose(1, 2);
  yoso::AttentionParams p{};
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.keep = keep.has_value() ? reinterpret_cast<const uint8_t*>(keep->data_ptr<bool>()) : nullptr;
  p.out = out.data_ptr<float>();
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.n = q.size(2);
  p.d = q.size(3);
  p.dv = v.size(3);
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = q.stride(i);
    p.k_stride[i] = k.stride(i);
    p.v_stride[i] = v.stride(i);
    p.out_stride[i] = out.stride(i);
  }
  return {p, out};
}

torch::Tensor lsh_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& proj, const c10::optional<torch::Tensor>& keep, int64_t num_hashes,
                            int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  TORCH_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  check_tensor(proj, "proj", at::kFloat, 3);
  auto [p, out] = attention_params(q, k, v, keep);
  TORCH_CHECK(proj.size(0) == q.size(1) && proj.size(1) == q.size(3) && proj.size(2) == num_hashes * hash_bits,
              "proj must be (H, D, num_hashes*hash_bits) = (", q.size(1), ", ", q.size(3), ", ",
              num_hashes * hash_bits, "), got ", proj.sizes());
  if (out.numel() == 0) return out;
  p.proj = proj.data_ptr<float>();
  p.m = num_hashes;
  p.hash_bits = int(hash_bits);
  yoso::lsh_attention(p, at::get_num_threads());
  return out;
}

torch::Tensor exact_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const c10::optional<torch::Tensor>& keep, int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  auto [p, out] = attention_params(q, k, v, keep);
  if (out.numel() == 0) return out;
  p.hash_bits = int(hash_bits);
  yoso::exact_attention(p, at::get_num_threads());
  return out;
}

yoso::ExactParams check_exact(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& keep, int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  check_tensor(q, "q", at::kFloat, 3);
  check_tensor(k, "k", at::kFloat, 3);
  check_tensor(v, "v", at::kFloat, 3);
  check_tensor(keep, "keep", at::kFloat, 2);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape (BH, N, D) ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), "v must be (BH, N, Dv) = (", q.size(0), ", ",
              q.size(1), ", Dv), got ", v.sizes());
  TORCH_CHECK(keep.size(0) == q.size(0) && keep.size(1) == q.size(1), "keep must be (BH, N) = (", q.size(0), ", ",
              q.size(1), "), got ", keep.sizes());
  yoso::ExactParams p{};
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.keep = keep.data_ptr<float>();
  p.bh = q.size(0);
  p.n = q.size(1);
  p.d = q.size(2);
  p.dv = v.size(2);
  p.heads = 1;  // (BH, N, Dv) rows as (batch = BH, head = 0, row); out is allocated like v
  p.v_stride[0] = p.out_stride[0] = v.stride(0);
  p.v_stride[1] = p.out_stride[1] = 0;
  p.v_stride[2] = p.out_stride[2] = v.stride(1);
  p.tau = int(hash_bits);
  return p;
}

torch::Tensor exact_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& keep, int64_t hash_bits) {
  yoso::ExactParams p = check_exact(q, k, v, keep, hash_bits);
  torch::Tensor out = torch::zeros(v.sizes(), v.options());
  if (out.numel() == 0) return out;
  p.out = out.data_ptr<float>();
  yoso::exact_forward(p, at::get_num_threads());
  return out;
}

std::vector<torch::Tensor> exact_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& keep, const torch::Tensor& grad, int64_t hash_bits,
                                          bool true_grad, double min_sine) {
  yoso::ExactParams p = check_exact(q, k, v, keep, hash_bits);
  check_tensor(grad, "grad", at::kFloat, 3);
  TORCH_CHECK(grad.sizes() == v.sizes(), "grad must have v's shape (BH, N, Dv) ", v.sizes(), ", got ", grad.sizes());
  TORCH_CHECK(min_sine > 0 && min_sine <= 1, "min_sine must be in (0, 1], got ", min_sine);
  std::vector<torch::Tensor> grads = {torch::zeros_like(q), torch::zeros_like(k), torch::zeros_like(v)};
  if (q.numel() == 0 || v.numel() == 0) return grads;
  p.grad = grad.data_ptr<float>();
  p.grad_q = grads[0].data_ptr<float>();
  p.grad_k = grads[1].data_ptr<float>();
  p.grad_v = grads[2].data_ptr<float>();
  p.true_grad = true_grad;
  p.min_sine = float(min_sine);
  yoso::exact_backward(p, at::get_num_threads());
  return grads;
}

torch::Tensor collision_probability(const torch::Tensor& cosines, int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
              hash_bits);
  TORCH_CHECK(cosines.device().is_cpu() && cosines.scalar_type() == at::kFloat && cosines.is_contiguous(),
              "cosines must be a contiguous float32 CPU tensor");
  torch::Tensor out = cosines.clone();
  yoso::simd::collision_weights(out.data_ptr<float>(), nullptr, nullptr, out.numel(), int(hash_bits), false, 0.f);
  return out;
}

int openmp_max_threads() { return at::get_num_threads(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "YOSO LSH cumulation and hash codes on CPU (OpenMP)";
  m.def("lsh_cumulate", &lsh_cumulate, "(q_codes, k_codes, v, hash_bits) -> (BH, Nq, Dv) fp32",
        py::arg("q_codes"), py::arg("k_codes"), py::arg("v"), py::arg("hash_bits"),
        py::call_guard<py::gil_scoped_release>());
  m.def("lsh_weighted_cumulate", &lsh_weighted_cumulate,
        "(q_codes, k_codes, q_w, k_w, v, hash_bits) -> (BH, Nq, Dv) fp32", py::arg("q_codes"), py::arg("k_codes"),
        py::arg("q_w"), py::arg("k_w"), py::arg("v"), py::arg("hash_bits"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fast_hash_codes", &fast_hash_codes,
        "(x (B, H, N, D) fp32, proj (H, D, m*tau) fp32, num_hashes, hash_bits) -> (B, H, m, N) int32 codes",
        py::arg("x"), py::arg("proj"), py::arg("num_hashes"), py::arg("hash_bits"),
        py::call_guard<py::gil_scoped_release>());
#ifdef WITH_CUDA
  m.def("lsh_cumulate_cuda", &lsh_cumulate_cuda,
        "(q_codes, k_codes, v, hash_bits, deterministic=False) -> (BH, Nq, Dv) fp32 on v's CUDA device",
        py::arg("q_codes"), py::arg("k_codes"), py::arg("v"), py::arg("hash_bits"), py::arg("deterministic") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("lsh_weighted_cumulate_cuda", &lsh_weighted_cumulate_cuda,
        "(q_codes, k_codes, q_w, k_w, v, hash_bits) -> (BH, Nq, Dv) fp32 on v's CUDA device (deterministic)",
        py::arg("q_codes"), py::arg("k_codes"), py::arg("q_w"), py::arg("k_w"), py::arg("v"), py::arg("hash_bits"),
        py::call_guard<py::gil_scoped_release>());
  m.def("hash_pack_cuda", &hash_pack_cuda, "(proj (BH, N, m*tau) fp32, num_hashes, hash_bits) -> (BH, m, N) int32",
        py::arg("proj"), py::arg("num_hashes"), py::arg("hash_bits"), py::call_guard<py::gil_scoped_release>());
  m.def("hash_rotate_cuda", &hash_rotate_cuda,
        "(x (BH, N, D) fp32, signs (H, m, 3, P) fp32, hash_bits) -> (BH, m, N) int32",
        py::arg("x"), py::arg("signs"), py::arg("hash_bits"), py::call_guard<py::gil_scoped_release>());
#endif
  m.def("lsh_attention", &lsh_attention,
        "(q, k (B, H, N, D), v (B, H, N, Dv) fp32, proj (H, D, m*tau), keep (B, N) bool or None, num_hashes, "
        "hash_bits) -> (B, H, N, Dv) fp32 view of (B, N, H, Dv) memory: hashing and cumulation fused",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("proj"), py::arg("keep"), py::arg("num_hashes"),
        py::arg("hash_bits"), py::call_guard<py::gil_scoped_release>());
  m.def("exact_attention", &exact_attention,
        "(q, k (B, H, N, D) raw, v (B, H, N, Dv) fp32 views, keep (B, N) bool or None, hash_bits) -> (B, H, N, Dv) "
        "fp32 view of (B, N, H, Dv) memory: YOSO-E for inference, rows normalised inside",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keep"), py::arg("hash_bits"),
        py::call_guard<py::gil_scoped_release>());
  m.def("exact_forward", &exact_forward, "(q, k (BH, N, D) unit, v (BH, N, Dv), keep (BH, N), hash_bits) -> out",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keep"), py::arg("hash_bits"),
        py::call_guard<py::gil_scoped_release>());
  m.def("exact_backward", &exact_backward,
        "(q, k, v, keep, grad, hash_bits, true_grad, min_sine) -> [grad_q, grad_k, grad_v]", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("keep"), py::arg("grad"), py::arg("hash_bits"), py::arg("true_grad"),
        py::arg("min_sine"), py::call_guard<py::gil_scoped_release>());
  m.def("collision_probability", &collision_probability,
        "(cosines fp32, hash_bits) -> (1 - arccos(clamp(c))/pi)^tau, the exact kernels' vectorised formula",
        py::arg("cosines"), py::arg("hash_bits"));
  m.def("simd_level", &yoso::simd::level, "which kernel bodies run: avx2 or portable");
  m.def("openmp_max_threads", &openmp_max_threads, "threads the kernels run on (torch's intra-op count)");
}
