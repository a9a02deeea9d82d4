// The CUDA FFI handlers registered by ffi/module.cc.
//
// The CUDA kernels arrive with the CUDA backend issue; until then the module
// registers no target (the Python side lowers the ops on GPUs through the
// pure-JAX reference) and only proves that the shared numerics compile for
// every target architecture (numerics_check.cu).
#pragma once

#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace nvfp4::cuda {

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

std::vector<std::pair<const char*, Handler*>> handlers();

}  // namespace nvfp4::cuda
