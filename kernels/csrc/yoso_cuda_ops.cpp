// The CUDA extension's bindings (built with -DWITH_CUDA into yoso_serve_cuda only): the checks of
// yoso_cpu.cpp with CUDA devices, then the raw launchers of yoso_cuda.cu, yoso_cuda_weighted.cu and
// yoso_cuda_hash.cu. yoso_cpu.cpp's lsh_cumulate, lsh_weighted_cumulate and fast_hash_codes hand CUDA
// tensors to the three ops defined outside the anonymous namespace here.

#ifdef WITH_CUDA

#include <torch/extension.h>

#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "yoso_check.h"
#include "yoso_cpu.h"
#include "yoso_cuda.h"

namespace {

using yoso::kMaxHashBits;

void check_cuda_tensor(const torch::Tensor& t, const char* name, int64_t rank, const torch::Tensor& like) {
  YOSO_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  YOSO_CHECK(t.device() == like.device(), name, " must be on ", like.device(), " like the other inputs, got ",
             t.device());
  YOSO_CHECK(t.dim() == rank, name, " must have rank ", rank, ", got shape ", t.sizes());
  YOSO_CHECK(t.is_contiguous(), name, " must be contiguous");
}

YosoDtype cuda_float_dtype(const torch::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return YosoDtype::kFloat32;
  if (t.scalar_type() == at::kHalf) return YosoDtype::kFloat16;
  YOSO_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32, float16 or bfloat16, got ",
             c10::toString(t.scalar_type()));
  return YosoDtype::kBFloat16;
}

void check_cuda_call(const char* err) { YOSO_CHECK(err == nullptr, "YOSO CUDA kernel: ", err); }

// check_codes=false skips the codes' range check, the one check that reads device memory
// (codes.max().item() waits for the GPU and cannot be captured in a CUDA graph). The kernels
// never index out of bounds either way: they treat a code >= 2^hash_bits like a masked one.
YosoCumulateParams check_common_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes,
                                     const torch::Tensor& v, int64_t hash_bits, bool check_codes) {
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  check_cuda_tensor(v, "v", 3, v);
  check_cuda_tensor(q_codes, "q_codes", 3, v);
  check_cuda_tensor(k_codes, "k_codes", 3, v);
  YOSO_CHECK(q_codes.scalar_type() == at::kInt, "q_codes must be int32, got ", c10::toString(q_codes.scalar_type()));
  YOSO_CHECK(k_codes.scalar_type() == at::kInt, "k_codes must be int32, got ", c10::toString(k_codes.scalar_type()));
  YOSO_CHECK(q_codes.size(2) < (int64_t(1) << 31), "Nq must be below 2^31, got ", q_codes.size(2));
  check_codes_against_values(q_codes, k_codes, v, hash_bits, check_codes);
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

}  // namespace

torch::Tensor lsh_cumulate_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                                int64_t hash_bits, bool deterministic, bool check_codes) {
  const c10::cuda::CUDAGuard guard(v.device());
  YosoCumulateParams p = check_common_cuda(q_codes, k_codes, v, hash_bits, check_codes);
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
                                         int64_t hash_bits, bool check_codes) {
  const c10::cuda::CUDAGuard guard(v.device());
  YosoCumulateParams p = check_common_cuda(q_codes, k_codes, v, hash_bits, check_codes);
  check_cuda_tensor(q_w, "q_w", 3, v);
  check_cuda_tensor(k_w, "k_w", 3, v);
  YOSO_CHECK(q_w.scalar_type() == v.scalar_type() && k_w.scalar_type() == v.scalar_type(),
             "q_w, k_w and v must share one dtype, got ", c10::toString(q_w.scalar_type()), ", ",
             c10::toString(k_w.scalar_type()), ", ", c10::toString(v.scalar_type()));
  YOSO_CHECK(q_w.size(0) == p.bh && q_w.size(1) == p.nq, "q_w must be (BH, Nq, Dw) = (", p.bh, ", ", p.nq,
             ", Dw), got ", q_w.sizes());
  YOSO_CHECK(k_w.size(0) == p.bh && k_w.size(1) == p.nk, "k_w must be (BH, Nk, Dw) = (", p.bh, ", ", p.nk,
             ", Dw), got ", k_w.sizes());
  YOSO_CHECK(q_w.size(2) == k_w.size(2), "Dw must match: q_w has ", q_w.size(2), ", k_w has ", k_w.size(2));
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

namespace {

torch::Tensor hash_pack_cuda(const torch::Tensor& proj, int64_t num_hashes, int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(proj.device());
  check_cuda_tensor(proj, "proj", 3, proj);
  YOSO_CHECK(proj.scalar_type() == at::kFloat, "proj must be float32, got ", c10::toString(proj.scalar_type()));
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  YOSO_CHECK(num_hashes >= 1 && proj.size(2) == num_hashes * hash_bits,
             "proj must be (BH, N, num_hashes*hash_bits) = (BH, N, ", num_hashes * hash_bits, "), got ",
             proj.sizes());
  torch::Tensor codes = torch::empty({proj.size(0), num_hashes, proj.size(1)}, proj.options().dtype(at::kInt));
  check_cuda_call(yoso_hash_pack(proj.data_ptr<float>(), codes.data_ptr<int32_t>(), proj.size(0), proj.size(1),
                                 num_hashes, static_cast<int>(hash_bits), c10::cuda::getCurrentCUDAStream()));
  return codes;
}

// x (BH, N, D) and the hash's second input, both fp32 CUDA tensors on x's device, and hash_bits in range.
void check_hash_inputs(const torch::Tensor& x, const torch::Tensor& other, const char* name, int64_t rank,
                       int64_t hash_bits) {
  check_cuda_tensor(x, "x", 3, x);
  check_cuda_tensor(other, name, rank, x);
  YOSO_CHECK(x.scalar_type() == at::kFloat && other.scalar_type() == at::kFloat, "x and ", name,
             " must be float32, got ", c10::toString(x.scalar_type()), " and ", c10::toString(other.scalar_type()));
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
}

torch::Tensor hash_rotate_cuda(const torch::Tensor& x, const torch::Tensor& signs, int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_hash_inputs(x, signs, "signs", 4, hash_bits);
  YOSO_CHECK(signs.size(2) == 3, "signs must be (H, m, 3, P), got ", signs.sizes());
  YOSO_CHECK(signs.size(0) >= 1 && x.size(0) % signs.size(0) == 0,
             "x rows (BH) must be a multiple of the heads H in signs (H, m, 3, P): ", x.sizes(), " vs ",
             signs.sizes());
  const int64_t p = signs.size(3);
  YOSO_CHECK(p <= kYosoMaxRotateDim, "padded dimension P must be at most ", kYosoMaxRotateDim, ", got ", p);
  YOSO_CHECK((p & (p - 1)) == 0 && p >= x.size(2) && p >= hash_bits,
             "P must be a power of two >= max(D, hash_bits), got P=", p, " for D=", x.size(2));
  torch::Tensor codes = torch::empty({x.size(0), signs.size(1), x.size(1)}, x.options().dtype(at::kInt));
  check_cuda_call(yoso_hash_rotate(x.data_ptr<float>(), signs.data_ptr<float>(), codes.data_ptr<int32_t>(),
                                   x.size(0), signs.size(0), x.size(1), x.size(2), signs.size(1), p,
                                   static_cast<int>(hash_bits), c10::cuda::getCurrentCUDAStream()));
  return codes;
}

torch::Tensor hash_int8_cuda(const torch::Tensor& x, const torch::Tensor& planes, int64_t num_hashes,
                            int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_hash_inputs(x, planes, "planes", 3, hash_bits);
  YOSO_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  YOSO_CHECK(x.size(2) >= 1 && x.size(2) <= kYosoMaxInt8KernelDim, "the int8 hash kernel takes head dimensions D in 1..",
             kYosoMaxInt8KernelDim, ", got D = ", x.size(2));
  YOSO_CHECK(planes.size(0) >= 1 && x.size(0) % planes.size(0) == 0 && planes.size(1) == x.size(2) &&
                 planes.size(2) == num_hashes * hash_bits,
             "planes must be (H, D, num_hashes*hash_bits) with H dividing BH, for x (BH, N, D) ", x.sizes(), ": got ",
             planes.sizes());
  torch::Tensor codes = torch::empty({x.size(0), num_hashes, x.size(1)}, x.options().dtype(at::kInt));
  check_cuda_call(yoso_hash_int8(x.data_ptr<float>(), planes.data_ptr<float>(), codes.data_ptr<int32_t>(), x.size(0),
                                 planes.size(0), x.size(1), x.size(2), num_hashes, static_cast<int>(hash_bits),
                                 c10::cuda::getCurrentCUDAStream()));
  return codes;
}

}  // namespace

torch::Tensor fast_hash_codes_cuda(const torch::Tensor& x, const torch::Tensor& proj, int64_t num_hashes,
                                   int64_t hash_bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda_tensor(x, "x", 4, x);
  check_cuda_tensor(proj, "proj", 3, x);
  YOSO_CHECK(x.scalar_type() == at::kFloat && proj.scalar_type() == at::kFloat, "x and proj must be float32, got ",
             c10::toString(x.scalar_type()), " and ", c10::toString(proj.scalar_type()));
  YOSO_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  YOSO_CHECK(proj.size(0) == x.size(1) && proj.size(1) == x.size(3) && proj.size(2) == num_hashes * hash_bits,
             "proj must be (H, D, num_hashes*hash_bits) = (", x.size(1), ", ", x.size(3), ", ", num_hashes * hash_bits,
             ") for x (B, H, N, D) ", x.sizes(), ", got ", proj.sizes());
  // One batched GEMM (cuBLAS) for every projection, then one kernel packs the sign bits.
  const torch::Tensor scores = torch::matmul(x, proj).reshape({x.size(0) * x.size(1), x.size(2), proj.size(2)});
  return hash_pack_cuda(scores, num_hashes, hash_bits).view({x.size(0), x.size(1), num_hashes, x.size(2)});
}

void register_cuda_ops(pybind11::module_& m) {
  m.def("lsh_cumulate_cuda", &lsh_cumulate_cuda,
        "(q_codes, k_codes, v, hash_bits, deterministic=True, check_codes=True) -> (BH, Nq, Dv) fp32 on v's "
        "CUDA device; deterministic=False: bucket tables by shared-memory float atomics (the bench's opt-in); "
        "check_codes=False: no host sync (codes >= 2^hash_bits then count as masked)",
        py::arg("q_codes"), py::arg("k_codes"), py::arg("v"), py::arg("hash_bits"), py::arg("deterministic") = true,
        py::arg("check_codes") = true);
  m.def("lsh_weighted_cumulate_cuda", &lsh_weighted_cumulate_cuda,
        "(q_codes, k_codes, q_w, k_w, v, hash_bits, check_codes=True) -> (BH, Nq, Dv) fp32 on v's CUDA device "
        "(deterministic); check_codes=False: no host sync",
        py::arg("q_codes"), py::arg("k_codes"), py::arg("q_w"), py::arg("k_w"), py::arg("v"), py::arg("hash_bits"),
        py::arg("check_codes") = true);
  m.def("hash_pack_cuda", &hash_pack_cuda, "(proj (BH, N, m*tau) fp32, num_hashes, hash_bits) -> (BH, m, N) int32",
        py::arg("proj"), py::arg("num_hashes"), py::arg("hash_bits"));
  m.def("hash_rotate_cuda", &hash_rotate_cuda,
        "(x (BH, N, D) fp32, signs (H, m, 3, P) fp32, hash_bits) -> (BH, m, N) int32",
        py::arg("x"), py::arg("signs"), py::arg("hash_bits"));
  m.def("hash_int8_cuda", &hash_int8_cuda,
        "(x (BH, N, D) fp32, D <= 64, planes (H, D, m*tau) fp32 int8 levels, num_hashes, hash_bits) -> (BH, m, N) "
        "int32: rows quantized, projected and packed in one kernel (hash_codes(int8=True)'s codes)",
        py::arg("x"), py::arg("planes"), py::arg("num_hashes"), py::arg("hash_bits"));
}

#endif  // WITH_CUDA
