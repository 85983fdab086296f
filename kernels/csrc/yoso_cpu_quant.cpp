// The passes around the dense layers' GEMMs, registered into the module by yoso_cpu.cpp's PYBIND11_MODULE. Two
// around an int8 GEMM (--dense-dtype int8; the GEMM itself is oneDNN's, kernels/dense_int8.py's int8_sums):
//
//   quantize_rows(x (R, K) fp32, smooth (K) fp32 or None, shift or None) -> [q (R, K) int8, scale (R, 1) fp32]
//     y = x / smooth (per channel, if given); scale = max(max|y|, 1e-12) / 127; q = clamp(round(y / scale), +-127);
//     with shift (an input that stays above -shift: GELU's output) y + shift to [0, 127] instead: scale =
//     max(max(y + shift), 1e-12) / 127, q = clamp(round((y + shift) / scale), 0, 127)
//   dequantize_rows(acc (R, N) int32 or fp32 holding integers, scale (R, 1), col_scale (N), bias (N) or None,
//                   start (R, N) or None)
//     -> (R, N) fp32 = float(acc) * scale * col_scale + bias + start, in that order; gelu=True: then GELU;
//     then LayerNorm (norm_weight, norm_bias, eps) if asked: the output sub-block's norm in the same pass;
//     bf16=True: that fp32 result rounded to bf16 (nearest, ties to even, as torch's .bfloat16())
//   requantize_rows(acc, scale, col_scale, bias or None, gelu, shift or None) -> [q, scale]: the two above in one
//     pass (an int8 layer's output straight into the next int8 layer's input)
// (the sum after bf16 GEMMs, sum_parts, is in yoso_cpu_parts.cpp)
//
// The same IEEE operations, in the same order, as the PyTorch ops they replace (the references in
// kernels/dense_int8.py and kernels/dense_parts.py: division, not a reciprocal's product; round half to even),
// so the two give the same bits. Every row is computed by one thread from its own values only: a row's bits do
// not depend on the row count or the thread count. Why: in PyTorch ops these were five and four passes over
// memory with temporaries, and took longer than the int8 GEMM itself (a (1024, 1536) fp32 input: 4.1 ms to
// quantize, 1.5 ms to multiply); the bf16 parts' sum made one pass per part.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "yoso_check.h"
#include "yoso_cpu_simd.h"  // bf16_bits, to_bf16

// Shared with yoso_cpu_parts.cpp (declared there): rows a task takes for a width, and the residual rows checked.
namespace yoso::rows {

// Rows per parallel task: about 32k elements.
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, width)); }

// The residual rows added to an output of (rows, n), checked, or null.
const float* start_rows(const c10::optional<torch::Tensor>& start, int64_t rows, int64_t n) {
  if (!start.has_value()) return nullptr;
  check_tensor(*start, "start", at::kFloat, 2);
  YOSO_CHECK(start->size(0) == rows && start->size(1) == n, "start must be (R, N) = (", rows, ", ", n, "), got ",
             start->sizes());
  return start->data_ptr<float>();
}

}  // namespace yoso::rows

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define YOSO_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define YOSO_QUANT_INLINE __attribute__((always_inline)) inline
#else
#define YOSO_SIMD_CLONES
#define YOSO_QUANT_INLINE inline
#endif

constexpr float kMinAbsMax = 1e-12f;

// GELU, x * Phi(x) = x (1 + erf(x / sqrt 2)) / 2, with erf(x / sqrt 2) = a P(a^2) / Q(a^2), a = x clamped to
// +-5.5861435 (past it erf is +-1 in fp32): a rational fitted to erf on [0, 3.95] (Lawson-weighted least squares in
// fp64, absolute error below 1e-8 before rounding), 11 multiply-adds and one division, where the exp-based
// formula before it took twice the instructions. Within 2e-7 max(|x|, 1) of aten's exact GELU. Always inlined into
// each clone's loop, which is vectorised.
YOSO_QUANT_INLINE float gelu_erf(float x) {
  const float a = std::min(std::max(x, -5.5861435f), 5.5861435f), s = a * a;
  float p = -1.305833358e-10f;
  p = p * s + 9.777874510e-08f;
  p = p * s + 1.633065585e-05f;
  p = p * s + 3.361447016e-04f;
  p = p * s + 9.552542120e-03f;
  p = p * s + 6.532761455e-02f;
  p = p * s + 7.978845835e-01f;
  float q = 1.895296919e-06f;
  q = q * s + 8.028253797e-05f;
  q = q * s + 1.916736364e-03f;
  q = q * s + 2.839599550e-02f;
  q = q * s + 2.485427409e-01f;
  q = q * s + 1.f;
  const float h = 0.5f * x;
  return h + h * (a * p / q);
}

// Rows [r0, r1) of x (K columns): smoothed into buf (when smooth is given), then quantized, symmetric or (shifted)
// as row + shift to [0, 127].
YOSO_SIMD_CLONES
void quantize_block(const float* __restrict x, const float* __restrict smooth, bool shifted, float shift,
                    int8_t* __restrict q, float* __restrict scale, int64_t r0, int64_t r1, int64_t k,
                    float* __restrict buf) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* __restrict row = x + r * k;
    if (smooth != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < k; ++c) buf[c] = row[c] / smooth[c];
      row = buf;
    }
    float amax = 0.f;
    if (shifted) {
#pragma omp simd reduction(max : amax)
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, row[c] + shift);
    } else {
#pragma omp simd reduction(max : amax)
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
    }
    const float s = std::max(amax, kMinAbsMax) / 127.f;
    scale[r] = s;
    int8_t* __restrict out = q + r * k;
    // No `omp simd` here: with it GCC 12 found no vector type for this float-to-int8 loop and ran it one element at
    // a time (a third of the pass); left to itself it vectorises the loop.
    if (shifted) {
      for (int64_t c = 0; c < k; ++c) {
        const float v = std::nearbyint((row[c] + shift) / s);
        out[c] = static_cast<int8_t>(std::min(127.f, std::max(0.f, v)));
      }
      continue;
    }
    for (int64_t c = 0; c < k; ++c) {
      const float v = std::nearbyint(row[c] / s);
      out[c] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
  }
}

// Rows [r0, r1) of the sums scaled back. A is the sums' type: int32_t, or float holding the exact integers (the u8 x s8
// route's output, kernels/dense_int8.py), which converts to the same floats.
template <typename A>
YOSO_QUANT_INLINE void dequantize_body(const A* __restrict acc, const float* __restrict scale,
                                       const float* __restrict col, const float* __restrict bias,
                                       const float* __restrict start, float* __restrict out, int64_t r0, int64_t r1,
                                       int64_t n, bool gelu) {
  for (int64_t r = r0; r < r1; ++r) {
    const A* __restrict a = acc + r * n;
    float* __restrict o = out + r * n;
    const float s = scale[r];
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) o[c] = static_cast<float>(a[c]) * s * col[c];
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] += bias[c];
    }
    if (start != nullptr) {
      const float* __restrict st = start + r * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] += st[c];
    }
    if (gelu) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = gelu_erf(o[c]);
    }
  }
}

YOSO_SIMD_CLONES
void dequantize_block(const int32_t* __restrict acc, const float* __restrict scale, const float* __restrict col,
                      const float* __restrict bias, const float* __restrict start, float* __restrict out,
                      int64_t r0, int64_t r1, int64_t n, bool gelu) {
  dequantize_body(acc, scale, col, bias, start, out, r0, r1, n, gelu);
}

YOSO_SIMD_CLONES
void dequantize_block(const float* __restrict acc, const float* __restrict scale, const float* __restrict col,
                      const float* __restrict bias, const float* __restrict start, float* __restrict out,
                      int64_t r0, int64_t r1, int64_t n, bool gelu) {
  dequantize_body(acc, scale, col, bias, start, out, r0, r1, n, gelu);
}

// The sums' rows from r, typed as they are (int32, or float holding exact integers), scaled back.
struct Sums {
  const int32_t* i;
  const float* f;
  void scale_back(int64_t r, const float* scale, const float* col, const float* bias, const float* start,
                  float* out, int64_t rows, int64_t n, bool gelu) const {
    if (i != nullptr) {
      dequantize_block(i + r * n, scale, col, bias, start, out, 0, rows, n, gelu);
    } else {
      dequantize_block(f + r * n, scale, col, bias, start, out, 0, rows, n, gelu);
    }
  }
};

// nn.LayerNorm of rows [r0, r1) of x (N columns) in place: (x - mean) / sqrt(var + eps) * weight + bias (bias may
// be null), mean and biased variance over the row, two passes over it while it is in cache. Sums are vector
// partial sums in one fixed order, so a row's bits do not depend on the other rows; they are not aten's bits
// (within a few 1e-7 of them).
YOSO_SIMD_CLONES
void layer_norm_block(float* __restrict x, int64_t r0, int64_t r1, int64_t n, const float* __restrict weight,
                      const float* __restrict bias, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    float* __restrict o = x + r * n;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < n; ++c) sum += o[c];
    const float mean = sum / float(n);
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < n; ++c) sq += (o[c] - mean) * (o[c] - mean);
    const float rstd = 1.f / std::sqrt(sq / float(n) + eps);
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = (o[c] - mean) * rstd * weight[c] + bias[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = (o[c] - mean) * rstd * weight[c];
    }
  }
}

using yoso::rows::grain_rows;
using yoso::rows::start_rows;
using yoso::simd::to_bf16;

std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, const c10::optional<torch::Tensor>& smooth,
                                         c10::optional<double> shift) {
  check_tensor(x, "x", at::kFloat, 2);
  const int64_t rows = x.size(0), k = x.size(1);
  const float* sp = nullptr;
  if (smooth.has_value()) {
    check_tensor(*smooth, "smooth", at::kFloat, 1);
    YOSO_CHECK(smooth->size(0) == k, "smooth must be (K,) = (", k, ",), got ", smooth->sizes());
    sp = smooth->data_ptr<float>();
  }
  torch::Tensor q = torch::empty({rows, k}, x.options().dtype(at::kChar));
  torch::Tensor scale = torch::empty({rows, 1}, x.options());
  if (rows == 0) return {q, scale};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  run_without_gil([&] {
    at::parallel_for(0, rows, grain_rows(k), [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(sp != nullptr ? k : 0);
      quantize_block(xp, sp, shift.has_value(), float(shift.value_or(0.)), qp, scp, r0, r1, k, buf.data());
    });
  });
  return {q, scale};
}

// An optional (N,) fp32 vector (a bias, a LayerNorm's weight or bias), checked, or null.
const float* row_vector(const c10::optional<torch::Tensor>& t, const char* name, int64_t n) {
  if (!t.has_value()) return nullptr;
  check_tensor(*t, name, at::kFloat, 1);
  YOSO_CHECK(t->size(0) == n, name, " must be (N,) = (", n, ",), got ", t->sizes());
  return t->data_ptr<float>();
}

// The sums of a GEMM (R, N) (int32, or float32 holding exact integers), their row scales (R, 1), column scales (N) and
// bias (N) checked; the bias or null.
const float* check_sums(const torch::Tensor& acc, const torch::Tensor& scale, const torch::Tensor& col_scale,
                        const c10::optional<torch::Tensor>& bias) {
  YOSO_CHECK(acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat, "acc must be int32 or float32, got ",
             c10::toString(acc.scalar_type()));
  check_tensor(acc, "acc", acc.scalar_type(), 2);
  const int64_t rows = acc.size(0), n = acc.size(1);
  check_tensor(scale, "scale", at::kFloat, 2);
  YOSO_CHECK(scale.size(0) == rows && scale.size(1) == 1, "scale must be (R, 1) = (", rows, ", 1), got ",
             scale.sizes());
  check_tensor(col_scale, "col_scale", at::kFloat, 1);
  YOSO_CHECK(col_scale.size(0) == n, "col_scale must be (N,) = (", n, ",), got ", col_scale.sizes());
  return row_vector(bias, "bias", n);
}

Sums sums(const torch::Tensor& acc) {
  if (acc.scalar_type() == at::kInt) return {acc.data_ptr<int32_t>(), nullptr};
  return {nullptr, acc.data_ptr<float>()};
}

torch::Tensor dequantize_rows(const torch::Tensor& acc, const torch::Tensor& scale, const torch::Tensor& col_scale,
                              const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& start,
                              bool gelu, bool bf16, const c10::optional<torch::Tensor>& norm_weight,
                              const c10::optional<torch::Tensor>& norm_bias, double eps) {
  const float* bp = check_sums(acc, scale, col_scale, bias);
  const int64_t rows = acc.size(0), n = acc.size(1);
  const float* stp = start_rows(start, rows, n);
  const float* nw = row_vector(norm_weight, "norm_weight", n);
  const float* nb = row_vector(norm_bias, "norm_bias", n);
  YOSO_CHECK(nb == nullptr || nw != nullptr, "norm_bias needs norm_weight");
  YOSO_CHECK(eps > 0, "eps must be positive, got ", eps);
  const float feps = float(eps);
  torch::Tensor out = torch::empty({rows, n}, scale.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (rows == 0 || n == 0) return out;
  const Sums ap = sums(acc);
  const float* sp = scale.data_ptr<float>();
  const float* cp = col_scale.data_ptr<float>();
  run_without_gil([&] {
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      if (!bf16) {
        float* op = out.data_ptr<float>() + r0 * n;
        ap.scale_back(r0, sp + r0, cp, bp, stp == nullptr ? nullptr : stp + r0 * n, op, r1 - r0, n, gelu);
        if (nw != nullptr) layer_norm_block(out.data_ptr<float>(), r0, r1, n, nw, nb, feps);
        return;
      }
      // each row in fp32 into a buffer the thread reuses, then rounded: half the bytes written
      uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      std::vector<float> buf(n);
      for (int64_t r = r0; r < r1; ++r) {
        ap.scale_back(r, sp + r, cp, bp, stp == nullptr ? nullptr : stp + r * n, buf.data(), 1, n, gelu);
        if (nw != nullptr) layer_norm_block(buf.data(), 0, 1, n, nw, nb, feps);
        to_bf16(buf.data(), n, op + r * n);
      }
    });
  });
  return out;
}

// dequantize_rows (no start) and quantize_rows (no smooth) of its output in one pass: each row scaled back into a
// buffer the thread reuses, then quantized from there by the same code, so the bits of the two calls, without the
// (R, N) fp32 tensor between them. For a layer whose int8 output only feeds the next int8 layer (FFN in -> out).
std::vector<torch::Tensor> requantize_rows(const torch::Tensor& acc, const torch::Tensor& scale,
                                           const torch::Tensor& col_scale, const c10::optional<torch::Tensor>& bias,
                                           bool gelu, c10::optional<double> shift) {
  const float* bp = check_sums(acc, scale, col_scale, bias);
  const int64_t rows = acc.size(0), n = acc.size(1);
  torch::Tensor q = torch::empty({rows, n}, acc.options().dtype(at::kChar));
  torch::Tensor q_scale = torch::empty({rows, 1}, scale.options());
  if (rows == 0) return {q, q_scale};
  if (n == 0) return {q, q_scale.fill_(kMinAbsMax / 127.f)};  // quantize_rows' scale of an empty row
  const Sums ap = sums(acc);
  const float* sp = scale.data_ptr<float>();
  const float* cp = col_scale.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* qsp = q_scale.data_ptr<float>();
  run_without_gil([&] {
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(n);
      for (int64_t r = r0; r < r1; ++r) {
        ap.scale_back(r, sp + r, cp, bp, nullptr, buf.data(), 1, n, gelu);
        quantize_block(buf.data(), nullptr, shift.has_value(), float(shift.value_or(0.)), qp + r * n, qsp + r, 0, 1, n,
                       nullptr);
      }
    });
  });
  return {q, q_scale};
}

}  // namespace

namespace yoso::simd {

YOSO_SIMD_CLONES
void to_bf16(const float* __restrict x, int64_t n, uint16_t* __restrict out) {
  for (int64_t c = 0; c < n; ++c) out[c] = bf16_bits(x[c]);
}

}  // namespace yoso::simd

void register_quant_ops(pybind11::module_& m) {
  m.def("quantize_rows", &quantize_rows,
        "(x (R, K) fp32, smooth (K,) fp32 or None, shift=None) -> [q (R, K) int8, scale (R, 1) fp32]: each row "
        "divided by smooth, then by its own max|.|/127, rounded half to even, clamped to +-127; with shift, the row "
        "plus shift by its own max/127, clamped to [0, 127]",
        py::arg("x"), py::arg("smooth"), py::arg("shift") = py::none());
  m.def("dequantize_rows", &dequantize_rows,
        "(acc (R, N) int32 or fp32 integers, scale (R, 1) fp32, col_scale (N,) fp32, bias (N,) or None, start (R, N) "
        "fp32 or None, "
        "gelu=False, bf16=False, norm_weight=None, norm_bias=None, eps=1e-12) -> (R, N) fp32 = acc * scale * "
        "col_scale + bias + start, then GELU (erf form, ~1e-7 off aten's), then LayerNorm(norm_weight, norm_bias, "
        "eps) if norm_weight is given; bf16: that result rounded to bf16 (nearest, ties to even)",
        py::arg("acc"), py::arg("scale"), py::arg("col_scale"), py::arg("bias"), py::arg("start"),
        py::arg("gelu") = false, py::arg("bf16") = false, py::arg("norm_weight") = py::none(),
        py::arg("norm_bias") = py::none(), py::arg("eps") = 1e-12);
  m.def("requantize_rows", &requantize_rows,
        "(acc (R, N) int32 or fp32 integers, scale (R, 1) fp32, col_scale (N,) fp32, bias (N,) or None, gelu=False, "
        "shift=None) -> [q (R, N) int8, scale (R, 1) fp32]: quantize_rows(dequantize_rows(acc, scale, col_scale, "
        "bias, None, gelu), None, shift), the same bits in one pass",
        py::arg("acc"), py::arg("scale"), py::arg("col_scale"), py::arg("bias"), py::arg("gelu") = false,
        py::arg("shift") = py::none());
}
