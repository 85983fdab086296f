// Bindings of the fused CPU ops (registered into the module by yoso_cpu.cpp's PYBIND11_MODULE):
//
//   lsh_attention(q, k, v, proj, keep, num_hashes, hash_bits, int8=False, packed=None) -> (B, H, N, Dv) fp32
//   exact_attention(q, k, v, keep, hash_bits)                        -> (B, H, N, Dv) fp32, inference
//     (both: q, k, v all fp32 or all bf16, read as their fp32 values)
//   exact_forward(q, k, v, keep, hash_bits)                          -> (BH, N, Dv) fp32
//   exact_backward(q, k, v, keep, grad, hash_bits, true_grad, min_sine) -> [grad q, k, v]
//   collision_probability(cosines, hash_bits)                        -> (1 - arccos/pi)^tau, fp32
//   all_finite(x)                            -> whether a (B, H, N, D) fp32 or bf16 view holds no NaN or inf
//   simd_level()                                                     -> "avx2" | "portable"
//   int8_level()                                    -> "avx512-vnni" | "avx2" | "portable" (int8 hashing)
//   bf16_dots()                                     -> whether exact mode takes bf16 q, k by bf16 dot products
//
// Every check names the limit it enforces (YOSO_CHECK, yoso_check.h -> RuntimeError in Python).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>

#include "yoso_check.h"
#include "yoso_cpu.h"
#include "yoso_cpu_kernels.h"  // YOSO_SIMD_CLONES
#include "yoso_cpu_simd.h"

// Defined in yoso_cpu.cpp (beside the checks yoso_check.h declares).
std::vector<torch::Tensor> int8_packed(const torch::Tensor& proj,
                                       const c10::optional<std::vector<torch::Tensor>>& packed);

namespace {

using yoso::kMaxHashBits;

// q, k, v (B, H, N, D|Dv) views and keep (B, N) bool or None -> params with strides and an output
// allocated as (B, N, H, Dv), returned as its (B, H, N, Dv) view so the heads merge without a copy.
// q, k and v all fp32 or all BFloat16 (read as they are); the output fp32, zeroed where `cleared`.
std::pair<yoso::AttentionParams, torch::Tensor> attention_params(const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 const c10::optional<torch::Tensor>& keep,
                                                                 bool cleared) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  check_view(q, "q", bf16);
  check_view(k, "k", bf16);
  check_view(v, "v", bf16);
  YOSO_CHECK(k.sizes() == q.sizes(), "k must have q's shape (B, H, N, D) ", q.sizes(), ", got ", k.sizes());
  YOSO_CHECK(v.sizes().slice(0, 3) == q.sizes().slice(0, 3), "v must be (B, H, N, Dv) with q's B, H, N ",
             q.sizes(), ", got ", v.sizes());
  YOSO_CHECK(q.size(2) < (int64_t(1) << 31), "N must be below 2^31, got ", q.size(2));
  if (keep.has_value()) {
    check_tensor(*keep, "keep", at::kBool, 2);
    YOSO_CHECK(keep->size(0) == q.size(0) && keep->size(1) == q.size(2), "keep must be (B, N) = (", q.size(0),
               ", ", q.size(2), "), got ", keep->sizes());
  }
  // exact_attention writes every row (not cleared); the LSH cumulation adds into zeros
  const auto shape = {v.size(0), v.size(2), v.size(1), v.size(3)};
  const auto options = v.options().dtype(at::kFloat);
  torch::Tensor out = (cleared ? torch::zeros(shape, options) : torch::empty(shape, options)).transpose(1, 2);
  yoso::AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.bf16 = bf16;
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
                            int64_t hash_bits, bool int8, const c10::optional<std::vector<torch::Tensor>>& packed) {
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  YOSO_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  check_tensor(proj, "proj", at::kFloat, 3);
  auto [p, out] = attention_params(q, k, v, keep, true);
  YOSO_CHECK(proj.size(0) == q.size(1) && proj.size(1) == q.size(3) && proj.size(2) == num_hashes * hash_bits,
             "proj must be (H, D, num_hashes*hash_bits) = (", q.size(1), ", ", q.size(3), ", ",
             num_hashes * hash_bits, "), got ", proj.sizes());
  const std::vector<torch::Tensor> planes = int8 ? int8_packed(proj, packed) : std::vector<torch::Tensor>{};
  if (out.numel() == 0) return out;
  p.proj = proj.data_ptr<float>();
  p.int8 = int8;
  if (int8 && planes[0].numel()) {
    p.packed = planes[0].data_ptr<int8_t>();
    p.packed_offset = planes[1].data_ptr<int32_t>();
  }
  p.m = num_hashes;
  p.hash_bits = int(hash_bits);
  run_without_gil([&] { yoso::lsh_attention(p, at::get_num_threads()); });
  return out;
}

torch::Tensor exact_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const c10::optional<torch::Tensor>& keep, int64_t hash_bits) {
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  auto [p, out] = attention_params(q, k, v, keep, false);
  if (out.numel() == 0) return out;
  p.hash_bits = int(hash_bits);
  run_without_gil([&] { yoso::exact_attention(p, at::get_num_threads()); });
  return out;
}

yoso::ExactParams check_exact(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& keep, int64_t hash_bits) {
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  check_tensor(q, "q", at::kFloat, 3);
  check_tensor(k, "k", at::kFloat, 3);
  check_tensor(v, "v", at::kFloat, 3);
  check_tensor(keep, "keep", at::kFloat, 2);
  YOSO_CHECK(k.sizes() == q.sizes(), "k must have q's shape (BH, N, D) ", q.sizes(), ", got ", k.sizes());
  YOSO_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), "v must be (BH, N, Dv) = (", q.size(0), ", ",
             q.size(1), ", Dv), got ", v.sizes());
  YOSO_CHECK(keep.size(0) == q.size(0) && keep.size(1) == q.size(1), "keep must be (BH, N) = (", q.size(0), ", ",
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
  run_without_gil([&] { yoso::exact_forward(p, at::get_num_threads()); });
  return out;
}

std::vector<torch::Tensor> exact_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& keep, const torch::Tensor& grad, int64_t hash_bits,
                                          bool true_grad, double min_sine) {
  yoso::ExactParams p = check_exact(q, k, v, keep, hash_bits);
  check_tensor(grad, "grad", at::kFloat, 3);
  YOSO_CHECK(grad.sizes() == v.sizes(), "grad must have v's shape (BH, N, Dv) ", v.sizes(), ", got ", grad.sizes());
  YOSO_CHECK(min_sine > 0 && min_sine <= 1, "min_sine must be in (0, 1], got ", min_sine);
  std::vector<torch::Tensor> grads = {torch::zeros_like(q), torch::zeros_like(k), torch::zeros_like(v)};
  if (q.numel() == 0 || v.numel() == 0) return grads;
  p.grad = grad.data_ptr<float>();
  p.grad_q = grads[0].data_ptr<float>();
  p.grad_k = grads[1].data_ptr<float>();
  p.grad_v = grads[2].data_ptr<float>();
  p.true_grad = true_grad;
  p.min_sine = float(min_sine);
  run_without_gil([&] { yoso::exact_backward(p, at::get_num_threads()); });
  return grads;
}

torch::Tensor collision_probability(const torch::Tensor& cosines, int64_t hash_bits) {
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  YOSO_CHECK(cosines.device().is_cpu() && cosines.scalar_type() == at::kFloat && cosines.is_contiguous(),
             "cosines must be a contiguous float32 CPU tensor");
  torch::Tensor out = cosines.clone();
  yoso::simd::collision_weights(out.data_ptr<float>(), nullptr, nullptr, out.numel(), int(hash_bits), false, 0.f);
  return out;
}

// The largest |x| of a row as bits (sign cleared): inf or NaN exactly when it reaches the exponent mask. Signed
// lanes (the values are non-negative) and AVX2 clones: SSE2 has no unsigned 16- or 32-bit max, and without them
// the loop ran at a third of a sum's speed.
YOSO_SIMD_CLONES int32_t row_top(const uint32_t* row, int64_t d) {
  int32_t top = 0;
#pragma omp simd reduction(max : top)
  for (int64_t c = 0; c < d; ++c) top = std::max(top, int32_t(row[c] & 0x7FFFFFFFu));
  return top;
}

YOSO_SIMD_CLONES int32_t row_top(const uint16_t* row, int64_t d) {
  int16_t top = 0;
#pragma omp simd reduction(max : top)
  for (int64_t c = 0; c < d; ++c) top = std::max(top, int16_t(row[c] & 0x7FFFu));
  return top;
}

// Whether x holds no element whose exponent bits are all ones (NaN, +-inf). sizes/strides: 4 dims, the last of
// unit stride. Dims whose rows lie end to end are merged first (q's (B, H, N, D) view of (B, N, 3, H, D) memory,
// read as (B, N, H, D), gives rows of H * D), so the vectorised inner loop is long and the per-row work is rare.
// T: uint32_t (fp32 bits) or uint16_t (bf16 bits).
template <typename T>
bool rows_finite(const T* x, int64_t sizes[4], int64_t strides[4]) {
  constexpr int32_t kExponent = sizeof(T) == 4 ? 0x7F800000 : 0x7F80;
  int order[4] = {0, 1, 2, 3};  // outer dims by decreasing stride, the unit-stride one last
  std::stable_sort(order, order + 3, [&](int a, int b) { return strides[a] > strides[b]; });
  int64_t n[4], st[4];
  for (int i = 0; i < 4; ++i) n[i] = sizes[order[i]], st[i] = strides[order[i]];
  for (int i = 2; i >= 0; --i) {  // merge dim i into the rows when they lie end to end along it
    if (n[i] != 1 && st[i] != n[3]) break;
    n[3] *= n[i];
    n[i] = 1;
  }
  const int64_t rows = n[0] * n[1] * n[2], d = n[3];
  std::atomic<bool> finite{true};
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, d)),
                   [&](int64_t first, int64_t last) {
    int64_t i2 = first % n[2], i1 = first / n[2] % n[1], i0 = first / (n[2] * n[1]);
    int32_t top = 0;
    for (int64_t r = first; r < last && top < kExponent; ++r) {
      top = row_top(x + i0 * st[0] + i1 * st[1] + i2 * st[2], d);
      if (++i2 < n[2]) continue;
      i2 = 0;
      if (++i1 < n[1]) continue;
      i1 = 0;
      ++i0;
    }
    if (top >= kExponent) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

bool all_finite(const torch::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  check_view(x, "x", bf16);
  if (x.numel() == 0) return true;
  int64_t sizes[4] = {x.size(0), x.size(1), x.size(2), x.size(3)};
  int64_t strides[4] = {x.stride(0), x.stride(1), x.stride(2), 1};
  bool finite = true;
  run_without_gil([&] {
    finite = bf16 ? rows_finite(static_cast<const uint16_t*>(x.data_ptr()), sizes, strides)
                  : rows_finite(static_cast<const uint32_t*>(x.data_ptr()), sizes, strides);
  });
  return finite;
}

}  // namespace

void register_fused_ops(pybind11::module_& m) {
  m.def("lsh_attention", &lsh_attention,
        "(q, k (B, H, N, D), v (B, H, N, Dv) fp32, proj (H, D, m*tau), keep (B, N) bool or None, num_hashes, "
        "hash_bits, int8=False) -> (B, H, N, Dv) fp32 view of (B, N, H, Dv) memory: hashing and cumulation fused "
        "(int8: proj holds the quantized planes and rows are hashed quantized)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("proj"), py::arg("keep"), py::arg("num_hashes"),
        py::arg("hash_bits"), py::arg("int8") = false, py::arg("packed") = py::none());
  m.def("exact_attention", &exact_attention,
        "(q, k (B, H, N, D) raw, v (B, H, N, Dv) fp32 views, keep (B, N) bool or None, hash_bits) -> (B, H, N, Dv) "
        "fp32 view of (B, N, H, Dv) memory: YOSO-E for inference, rows normalised inside",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keep"), py::arg("hash_bits"));
  m.def("exact_forward", &exact_forward, "(q, k (BH, N, D) unit, v (BH, N, Dv), keep (BH, N), hash_bits) -> out",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keep"), py::arg("hash_bits"));
  m.def("exact_backward", &exact_backward,
        "(q, k, v, keep, grad, hash_bits, true_grad, min_sine) -> [grad_q, grad_k, grad_v]", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("keep"), py::arg("grad"), py::arg("hash_bits"), py::arg("true_grad"),
        py::arg("min_sine"));
  m.def("collision_probability", &collision_probability,
        "(cosines fp32, hash_bits) -> (1 - arccos(clamp(c))/pi)^tau, the exact kernels' vectorised formula",
        py::arg("cosines"), py::arg("hash_bits"));
  m.def("all_finite", &all_finite,
        "(x (B, H, N, D) fp32 or bf16 CPU view, unit stride along D) -> whether it holds no NaN and no inf, in one "
        "read", py::arg("x"));
  m.def("simd_level", &yoso::simd::level, "which kernel bodies run: avx2 or portable");
  m.def("bf16_dots", &yoso::simd::bf16_dots, "whether exact mode reads bf16 q and k with AVX-512 BF16 dot products");
  m.def("int8_level", &yoso::simd::int8_level, "which body int8 hashing runs: avx512-vnni, avx2 or portable");
}
