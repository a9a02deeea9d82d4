// Helpers shared by the CPU and CUDA FFI handlers: element loaders and storers
// (host and device), dtype dispatch, buffer checks and block arithmetic.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "nvfp4/numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// Element loaders: every input dtype is read as an exact float32.
struct LoadBF16 {
  using T = uint16_t;
  static NVFP4_HD float load(T v) { return bf16_to_float(v); }
};
struct LoadF16 {
  using T = uint16_t;
  static NVFP4_HD float load(T v) { return f16_to_float(v); }
};
struct LoadF32 {
  using T = float;
  static NVFP4_HD float load(T v) { return v; }
};

// Element storers of dequantize: float32 rounded to the output dtype (RNE).
struct StoreF32 {
  using T = float;
  static NVFP4_HD T store(float v) { return v; }
};
struct StoreBF16 {
  using T = uint16_t;
  static NVFP4_HD T store(float v) { return float_to_bf16(v); }
};
struct StoreF16 {
  using T = uint16_t;
  static NVFP4_HD T store(float v) { return float_to_f16(v); }
};

// Calls fn(F32{}), fn(BF16{}) or fn(F16{}) for a float dtype; false for any
// other dtype. The tags are the loaders or the storers above.
template <typename F32, typename BF16, typename F16, typename Fn>
bool dispatch_float(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      fn(F32{});
      return true;
    case ffi::DataType::BF16:
      fn(BF16{});
      return true;
    case ffi::DataType::F16:
      fn(F16{});
      return true;
    default:
      return false;
  }
}

template <typename Fn>
bool dispatch_input(ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<LoadF32, LoadBF16, LoadF16>(dtype, std::forward<Fn>(fn));
}

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "nvfp4: " + msg);
}

// Checks that a buffer is [B, rows, cols] and unpacks the dims.
inline bool dims3(const ffi::AnyBuffer& buf, int64_t& b, int64_t& rows, int64_t& cols) {
  const auto d = buf.dimensions();
  if (d.size() != 3) return false;
  b = d[0];
  rows = d[1];
  cols = d[2];
  return true;
}

NVFP4_HD int64_t packed_size(int64_t n) { return (n + 1) / 2; }
NVFP4_HD int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

}  // namespace nvfp4
