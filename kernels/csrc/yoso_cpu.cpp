// The one pybind11 module of the YOSO CPU extension: validation, then plain params structs
// go to the OpenMP kernels in yoso_cpu_kernels.cpp and yoso_cpu_weighted.cpp (the CUDA
// extension adds yoso_cuda_ops.cpp's bindings).
//
//   lsh_cumulate(q_codes, k_codes, v, hash_bits)                     -> (BH, Nq, Dv) fp32
//   lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, hash_bits)  -> (BH, Nq, Dv) fp32
//   fast_hash_codes(x, proj, num_hashes, hash_bits, int8=False, packed=None) -> (B, H, m, N) int32
//   pack_int8_planes(proj)                                           -> [w8, offset] for packed=
//   + lsh_attention, exact_attention, exact_forward, exact_backward, collision_probability,
//     simd_level: registered by yoso_cpu_fused.cpp
//
// A negative code masks: such a key adds nothing, such a query reads zeros for that hash.
// Every check names the limit it enforces (YOSO_CHECK, yoso_check.h -> RuntimeError in Python).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdio>
#include <functional>

#include "yoso_check.h"
#include "yoso_cpu.h"
#include "yoso_cpu_simd.h"

#ifdef WITH_CUDA
// yoso_cuda_ops.cpp (built into the CUDA extension only): the CUDA bindings, and the three ops the CPU entry
// points hand CUDA tensors to.
void register_cuda_ops(pybind11::module_& m);
torch::Tensor lsh_cumulate_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                                int64_t hash_bits, bool deterministic, bool check_codes);
torch::Tensor lsh_weighted_cumulate_cuda(const torch::Tensor& q_codes, const torch::Tensor& k_codes,
                                         const torch::Tensor& q_w, const torch::Tensor& k_w, const torch::Tensor& v,
                                         int64_t hash_bits, bool check_codes);
torch::Tensor fast_hash_codes_cuda(const torch::Tensor& x, const torch::Tensor& proj, int64_t num_hashes,
                                   int64_t hash_bits);
#endif

// The fused inference ops and the exact YOSO-E kernels' bindings (yoso_cpu_fused.cpp).
void register_fused_ops(pybind11::module_& m);
// The N-YOSO norm and YOSO-C convolution after the op, in place (yoso_cpu_finish.cpp).
void register_finish_ops(pybind11::module_& m);
// yoso_cpu_quant.cpp: quantize_rows, dequantize_rows (around the int8 dense layers' GEMM)
void register_quant_ops(pybind11::module_& m);
// yoso_cpu_parts.cpp: sum_parts (the bf16 dense layers' K-block outputs summed after the residual)
void register_parts_ops(pybind11::module_& m);

// yoso_check.h's message pieces: numbers by std::to_string / snprintf, never through std::ostream.
namespace yoso {
MessagePiece::MessagePiece(const char* s) : text(s) {}
MessagePiece::MessagePiece(const std::string& s) : text(s) {}
MessagePiece::MessagePiece(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);  // what an ostream prints by default
  text = buf;
}
MessagePiece::MessagePiece(c10::IntArrayRef shape) : text("[") {
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  text += "]";
}
MessagePiece::MessagePiece(const c10::Device& device) : text(device.str()) {}
std::string MessagePiece::integer_text(long long v) { return std::to_string(v); }

std::string message(std::initializer_list<MessagePiece> pieces) {
  std::string out;
  for (const MessagePiece& piece : pieces) out += piece.text;
  return out;
}
}  // namespace yoso

// One tensor check for every binding of the extension (declared in yoso_check.h).
void check_tensor(const torch::Tensor& t, const char* name, at::ScalarType dtype, int64_t rank) {
  YOSO_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  YOSO_CHECK(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
             c10::toString(t.scalar_type()));
  YOSO_CHECK(t.dim() == rank, name, " must have rank ", rank, ", got shape ", t.sizes());
  YOSO_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A (B, H, N, D) fp32 (or, with bf16, BFloat16) CPU view whose last dimension has unit stride (a head split
// needs no copy); the fused ops and the layer's finish read such views as they are.
void check_view(const torch::Tensor& t, const char* name, bool bf16) {
  YOSO_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  const auto want = bf16 ? at::kBFloat16 : at::kFloat;
  YOSO_CHECK(t.scalar_type() == want, name, " must be ", c10::toString(want), ", got ", c10::toString(t.scalar_type()));
  YOSO_CHECK(t.dim() == 4, name, " must have rank 4 (B, H, N, D), got shape ", t.sizes());
  YOSO_CHECK(t.stride(3) == 1 || t.size(3) == 1, name, " must have unit stride along D, got strides ", t.strides());
}

// Int8 hashing's planes: integers in [-127, 127] (kernels/hashing.py quantizes them), D at most 1024 so that
// the AVX2 and portable bodies' fp32 sums of x8 * w stay exact integers (|sum| <= D * 127^2 < 2^24).
void check_int8_planes(const torch::Tensor& proj) {
  YOSO_CHECK(proj.size(1) <= 1024, "int8 hashing takes head dimensions D <= 1024, got D = ", proj.size(1));
  const float* w = proj.data_ptr<float>();
  for (int64_t i = 0; i < proj.numel(); ++i)
    YOSO_CHECK(w[i] >= -127.f && w[i] <= 127.f && w[i] == float(int32_t(w[i])),
               "int8 hashing needs proj of integers in [-127, 127], got ", w[i], " at flat index ", i);
}

// [w8, offset]: proj's int8 planes in the VNNI body's packed layout, validated once here so that callers
// can cache them per projection (empty tensors where another body runs: it reads proj itself).
std::vector<torch::Tensor> pack_int8_planes(const torch::Tensor& proj) {
  check_tensor(proj, "proj", at::kFloat, 3);
  check_int8_planes(proj);
  if (!yoso::simd::int8_packs()) return {torch::empty({0}, proj.options().dtype(at::kChar)),
                                         torch::empty({0}, proj.options().dtype(at::kInt))};
  const int64_t heads = proj.size(0), d = proj.size(1), cols = proj.size(2);
  const int64_t cols16 = yoso::simd::packed_cols16(cols);
  torch::Tensor w8 = torch::empty({heads * cols16 * yoso::simd::packed_dpad(d)}, proj.options().dtype(at::kChar));
  torch::Tensor offset = torch::empty({heads * cols16}, proj.options().dtype(at::kInt));
  yoso::simd::pack_planes_i8(proj.data_ptr<float>(), heads, d, cols, w8.data_ptr<int8_t>(), offset.data_ptr<int32_t>());
  return {w8, offset};
}

// The bindings keep the GIL through their checks, messages and allocations and give it up only
// around the kernels, which cannot throw: an error is built and raised with the interpreter held.
void run_without_gil(const std::function<void()>& kernel) {
  pybind11::gil_scoped_release no_gil;
  kernel();
}

// The packed planes of an int8 call: the caller's (pack_int8_planes of this proj) after a size check, or, when
// none are given, proj validated and packed for this call alone.
std::vector<torch::Tensor> int8_packed(const torch::Tensor& proj, const c10::optional<std::vector<torch::Tensor>>& packed) {
  if (!packed.has_value()) return pack_int8_planes(proj);
  YOSO_CHECK(packed->size() == 2, "packed must be [w8, offset] from pack_int8_planes(proj), got ", packed->size(),
             " tensors");
  const torch::Tensor& w8 = (*packed)[0];
  const torch::Tensor& offset = (*packed)[1];
  const bool packs = yoso::simd::int8_packs();
  const int64_t cols16 = yoso::simd::packed_cols16(proj.size(2));
  const int64_t want_w = packs ? proj.size(0) * cols16 * yoso::simd::packed_dpad(proj.size(1)) : 0;
  const int64_t want_offset = packs ? proj.size(0) * cols16 : 0;
  YOSO_CHECK(w8.device().is_cpu() && w8.scalar_type() == at::kChar && w8.is_contiguous() && w8.numel() == want_w &&
                 offset.device().is_cpu() && offset.scalar_type() == at::kInt && offset.is_contiguous() &&
                 offset.numel() == want_offset,
             "packed must be pack_int8_planes(proj) for proj ", proj.sizes(), ": int8 (", want_w, ") and int32 (",
             want_offset, "), got ", c10::toString(w8.scalar_type()), " (", w8.numel(), ") and ",
             c10::toString(offset.scalar_type()), " (", offset.numel(), ")");
  return {w8, offset};
}

namespace {

using yoso::kMaxHashBits;

void check_codes_range(const torch::Tensor& codes, const char* name, int64_t buckets, int64_t hash_bits) {
  if (codes.numel() == 0) return;
  const int64_t top = codes.max().item<int64_t>();
  YOSO_CHECK(top < buckets, name, " holds code ", top, " but hash_bits=", hash_bits,
             " allows codes below 2^hash_bits = ", buckets, " (negative codes mean masked)");
}

}  // namespace

// The shape rules both devices share (declared in yoso_check.h).
int64_t check_codes_against_values(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                                   int64_t hash_bits, bool check_range) {
  YOSO_CHECK(q_codes.size(0) == k_codes.size(0) && k_codes.size(0) == v.size(0),
             "batch*heads must match: q_codes (BH, m, Nq) ", q_codes.sizes(), ", k_codes (BH, m, Nk) ",
             k_codes.sizes(), ", v (BH, Nk, Dv) ", v.sizes());
  YOSO_CHECK(q_codes.size(1) == k_codes.size(1), "number of hashes m must match: q_codes has ", q_codes.size(1),
             ", k_codes has ", k_codes.size(1));
  YOSO_CHECK(q_codes.size(1) >= 1, "number of hashes m must be at least 1, got ", q_codes.size(1));
  YOSO_CHECK(k_codes.size(2) == v.size(1), "Nk must match: k_codes (BH, m, Nk) ", k_codes.sizes(),
             " vs v (BH, Nk, Dv) ", v.sizes());
  YOSO_CHECK(k_codes.size(2) < (int64_t(1) << 31), "Nk must be below 2^31, got ", k_codes.size(2));
  const int64_t buckets = int64_t(1) << hash_bits;
  if (!check_range) return buckets;
  check_codes_range(q_codes, "q_codes", buckets, hash_bits);
  check_codes_range(k_codes, "k_codes", buckets, hash_bits);
  return buckets;
}

namespace {

yoso::CumulateParams check_common(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                            int64_t hash_bits) {
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
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

torch::Tensor lsh_cumulate(const torch::Tensor& q_codes, const torch::Tensor& k_codes, const torch::Tensor& v,
                           int64_t hash_bits) {
#ifdef WITH_CUDA
  if (v.is_cuda()) return lsh_cumulate_cuda(q_codes, k_codes, v, hash_bits, true, true);  // sorted tables
#endif
  yoso::CumulateParams p = check_common(q_codes, k_codes, v, hash_bits);
  torch::Tensor out = torch::zeros({p.bh, p.nq, p.dv}, v.options());
  if (out.numel() == 0 || p.nk == 0) return out;
  p.out = out.data_ptr<float>();
  run_without_gil([&] { yoso::lsh_cumulate(p, at::get_num_threads()); });
  return out;
}

torch::Tensor lsh_weighted_cumulate(const torch::Tensor& q_codes, const torch::Tensor& k_codes,
                                    const torch::Tensor& q_w, const torch::Tensor& k_w, const torch::Tensor& v,
                                    int64_t hash_bits) {
#ifdef WITH_CUDA
  if (v.is_cuda()) return lsh_weighted_cumulate_cuda(q_codes, k_codes, q_w, k_w, v, hash_bits, true);
#endif
  yoso::CumulateParams p = check_common(q_codes, k_codes, v, hash_bits);
  check_tensor(q_w, "q_w", at::kFloat, 3);
  check_tensor(k_w, "k_w", at::kFloat, 3);
  YOSO_CHECK(q_w.size(0) == p.bh && q_w.size(1) == p.nq, "q_w must be (BH, Nq, Dw) = (", p.bh, ", ", p.nq,
             ", Dw), got ", q_w.sizes());
  YOSO_CHECK(k_w.size(0) == p.bh && k_w.size(1) == p.nk, "k_w must be (BH, Nk, Dw) = (", p.bh, ", ", p.nk,
             ", Dw), got ", k_w.sizes());
  YOSO_CHECK(q_w.size(2) == k_w.size(2), "Dw must match: q_w has ", q_w.size(2), ", k_w has ", k_w.size(2));
  torch::Tensor out = torch::zeros({p.bh, p.nq, p.dv}, v.options());
  p.dw = q_w.size(2);
  if (out.numel() == 0 || p.nk == 0 || p.dw == 0) return out;
  p.q_w = q_w.data_ptr<float>();
  p.k_w = k_w.data_ptr<float>();
  p.out = out.data_ptr<float>();
  run_without_gil([&] { yoso::lsh_weighted_cumulate(p, at::get_num_threads()); });
  return out;
}

torch::Tensor fast_hash_codes(const torch::Tensor& x, const torch::Tensor& proj, int64_t num_hashes,
                              int64_t hash_bits, bool int8, const c10::optional<std::vector<torch::Tensor>>& packed) {
#ifdef WITH_CUDA
  YOSO_CHECK(!(int8 && x.is_cuda()), "int8 hashing of CUDA tensors runs in PyTorch (kernels/hashing.py)");
  if (x.is_cuda()) return fast_hash_codes_cuda(x, proj, num_hashes, hash_bits);
#endif
  YOSO_CHECK(hash_bits >= 1 && hash_bits <= kMaxHashBits, "hash_bits must be in 1..", kMaxHashBits, ", got ",
             hash_bits);
  YOSO_CHECK(num_hashes >= 1, "num_hashes must be at least 1, got ", num_hashes);
  check_tensor(x, "x", at::kFloat, 4);
  check_tensor(proj, "proj", at::kFloat, 3);
  YOSO_CHECK(proj.size(0) == x.size(1) && proj.size(1) == x.size(3) && proj.size(2) == num_hashes * hash_bits,
             "proj must be (H, D, num_hashes*hash_bits) = (", x.size(1), ", ", x.size(3), ", ", num_hashes * hash_bits,
             ") for x (B, H, N, D) ", x.sizes(), ", got ", proj.sizes());
  const std::vector<torch::Tensor> planes = int8 ? int8_packed(proj, packed) : std::vector<torch::Tensor>{};
  torch::Tensor codes = torch::empty({x.size(0), x.size(1), num_hashes, x.size(2)}, x.options().dtype(at::kInt));
  if (codes.numel() == 0) return codes;
  if (x.size(3) == 0) return codes.zero_();
  yoso::HashParams p{};
  p.int8 = int8;
  if (int8 && planes[0].numel()) {
    p.packed = planes[0].data_ptr<int8_t>();
    p.packed_offset = planes[1].data_ptr<int32_t>();
  }
  p.x = x.data_ptr<float>();
  p.proj = proj.data_ptr<float>();
  p.codes = codes.data_ptr<int32_t>();
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.n = x.size(2);
  p.d = x.size(3);
  p.m = num_hashes;
  p.hash_bits = int(hash_bits);
  run_without_gil([&] { yoso::hash_codes(p, at::get_num_threads()); });
  return codes;
}

int openmp_max_threads() { return at::get_num_threads(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "YOSO LSH cumulation and hash codes on CPU (OpenMP)";
  m.def("lsh_cumulate", &lsh_cumulate, "(q_codes, k_codes, v, hash_bits) -> (BH, Nq, Dv) fp32",
        py::arg("q_codes"), py::arg("k_codes"), py::arg("v"), py::arg("hash_bits"));
  m.def("lsh_weighted_cumulate", &lsh_weighted_cumulate,
        "(q_codes, k_codes, q_w, k_w, v, hash_bits) -> (BH, Nq, Dv) fp32", py::arg("q_codes"), py::arg("k_codes"),
        py::arg("q_w"), py::arg("k_w"), py::arg("v"), py::arg("hash_bits"));
  m.def("pack_int8_planes", &pack_int8_planes,
        "(proj (H, D, m*tau) fp32 integers in [-127, 127]) -> [w8 int8, offset int32]: validated and packed for the "
        "int8 hashing body (empty where it reads proj itself); pass as packed= to skip this per call",
        py::arg("proj"));
  m.def("fast_hash_codes", &fast_hash_codes,
        "(x (B, H, N, D) fp32, proj (H, D, m*tau) fp32, num_hashes, hash_bits, int8=False) -> (B, H, m, N) int32 "
        "codes (int8: proj holds the quantized planes and rows are hashed quantized; packed: pack_int8_planes(proj), "
        "else packed per call)",
        py::arg("x"), py::arg("proj"), py::arg("num_hashes"), py::arg("hash_bits"), py::arg("int8") = false,
        py::arg("packed") = py::none());
#ifdef WITH_CUDA
  register_cuda_ops(m);   // yoso_cuda_ops.cpp
#endif
  register_fused_ops(m);   // yoso_cpu_fused.cpp
  register_finish_ops(m);  // yoso_cpu_finish.cpp
  register_quant_ops(m);   // yoso_cpu_quant.cpp
  register_parts_ops(m);   // yoso_cpu_parts.cpp
  m.def("openmp_max_threads", &openmp_max_threads, "threads the kernels run on (torch's intra-op count)");
}
