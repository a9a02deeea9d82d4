// The CUDA FFI handlers registered by ffi/module.cc.
#pragma once

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

// FFI target name -> handler, for every op with a CUDA kernel.
inline std::vector<std::pair<const char*, Handler*>> handlers() {
  return {{"nvfp4_amax", Nvfp4AmaxCuda},
          {"nvfp4_quantize", Nvfp4QuantizeCuda},
          {"nvfp4_dequantize", Nvfp4DequantizeCuda},
          {"nvfp4_grouped_amax", Nvfp4GroupedAmaxCuda},
          {"nvfp4_grouped_quantize", Nvfp4GroupedQuantizeCuda}};
}

}  // namespace nvfp4::cuda
