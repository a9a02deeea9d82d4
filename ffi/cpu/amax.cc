// Global amax: max |x| per batch entry, as an integer max over magnitude bits
// (exact, and any NaN wins and comes out canonical).
#include <cstring>

#include "cpu/common.h"
#include "cpu/handlers.h"

namespace nvfp4::cpu {
namespace {

template <typename Loader>
uint32_t max_magnitude_bits(const typename Loader::T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, magnitude_bits(Loader::load(x[i])));
  return m;
}

ffi::Error amax_impl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  int64_t batch, rows, cols;
  if (!dims3(x, batch, rows, cols)) return invalid("amax expects a [B, M, N] input");
  if (out->element_count() != size_t(batch)) return invalid("amax output must be [B]");
  const int64_t per_batch = rows * cols;
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    for (int64_t b = 0; b < batch; ++b) {
      const auto* xb = data + b * per_batch;
      // Split the tensor into chunks, reduce each on its own thread, then combine.
      constexpr int64_t kChunks = 64;
      uint32_t partial[kChunks] = {};
      const int64_t chunk = (per_batch + kChunks - 1) / kChunks;
      parallel_for(kChunks, per_batch * int64_t(sizeof(typename L::T)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t c = lo; c < hi; ++c) {
                       const int64_t begin = std::min(per_batch, c * chunk);
                       const int64_t end = std::min(per_batch, begin + chunk);
                       partial[c] = max_magnitude_bits<L>(xb + begin, end - begin);
                     }
                   });
      uint32_t m = 0;
      for (uint32_t p : partial) m = std::max(m, p);
      out->typed_data()[b] = amax_from_bits(m);
    }
  });
  return ok ? ffi::Error::Success() : invalid("amax input must be bfloat16, float16 or float32");
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Nvfp4AmaxCpu, nvfp4::cpu::amax_impl,
    xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::Buffer<xla::ffi::F32>>());
