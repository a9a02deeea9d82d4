// The stream context of the CUDA handlers in the host execution model. On the GPU they take
// ffi::PlatformStream<cudaStream_t>, which XLA's CPU backend does not provide; here the context
// decodes to the model's stream object, so the handlers' code is the same in both builds.
#pragma once

#include <optional>

#include "cuda/host/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::host {
struct StreamContext {};
}  // namespace nvfp4::host

template <>
struct xla::ffi::CtxDecoding<nvfp4::host::StreamContext> {
  using Type = cudaStream_t;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return nvfp4::host::xla_stream();
  }
};
