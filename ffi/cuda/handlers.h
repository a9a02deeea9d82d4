// The CUDA FFI handlers registered by ffi/module.cc.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4AmaxCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4QuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4DequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4GroupedAmaxCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4GroupedQuantizeCuda);

namespace nvfp4::cuda {

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// Whether the driver encodes the quantize ring's tensor map of the [batch, rows, cols] tensor of
// element_bytes-byte elements at device address `base`: where it does, NVFP4_QUANTIZE_LOAD=ring
// fills the ring's stages by tensor copies, else by a bulk copy a row (quantize.cu).
bool quantize_tensor_map_encodes(uintptr_t base, int64_t batch, int64_t rows, int64_t cols,
                                 int element_bytes);

// FFI target name -> handler, for every op with a CUDA kernel.
inline std::vector<std::pair<const char*, Handler*>> handlers() {
  return {{"nvfp4_amax", Nvfp4AmaxCuda},
          {"nvfp4_quantize", Nvfp4QuantizeCuda},
          {"nvfp4_dequantize", Nvfp4DequantizeCuda},
          {"nvfp4_grouped_amax", Nvfp4GroupedAmaxCuda},
          {"nvfp4_grouped_quantize", Nvfp4GroupedQuantizeCuda}};
}

}  // namespace nvfp4::cuda
