// YOSO_CHECK: TORCH_CHECK with the message built here, numbers and shapes formatted by
// std::to_string / snprintf, so that it reaches c10 as one string and none of our messages streams
// a number through std::ostream (torch's own checks inlined from its headers still do; ours run
// first, so those are not reached from Python). It also declares the bindings' shared checks and
// glue (check_tensor, check_view, run_without_gil). On the GPU image (g++ 13.3, torch 2.11+cu130,
// Python 3.12) a TORCH_CHECK that streamed an int64 crashed the process in ostream::_M_insert<long>
// instead of raising RuntimeError (issue 18's GPU runs; string-only messages raised fine). The
// pieces' members are defined in yoso_cpu.cpp: torch's JIT build does not watch headers, so what
// this header declares stays declarations and one forwarding template.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <type_traits>

namespace yoso {

struct MessagePiece {
  std::string text;
  MessagePiece(const char* s);
  MessagePiece(const std::string& s);
  MessagePiece(double v);
  MessagePiece(c10::IntArrayRef shape);
  MessagePiece(const c10::Device& device);
  template <typename T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
  MessagePiece(T v) : text(integer_text(static_cast<long long>(v))) {}

 private:
  static std::string integer_text(long long v);
};

std::string message(std::initializer_list<MessagePiece> pieces);

}  // namespace yoso

#define YOSO_CHECK(cond, ...) TORCH_CHECK(cond, ::yoso::message({__VA_ARGS__}))

// Defined in yoso_cpu.cpp for every binding of the CPU extension. check_tensor: device, dtype, rank and
// contiguity; check_view: a (B, H, N, D) fp32 (or bf16) CPU view with unit stride along D; both with messages that
// name the limit. run_without_gil: the kernel with the GIL released (checks and errors keep it).
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rank);
void check_view(const at::Tensor& t, const char* name, bool bf16 = false);  // bf16: BFloat16 instead of fp32
void run_without_gil(const std::function<void()>& kernel);
// The code/value shape rules both devices share (yoso_cpu.cpp), once rank, dtype and device are checked, then
// (unless check_range is false: no host sync on a GPU) the codes' range; returns the bucket count 2^hash_bits.
int64_t check_codes_against_values(const at::Tensor& q_codes, const at::Tensor& k_codes, const at::Tensor& v,
                                   int64_t hash_bits, bool check_range = true);
