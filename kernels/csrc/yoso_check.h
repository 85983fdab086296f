// YOSO_CHECK: TORCH_CHECK with the message built here, numbers and shapes formatted by
// std::to_string / snprintf, so that it reaches c10 as one string and none of our messages streams
// a number through std::ostream (torch's own checks inlined from its headers still do; ours run
// first, so those are not reached from Python). On the GPU image (g++ 13.3, torch 2.11+cu130,
// Python 3.12) a TORCH_CHECK that streamed an int64 crashed the process in ostream::_M_insert<long>
// instead of raising RuntimeError (issue 18's GPU runs; string-only messages raised fine). The
// pieces' members are defined in yoso_cpu.cpp: torch's JIT build does not watch headers, so what
// this header declares stays declarations and one forwarding template.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
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
