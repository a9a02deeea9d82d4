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

// Quantize output pointers (of the whole batch, or of one batch entry); null
// where a copy was not requested.
struct QuantizeOutputs {
  uint8_t* data;     // [B, M, ceil(N/2)]
  uint8_t* scale;    // [B, M, ceil(N/16)]
  uint8_t* data_t;   // [B, N, ceil(M/2)]
  uint8_t* scale_t;  // [B, N, ceil(M/16)]

  // The outputs of batch entry b of a [B, rows, cols] input.
  NVFP4_HD QuantizeOutputs entry(int64_t b, int64_t rows, int64_t cols) const {
    auto at = [b](uint8_t* p, int64_t size) { return p ? p + b * size : p; };
    return {at(data, rows * packed_size(cols)), at(scale, rows * num_blocks(cols)),
            at(data_t, cols * packed_size(rows)), at(scale_t, cols * num_blocks(rows))};
  }
};

// Checks quantize's [B, M, N] input, its amax [B] and the dtype and size of
// each requested output (in the order data, scale, data_t, scale_t); unpacks
// the dims and fills `o`.
inline ffi::Error check_quantize(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& amax,
                                 ffi::RemainingRets& outs, bool rowwise, bool columnwise,
                                 int64_t& batch, int64_t& rows, int64_t& cols, QuantizeOutputs& o) {
  if (!dims3(x, batch, rows, cols)) return invalid("quantize expects a [B, M, N] input");
  if (int64_t(amax.element_count()) != batch) return invalid("quantize amax must be [B]");
  uint8_t** ptrs[4] = {&o.data, &o.scale, &o.data_t, &o.scale_t};
  const int64_t sizes[4] = {rows * packed_size(cols), rows * num_blocks(cols),
                            cols * packed_size(rows), cols * num_blocks(rows)};
  const bool wanted[4] = {rowwise, rowwise, columnwise, columnwise};
  size_t next = 0;
  for (int i = 0; i < 4; ++i) {
    *ptrs[i] = nullptr;
    if (!wanted[i]) continue;
    auto buf = outs.get<ffi::AnyBuffer>(next++);
    if (!buf.has_value()) return invalid("quantize is missing an output");
    const auto dtype = i % 2 ? ffi::DataType::F8E4M3FN : ffi::DataType::U8;
    if ((*buf)->element_type() != dtype || int64_t((*buf)->element_count()) != batch * sizes[i])
      return invalid("quantize output has the wrong dtype or size");
    *ptrs[i] = static_cast<uint8_t*>((*buf)->untyped_data());
  }
  return ffi::Error::Success();
}

// Checks dequantize's operands against its [B, M, N] output and unpacks the dims.
inline ffi::Error check_dequantize(const ffi::Buffer<ffi::U8>& data, const ffi::AnyBuffer& scale,
                                   const ffi::Buffer<ffi::F32>& amax, const ffi::AnyBuffer& out,
                                   int64_t& batch, int64_t& rows, int64_t& cols) {
  if (!dims3(out, batch, rows, cols)) return invalid("dequantize output must be [B, M, N]");
  if (scale.element_type() != ffi::DataType::F8E4M3FN)
    return invalid("dequantize scales must be float8_e4m3fn");
  if (int64_t(data.element_count()) != batch * rows * packed_size(cols) ||
      int64_t(scale.element_count()) != batch * rows * num_blocks(cols) ||
      int64_t(amax.element_count()) != batch)
    return invalid("dequantize operand sizes do not match the output shape");
  return ffi::Error::Success();
}

}  // namespace nvfp4
