// nanobind module exposing one `registrations()` dict per platform: FFI target
// name -> handler capsule. Built twice: _nvfp4_cpu always, _nvfp4_cuda (with
// NVFP4_CUDA_MODULE defined) when the CUDA toolkit is available.
#include <nanobind/nanobind.h>

#include "build_config.h"

#if defined(NVFP4_CUDA_MODULE)
#include "cuda/handlers.h"
#define NVFP4_MODULE_NAME _nvfp4_cuda
#else
#include "cpu/e2m1.h"
#include "cpu/handlers.h"
#include "nvfp4/subnormal_guard.h"
#define NVFP4_MODULE_NAME _nvfp4_cpu
#endif

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict registrations() {
  nb::dict d;
#if defined(NVFP4_CUDA_MODULE)
  for (const auto& [name, fn] : nvfp4::cuda::handlers()) d[name] = capsule(fn);
#else
  d["nvfp4_amax"] = capsule(Nvfp4AmaxCpu);
  d["nvfp4_quantize"] = capsule(Nvfp4QuantizeCpu);
  d["nvfp4_dequantize"] = capsule(Nvfp4DequantizeCpu);
  d["nvfp4_grouped_amax"] = capsule(Nvfp4GroupedAmaxCpu);
  d["nvfp4_grouped_quantize"] = capsule(Nvfp4GroupedQuantizeCpu);
#endif
  return d;
}

#if !defined(NVFP4_CUDA_MODULE)
// How many of the 2^32 float32 bit patterns the CPU loops' E2M1 encode (cpu/e2m1.h) gives
// another code than the reference float_to_e2m1: the check that lets them use it.
uint64_t e2m1_code_mismatches() {
  nvfp4::SubnormalGuard guard;
  uint64_t mismatches = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; ++u) {
    const float v = nvfp4::bits_float(uint32_t(u));
    mismatches += nvfp4::cpu::e2m1_code(v) != nvfp4::float_to_e2m1(v);
  }
  return mismatches;
}
#endif

}  // namespace

NB_MODULE(NVFP4_MODULE_NAME, m) {
  m.doc() = "NVFP4 XLA FFI handlers";
  m.def("registrations", &registrations);
  m.def("build_config", &nvfp4::build_config,
        "What this module was built with (CMake's settings).");
#if defined(NVFP4_CUDA_MODULE)
  m.def("quantize_tensor_map_encodes", &nvfp4::cuda::quantize_tensor_map_encodes, nb::arg("base"),
        nb::arg("batch"), nb::arg("rows"), nb::arg("cols"), nb::arg("element_bytes"),
        "Whether the driver encodes the tensor map NVFP4_QUANTIZE_LOAD=ring's quantize takes for "
        "this device array (else its ring is filled by a bulk copy a row).");
#else
  m.def("e2m1_code_mismatches", &e2m1_code_mismatches,
        "Exhaustive check of the CPU kernels' E2M1 encode against float_to_e2m1: the number of "
        "float32 bit patterns on which they differ.");
#endif
}
