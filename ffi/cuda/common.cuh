// Helpers of the CUDA FFI handlers: launch checks and grid sizes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "nvfp4/ffi_common.h"

namespace nvfp4::cuda {

// The error of the last launch, as an FFI error (success when there was none).
inline ffi::Error launch_status(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("nvfp4: ") + kernel + " launch failed: " + cudaGetErrorString(err));
}

// Blocks for a grid-stride loop over n items: enough to fill the GPU, no more.
inline unsigned grid_stride_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return unsigned(std::clamp<int64_t>(blocks, 1, int64_t(1) << 16));
}

}  // namespace nvfp4::cuda
