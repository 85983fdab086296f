// What a YOSO layer does to the attention output after the op, for inference, in one pass over it
// (registered into the module by yoso_cpu.cpp's PYBIND11_MODULE):
//
//   attention_finish(out, v, weight, keep, normalize, eps, out16=None) -> None, out (fp32) modified in place; v fp32
//   or bf16; out16 (bf16, out's shape) given: each finished row also written there, rounded as .bfloat16() rounds:
//     out[b, h, n] = out[b, h, n] / max(|out[b, h, n]|, eps)          (N-YOSO's row norm, if normalize)
//                  + sum_t weight[h, t] * v[b, h, n + t - W/2] * keep[b, n + t - W/2]   (YOSO-C, if weight)
//
// The PyTorch path (F.normalize, then a depthwise Conv2d of the masked values, then an add) makes
// four passes and three temporaries, and oneDNN's depthwise convolution runs its (W x 1) kernel at a
// small fraction of the machine's speed: together about a quarter of a layer's self-attention time
// on 2 CPU cores (docs/benchmarks.md). Here each output row is finished by one thread, taps in
// increasing t, so results do not depend on the thread count. bf16 values are widened (exactly) into a buffer
// first and then read by the same code, so they give the bits their fp32 copy gives.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "yoso_check.h"
#include "yoso_cpu_kernels.h"  // YOSO_SIMD_CLONES: hot loops for AVX2+FMA and the baseline, picked per machine
#include "yoso_cpu_simd.h"

namespace {

constexpr int64_t kRowsPerTask = 64;

// One (batch, head)'s rows: out and v rows ldo / ldv floats apart, keep (N) or null, w (W) or null.
// v points at row v_first of the values (0, or the first row a task's widened copy holds).
struct Rows {
  float* out;
  int64_t ldo;
  const float* v;
  int64_t ldv, v_first;
  const uint8_t* keep;
  const float* w;
  int64_t window, n, d;
};

// Both helpers are always inlined, so that each of finish_rows' clones compiles them for its own instruction set
// (not inlined, the body ran as baseline SSE2 code in the AVX2 clone: with D = 64, and with the two-row loop).
#define YOSO_INLINE __attribute__((always_inline)) inline

// a[c] += w * src[c] for c < d
template <int64_t D>
YOSO_INLINE void add_tap(float* __restrict a, float w, const float* __restrict src, int64_t d) {
#pragma omp simd
  for (int64_t c = 0; c < (D > 0 ? D : d); ++c) a[c] += w * src[c];
}

// D is a template argument for the common head sizes (the accumulators then live in registers) and 0 for any
// other, read from r.d at run time. Rows are finished two at a time: each value row read serves both (taps t
// and t - 1), whose sums are independent chains, so the FMAs wait on neither their latency nor the loads; each
// row still sums its taps in increasing t, the bits of one row at a time.
template <int64_t D>
YOSO_INLINE void finish_rows_body(const Rows& r, int64_t i0, int64_t i1, bool normalize, float eps,
                                  float* __restrict acc) {
  const int64_t d = D > 0 ? D : r.d, half = r.window / 2, window = r.window, n = r.n, ldv = r.ldv;
  const float* __restrict values = r.v;
  const int64_t v_first = r.v_first;
  const auto v = [=](int64_t j) { return values + (j - v_first) * ldv; };  // the values' row j
  const float* __restrict w = r.w;
  const uint8_t* keep = r.keep;
  if (normalize)
    for (int64_t i = i0; i < i1; ++i) {
      float* __restrict row = r.out + i * r.ldo;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t c = 0; c < d; ++c) sq += row[c] * row[c];
      const float norm = std::max(std::sqrt(sq), eps);
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) row[c] /= norm;
    }
  if (w == nullptr) return;
  float local[D > 0 ? 2 * D : 1];
  float* __restrict a0 = D > 0 ? local : acc;
  float* __restrict a1 = D > 0 ? local + D : acc + d;
  const auto kept = [keep](int64_t j) { return keep == nullptr || keep[j]; };
  for (int64_t i = i0; i < i1; i += 2) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) a0[c] = a1[c] = 0.f;
    float* __restrict row = r.out + i * r.ldo;
    // row i reads j in [i - half, i + half], row i + 1 the same shifted by one: [first + 1, last - 1] serves both
    const int64_t first = i - half, last = i + 1 + half;
    if (i + 1 == i1) {  // a last row alone
      for (int64_t j = std::max<int64_t>(0, first); j < std::min(n, last); ++j)
        if (kept(j)) add_tap<D>(a0, w[j - first], v(j), d);
    } else {
      if (first >= 0 && kept(first)) add_tap<D>(a0, w[0], v(first), d);
      for (int64_t j = std::max<int64_t>(0, first + 1); j < std::min(n, last); ++j)
        if (kept(j)) {
          add_tap<D>(a0, w[j - first], v(j), d);
          add_tap<D>(a1, w[j - first - 1], v(j), d);
        }
      if (last < n && kept(last)) add_tap<D>(a1, w[window - 1], v(last), d);
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) row[r.ldo + c] += a1[c];
    }
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) row[c] += a0[c];
  }
}

YOSO_SIMD_CLONES
void finish_rows(const Rows& r, int64_t i0, int64_t i1, bool normalize, float eps, float* acc) {
  switch (r.d) {
    case 32: finish_rows_body<32>(r, i0, i1, normalize, eps, acc); break;
    case 64: finish_rows_body<64>(r, i0, i1, normalize, eps, acc); break;
    default: finish_rows_body<0>(r, i0, i1, normalize, eps, acc); break;
  }
}

void attention_finish(torch::Tensor out, const torch::Tensor& v, const c10::optional<torch::Tensor>& weight,
                      const c10::optional<torch::Tensor>& keep, bool normalize, double eps,
                      const c10::optional<torch::Tensor>& out16) {
  check_view(out, "out");
  const bool bf16 = v.scalar_type() == at::kBFloat16;
  check_view(v, "v", bf16);
  YOSO_CHECK(v.sizes() == out.sizes(), "v must have out's shape (B, H, N, D) ", out.sizes(), ", got ", v.sizes());
  YOSO_CHECK(eps > 0, "eps must be positive, got ", eps);
  if (out16.has_value()) {
    check_view(*out16, "out16", true);
    YOSO_CHECK(out16->sizes() == out.sizes(), "out16 must have out's shape (B, H, N, D) ", out.sizes(), ", got ",
               out16->sizes());
  }
  const int64_t batch = out.size(0), heads = out.size(1), n = out.size(2), d = out.size(3);
  int64_t window = 0;
  const float* w = nullptr;
  if (weight.has_value()) {
    check_tensor(*weight, "weight", at::kFloat, 2);
    YOSO_CHECK(weight->size(0) == heads, "weight must be (H, W) with H = ", heads, ", got ", weight->sizes());
    window = weight->size(1);
    YOSO_CHECK(window % 2 == 1, "the convolution window must be odd, got ", window);
    w = weight->data_ptr<float>();
  }
  const uint8_t* kp = nullptr;
  if (keep.has_value()) {
    check_tensor(*keep, "keep", at::kBool, 2);
    YOSO_CHECK(keep->size(0) == batch && keep->size(1) == n, "keep must be (B, N) = (", batch, ", ", n, "), got ",
               keep->sizes());
    kp = reinterpret_cast<const uint8_t*>(keep->data_ptr<bool>());
  }
  if (out.numel() == 0) return;
  float* o = out.data_ptr<float>();
  const float* vp = bf16 ? nullptr : v.data_ptr<float>();
  const uint16_t* vp16 = bf16 ? reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  uint16_t* o16 = out16.has_value() ? reinterpret_cast<uint16_t*>(out16->data_ptr<at::BFloat16>()) : nullptr;
  const int64_t os16[3] = {o16 ? out16->stride(0) : 0, o16 ? out16->stride(1) : 0, o16 ? out16->stride(2) : 0};
  const int64_t blocks = (n + kRowsPerTask - 1) / kRowsPerTask;
  const float feps = float(eps);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kRowsPerTask * d * (window + 2)));
  run_without_gil([&] {
    at::parallel_for(0, batch * heads * blocks, grain, [&](int64_t first, int64_t last) {
      std::vector<float> acc(2 * d), wide(bf16 && w ? (kRowsPerTask + window) * d : 0);
      for (int64_t task = first; task < last; ++task) {
        const int64_t bh = task / blocks, b = bh / heads, h = bh % heads, i0 = (task % blocks) * kRowsPerTask;
        const int64_t i1 = std::min(n, i0 + kRowsPerTask);
        Rows rows{o + b * os[0] + h * os[1], os[2], nullptr, d, 0, kp ? kp + b * n : nullptr,
                  w ? w + h * window : nullptr, window, n, d};
        if (!bf16) {
          rows.v = vp + b * vs[0] + h * vs[1];
          rows.ldv = vs[2];
        } else if (w != nullptr) {  // the rows the taps reach, widened
          rows.v_first = std::max<int64_t>(0, i0 - window / 2);
          const int64_t end = std::min(n, i1 + window / 2);
          for (int64_t j = rows.v_first; j < end; ++j)
            yoso::simd::widen_bf16(vp16 + b * vs[0] + h * vs[1] + j * vs[2], d, wide.data() + (j - rows.v_first) * d);
          rows.v = wide.data();
        }
        finish_rows(rows, i0, i1, normalize, feps, acc.data());
        if (o16 != nullptr)  // the rows just finished, still in cache
          for (int64_t i = i0; i < i1; ++i)
            yoso::simd::to_bf16(rows.out + i * rows.ldo, d, o16 + b * os16[0] + h * os16[1] + i * os16[2]);
      }
    });
  });
}

}  // namespace

void register_finish_ops(pybind11::module_& m) {
  m.def("attention_finish", &attention_finish,
        "(out (B, H, N, D) fp32 view, v the same shape fp32 or bf16, weight (H, W) fp32 or None, keep (B, N) bool "
        "or None, normalize, eps, out16 bf16 like out or None) "
        "-> None: out rows l2-normalised (N-YOSO) then the masked values' depthwise convolution added (YOSO-C); "
        "out16: the rows also written there in bf16",
        py::arg("out"), py::arg("v"), py::arg("weight"), py::arg("keep"), py::arg("normalize"), py::arg("eps"),
        py::arg("out16") = py::none());
}
