// What a compiled module was built with, for jax_nvfp4.build_info(): the values come from CMake
// (compile definitions NVFP4_BUILD_*), so each module reports its own build, not the package's
// hopes. Included by every module's source (ffi/module.cc, ffi/cuda/host/module.cc).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "xla/ffi/api/c_api.h"

#ifndef NVFP4_BUILD_VERSION
#define NVFP4_BUILD_VERSION "unknown"
#endif
#ifndef NVFP4_BUILD_JAXLIB
#define NVFP4_BUILD_JAXLIB "unknown"
#endif
#ifndef NVFP4_BUILD_CPU_ARCH
#define NVFP4_BUILD_CPU_ARCH ""
#endif

namespace nvfp4 {

// version, jaxlib (whose FFI headers it compiled against), xla_ffi_api, compiler, cpu_arch (the
// -march of the C++ code, "" for the compiler's default), sanitizers; the CUDA module adds
// cuda_architectures (CMake's list, "90" meaning sm_90 code and compute_90 PTX), cuda_compiler
// and cuda_runtime.
inline nanobind::dict build_config() {
  nanobind::dict d;
  d["version"] = NVFP4_BUILD_VERSION;
  d["jaxlib"] = NVFP4_BUILD_JAXLIB;
  d["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
#if defined(__clang__)
  d["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = "gcc " __VERSION__;
#else
  d["compiler"] = "unknown";
#endif
  d["cpu_arch"] = NVFP4_BUILD_CPU_ARCH;
#if defined(NVFP4_BUILD_SANITIZE)
  d["sanitizers"] = true;
#else
  d["sanitizers"] = false;
#endif
#if defined(NVFP4_BUILD_CUDA_ARCHITECTURES)
  d["cuda_architectures"] = NVFP4_BUILD_CUDA_ARCHITECTURES;
  d["cuda_compiler"] = NVFP4_BUILD_CUDA_COMPILER;
  d["cuda_runtime"] = "static";  // CUDA::cudart_static: no CUDA toolkit needed at run time
#endif
  return d;
}

}  // namespace nvfp4
