// The sum after bf16 GEMMs (--dense-dtype bf16), whose outputs are bf16, registered into the module by yoso_cpu.cpp's
// PYBIND11_MODULE:
//   sum_parts(parts [(R, N) bf16 or fp32, one dtype], start (R, N) fp32 or None)
//     -> (R, N) fp32 = ((start + parts[0]) + parts[1]) + ..., each part widened to fp32 (no start: parts[0] + ...)
// The same IEEE operations, in the same order, as kernels/dense_parts.py's PyTorch reference, so the same bits; each
// row computed by one thread from its own values (its bits at any row or thread count). In PyTorch ops it made one
// pass over memory per part.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "yoso_check.h"

namespace yoso::rows {  // yoso_cpu_quant.cpp
int64_t grain_rows(int64_t width);
const float* start_rows(const c10::optional<torch::Tensor>& start, int64_t rows, int64_t n);
}  // namespace yoso::rows

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define YOSO_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define YOSO_SIMD_CLONES
#endif
// Inlined into each clone, so the clone's own instruction set compiles the loops: a plain inline template stayed one
// baseline (SSE2) copy that every clone called.
#define YOSO_PARTS_INLINE __attribute__((always_inline)) inline

using yoso::rows::grain_rows;
using yoso::rows::start_rows;

// Rows [r0, r1) of the sum; P is the parts' element type (uint16_t: bf16 bits, widened by a 16-bit shift).
template <typename P>
YOSO_PARTS_INLINE float widen(P x) {
  if constexpr (std::is_same<P, float>::value) {
    return x;
  } else {
    const uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
}

template <typename P>
YOSO_PARTS_INLINE void sum_block(const P* const* parts, int64_t count, const float* __restrict start,
                                 float* __restrict out, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    float* __restrict o = out + r * n;
    const P* __restrict first = parts[0] + r * n;
    if (start != nullptr) {
      const float* __restrict st = start + r * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = st[c] + widen(first[c]);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = widen(first[c]);
    }
    for (int64_t j = 1; j < count; ++j) {
      const P* __restrict part = parts[j] + r * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] += widen(part[c]);
    }
  }
}

YOSO_SIMD_CLONES
void sum_block_bf16(const uint16_t* const* parts, int64_t count, const float* start, float* out, int64_t r0, int64_t r1,
                    int64_t n) {
  sum_block(parts, count, start, out, r0, r1, n);
}

YOSO_SIMD_CLONES
void sum_block_fp32(const float* const* parts, int64_t count, const float* start, float* out, int64_t r0, int64_t r1,
                    int64_t n) {
  sum_block(parts, count, start, out, r0, r1, n);
}

torch::Tensor sum_parts(const std::vector<torch::Tensor>& parts, const c10::optional<torch::Tensor>& start) {
  YOSO_CHECK(!parts.empty(), "parts must hold at least one (R, N) tensor");
  const at::ScalarType dtype = parts[0].scalar_type();
  YOSO_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "parts must be BFloat16 or Float, got ",
             c10::toString(dtype));
  for (const auto& part : parts) check_tensor(part, "every part", dtype, 2);
  const int64_t rows = parts[0].size(0), n = parts[0].size(1);
  for (const auto& part : parts)
    YOSO_CHECK(part.size(0) == rows && part.size(1) == n, "every part must be (R, N) = (", rows, ", ", n,
               "), got ", part.sizes());
  const float* stp = start_rows(start, rows, n);
  torch::Tensor out = torch::empty({rows, n}, parts[0].options().dtype(at::kFloat));
  if (rows == 0 || n == 0) return out;
  const int64_t count = int64_t(parts.size());
  std::vector<const void*> ptrs;
  for (const auto& part : parts) ptrs.push_back(part.data_ptr());
  float* op = out.data_ptr<float>();
  run_without_gil([&] {
    at::parallel_for(0, rows, grain_rows(n * count), [&](int64_t r0, int64_t r1) {
      if (dtype == at::kFloat)
        sum_block_fp32(reinterpret_cast<const float* const*>(ptrs.data()), count, stp, op, r0, r1, n);
      else
        sum_block_bf16(reinterpret_cast<const uint16_t* const*>(ptrs.data()), count, stp, op, r0, r1, n);
    });
  });
  return out;
}

}  // namespace

void register_parts_ops(pybind11::module_& m) {
  m.def("sum_parts", &sum_parts,
        "(parts [(R, N) bf16 or fp32, one dtype], start (R, N) fp32 or None) -> (R, N) fp32 = ((start + parts[0]) + "
        "parts[1]) + ... in that order, each part widened to fp32 (no start: parts[0] + parts[1] + ...)",
        py::arg("parts"), py::arg("start"));
}
