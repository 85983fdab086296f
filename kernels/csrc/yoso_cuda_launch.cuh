// Launch helpers every YOSO CUDA translation unit uses (through yoso_cuda_common.cuh, or directly as
// yoso_cuda_hash.cu does): the block size, the full warp mask, the grid size and the launch check.
// Internal to each unit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

const char* launched() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Grid size; 0 (which the launch rejects as an invalid configuration) past CUDA's 2^31 - 1
// blocks, so an oversized problem fails loudly instead of being cut short.
unsigned blocks_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return blocks > 0x7fffffff ? 0u : static_cast<unsigned>(blocks);
}

}  // namespace
