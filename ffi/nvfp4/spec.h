// The options of the quantize and dequantize ops, decoded once from their FFI
// attributes into one struct each, shared by the CPU and CUDA handlers (and
// passed by value to the CUDA kernels). The attribute names are the member
// names; this header is the one place the C++ checks their combinations and
// turns the block-scale range E into global scales.
#pragma once

#include <cstdint>
#include <string>

#include "nvfp4/four_over_six.h"
#include "nvfp4/numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "nvfp4: " + msg);
}

// The options of one quantize call: its FFI attributes, in this order.
struct QuantizeSpec {
  bool rowwise;              // the rowwise copy: x [B, M, N] in blocks along N
  bool columnwise;           // the columnwise copy: x^T [B, N, M] in blocks along M
  bool block_2d;             // 16x16 blocks (one quantization for both copies), else 1x16
  bool rht;                  // the columnwise copy of the RHT of x^T (1x16 blocks only)
  bool stochastic_rounding;  // codes rounded stochastically (Threefry words from a seed)
  bool row_scaled;  // amax per row of x [B, M], amax_t per row of x^T [B, N]; else [B] each
  int32_t four_over_six_error;   // 4over6 block scales' error: 0 off, 1 MAE, 2 MSE
  bool four_over_six_fast_math;  // 4over6's error of TransformerEngine's fast kernel
  int32_t e4m3_max;              // the block-scale range E: 448, or 256 with 4over6

  // The option combinations the kernels cannot run (jax_nvfp4's Python
  // QuantizeSpec.validate rejects these, and more, before any call).
  ffi::Error validate() const {
    if (four_over_six_error < kFourOverSixOff || four_over_six_error > kFourOverSixMse)
      return invalid("quantize four_over_six_error must be 0 (off), 1 (MAE) or 2 (MSE)");
    if (e4m3_max != 448 && e4m3_max != 256) return invalid("quantize e4m3_max must be 448 or 256");
    if (e4m3_max != 448 && !four_over_six().on())
      return invalid("e4m3_max=256 applies only with 4over6");
    if (row_scaled && block_2d) return invalid("row-scaled NVFP4 has 1x16 blocks only");
    if (four_over_six().on() && stochastic_rounding)
      return invalid("no stochastic rounding with 4over6");
    return ffi::Error::Success();
  }

  // Checks the element counts of quantize's amax and amax_t for a [B, M, N]
  // input: [B] each, or row-scaled [B, M] and [B, N] (each where its copy is requested).
  ffi::Error check_amax_counts(int64_t n_amax, int64_t n_amax_t, int64_t batch, int64_t rows,
                               int64_t cols) const {
    if (row_scaled) {
      if ((rowwise && n_amax != batch * rows) || (columnwise && n_amax_t != batch * cols))
        return invalid("row-scaled quantize amax and amax_t must be [B, M] and [B, N]");
    } else if (n_amax != batch || n_amax_t != batch) {
      return invalid("quantize amax and amax_t must be [B]");
    }
    return ffi::Error::Success();
  }

  // The amaxes of one batch entry's copy of `rows` rows: one per row when row-scaled, else one.
  NVFP4_HD int64_t amaxes_per_entry(int64_t rows) const { return row_scaled ? rows : 1; }

  // The grouped quantize (mixture of experts) makes a columnwise copy in 1x16 blocks.
  ffi::Error check_grouped() const {
    if (!columnwise || block_2d)
      return invalid("grouped quantize makes a columnwise copy in 1x16 blocks");
    return ffi::Error::Success();
  }

  // The work a byte of input costs, relative to one plain pass (the thread pool's split): random
  // words or 4over6's two candidates, and the transform, add passes.
  int64_t cost_per_byte() const {
    return (stochastic_rounding || four_over_six().on() ? 8 : 1) * (columnwise_rht() ? 2 : 1);
  }

  // The transform takes chunks of 16 rows: a columnwise copy of it needs M a multiple of 16.
  ffi::Error check_rows(int64_t rows) const {
    if (columnwise_rht() && rows % kBlock != 0)
      return invalid("quantize with rht needs M (the columnwise block axis) a multiple of 16");
    return ffi::Error::Success();
  }

  NVFP4_HD FourOverSix four_over_six() const {
    return FourOverSix{four_over_six_error, four_over_six_fast_math};
  }

  // Whether the columnwise copy is of the RHT of x^T: rht applies to a
  // requested columnwise copy with 1x16 blocks only.
  NVFP4_HD bool columnwise_rht() const { return rht && columnwise && !block_2d; }

  // The global scales of an amax (one per tensor, or one per row when row-scaled).
  NVFP4_HD GlobalScales global_scales(float amax) const {
    return nvfp4::global_scales(amax, six_times(e4m3_max));
  }
};

// The options of one dequantize call: its FFI attribute.
struct DequantizeSpec {
  int32_t e4m3_max;  // the block-scale range E the data was quantized with: 448 or 256

  ffi::Error validate() const {
    if (e4m3_max != 448 && e4m3_max != 256)
      return invalid("dequantize e4m3_max must be 448 or 256");
    return ffi::Error::Success();
  }

  // The global decode scale of an amax (one per tensor, or one per row): amax / (6 E).
  NVFP4_HD float global_decode_scale(float amax) const {
    return dequantize_scale(amax, six_times(e4m3_max));
  }
};

}  // namespace nvfp4

// Handlers bind .Attrs<nvfp4::QuantizeSpec>(): the attribute dictionary must
// hold exactly these entries, decoded into the members in order.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(nvfp4::QuantizeSpec, xla::ffi::StructMember<bool>("rowwise"),
                                      xla::ffi::StructMember<bool>("columnwise"),
                                      xla::ffi::StructMember<bool>("block_2d"),
                                      xla::ffi::StructMember<bool>("rht"),
                                      xla::ffi::StructMember<bool>("stochastic_rounding"),
                                      xla::ffi::StructMember<bool>("row_scaled"),
                                      xla::ffi::StructMember<int32_t>("four_over_six_error"),
                                      xla::ffi::StructMember<bool>("four_over_six_fast_math"),
                                      xla::ffi::StructMember<int32_t>("e4m3_max"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(nvfp4::DequantizeSpec,
                                      xla::ffi::StructMember<int32_t>("e4m3_max"));
