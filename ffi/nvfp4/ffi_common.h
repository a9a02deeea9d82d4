// Helpers shared by the CPU and CUDA FFI handlers: element loaders and storers
// (host and device), dtype dispatch, buffer checks and block arithmetic.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "nvfp4/numerics.h"
#include "nvfp4/spec.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

// Element loaders: every input dtype is read as an exact float32; narrow()
// rounds a float32 to the nearest value of the input dtype (RNE, the RHT output).
struct LoadBF16 {
  using T = uint16_t;
  static NVFP4_HD float load(T v) { return bf16_to_float(v); }
  static NVFP4_HD float narrow(float v) { return bf16_to_float(float_to_bf16(v)); }
};
struct LoadF16 {
  using T = uint16_t;
  static NVFP4_HD float load(T v) { return f16_to_float(v); }
  static NVFP4_HD float narrow(float v) { return f16_to_float(float_to_f16(v)); }
};
struct LoadF32 {
  using T = float;
  static NVFP4_HD float load(T v) { return v; }
  static NVFP4_HD float narrow(float v) { return v; }
};

// The RHT of one 16-value chunk, rounded to the input dtype of loader L.
template <typename L>
NVFP4_HD void rht16_narrow(float (&v)[kBlock]) {
  rht16(v);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kBlock; ++i) v[i] = L::narrow(v[i]);
}

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

// Two values rounded by 16-bit storer S into one word, lo's bits in the lower half: on the GPU
// one paired convert, which gives S::store's bits for every value but a NaN (0x7FFF there): no
// caller passes one.
template <typename S>
NVFP4_HD uint32_t store2(float hi, float lo) {
  static_assert(sizeof(typename S::T) == 2, "store2 pairs 16-bit values");
#if defined(__CUDA_ARCH__)
  uint32_t d;
  if constexpr (std::is_same_v<S, StoreBF16>)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return uint32_t(S::store(hi)) << 16 | S::store(lo);
#endif
}

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

// Element counts of the four arrays that quantizing one [rows, cols] entry gives: the rowwise
// codes and scales, and those of the columnwise copy (of the transpose). The C++ twin of
// QuantizeSpec.copy_shapes (jax_nvfp4/core/spec.py).
struct CopySizes {
  int64_t data, scale, data_t, scale_t;
};
NVFP4_HD CopySizes copy_sizes(int64_t rows, int64_t cols) {
  return {rows * packed_size(cols), rows * num_blocks(cols), cols * packed_size(rows),
          cols * num_blocks(rows)};
}

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
    const CopySizes n = copy_sizes(rows, cols);
    return {at(data, n.data), at(scale, n.scale), at(data_t, n.data_t), at(scale_t, n.scale_t)};
  }
};

// Whether a quantize's seed operand is uint32 [2] (the key) or [4 + rows] (the key and a shard's
// place: Stream); `placed` says which.
inline bool seed_shape_ok(const ffi::Buffer<ffi::U32>& seed, int64_t rows, bool& placed) {
  placed = int64_t(seed.element_count()) == 4 + rows;
  return placed || seed.element_count() == 2;
}

// Checks quantize's [B, M, N] input, its amax and amax_t ([B], or [B, M] and
// [B, N] when row-scaled), the seed (uint32 [2], or [4 + M] where `placed`: see
// Stream), the spec and the dtype and size of each requested output (in the
// order data, scale, data_t, scale_t); unpacks the dims and fills `o`.
inline ffi::Error check_quantize(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& amax,
                                 const ffi::Buffer<ffi::F32>& amax_t,
                                 const ffi::Buffer<ffi::U32>& seed, ffi::RemainingRets& outs,
                                 const QuantizeSpec& spec, int64_t& batch, int64_t& rows,
                                 int64_t& cols, QuantizeOutputs& o, bool& placed) {
  if (!dims3(x, batch, rows, cols)) return invalid("quantize expects a [B, M, N] input");
  if (auto e = spec.validate(); e.failure()) return e;
  if (auto e = spec.check_amax_counts(int64_t(amax.element_count()),
                                      int64_t(amax_t.element_count()), batch, rows, cols);
      e.failure())
    return e;
  if (!seed_shape_ok(seed, rows, placed))
    return invalid("quantize seed must be uint32 [2] or [4 + M] (the key and the shard's place)");
  if (auto e = spec.check_rows(rows); e.failure()) return e;
  uint8_t** ptrs[4] = {&o.data, &o.scale, &o.data_t, &o.scale_t};
  const CopySizes n = copy_sizes(rows, cols);
  const int64_t sizes[4] = {n.data, n.scale, n.data_t, n.scale_t};
  const bool wanted[4] = {spec.rowwise, spec.rowwise, spec.columnwise, spec.columnwise};
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
  if (outs.size() != next) return invalid("quantize has more outputs than requested copies");
  return ffi::Error::Success();
}

// Checks amax's [B, M, N] input and its 1 result (amax [B]) or, with rht_amax, 2
// results (amax, amax_t [B]); per row, always 2 results: the amax of each
// row of x [B, M] and of each row of x^T (or of its RHT) [B, N]. Unpacks the
// dims and the result pointers.
inline ffi::Error check_amax(const ffi::AnyBuffer& x, ffi::RemainingRets& outs, bool rht_amax,
                             bool per_row, int64_t& batch, int64_t& rows, int64_t& cols,
                             float*& amax, float*& amax_t) {
  if (!dims3(x, batch, rows, cols)) return invalid("amax expects a [B, M, N] input");
  if (rht_amax && rows % kBlock != 0) return invalid("amax with rht_amax needs M a multiple of 16");
  const size_t wanted = rht_amax || per_row ? 2 : 1;
  if (outs.size() != wanted)
    return invalid(wanted == 2 ? "amax with rht_amax or per-row has 2 results"
                               : "amax has 1 result");
  const int64_t sizes[2] = {per_row ? batch * rows : batch, per_row ? batch * cols : batch};
  float* ptrs[2] = {nullptr, nullptr};
  for (size_t i = 0; i < wanted; ++i) {
    auto buf = outs.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return invalid("amax is missing a result");
    if ((*buf)->element_type() != ffi::DataType::F32 ||
        int64_t((*buf)->element_count()) != sizes[i])
      return invalid(per_row ? "per-row amax results must be float32 [B, M] and [B, N]"
                             : "amax results must be float32 [B]");
    ptrs[i] = static_cast<float*>((*buf)->untyped_data());
  }
  amax = ptrs[0];
  amax_t = ptrs[1];
  return ffi::Error::Success();
}

// The shape of a grouped op: x [B, M, N] in G groups of token rows, whose columnwise copy has
// P = ceil(M/16) + G - 1 blocks of 16 rows (jax_nvfp4/reference/grouped.py).
struct GroupedShape {
  int64_t batch = 0, rows = 0, cols = 0, groups = 0, blocks = 0;

  // Element counts, whole batch: the grouped amax's two results, and the grouped copy's scales
  // [B, N, P] and data [B, N, 8P].
  int64_t amax_count(bool per_row) const { return per_row ? batch * rows : batch; }
  int64_t group_amax_count(bool per_row) const {
    return per_row ? batch * groups * cols : batch * groups;
  }
  int64_t grouped_scale_count() const { return batch * cols * blocks; }
  int64_t grouped_data_count() const { return grouped_scale_count() * (kBlock / 2); }
};

// Checks a grouped op's [B, M, N] input and group_sizes int32 [B, G], G >= 1; fills `s`.
inline ffi::Error check_grouped_input(const char* op, const ffi::AnyBuffer& x,
                                      const ffi::Buffer<ffi::S32>& sizes, GroupedShape& s) {
  if (!dims3(x, s.batch, s.rows, s.cols))
    return invalid(std::string(op) + " expects a [B, M, N] input");
  const auto d = sizes.dimensions();
  if (d.size() != 2 || d[0] != s.batch || d[1] < 1)
    return invalid("group_sizes must be int32 [B, G] with G >= 1");
  s.groups = d[1];
  s.blocks = num_blocks(s.rows) + s.groups - 1;
  return ffi::Error::Success();
}

// Checks the grouped amax's operands and its 2 results, float32 [B] and [B, G] ([B, M] and
// [B, G, N] per row); fills `s` and the result pointers.
inline ffi::Error check_grouped_amax(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& sizes,
                                     ffi::RemainingRets& outs, bool rht_amax, bool per_row,
                                     GroupedShape& s, float* (&results)[2]) {
  if (auto e = check_grouped_input("grouped amax", x, sizes, s); e.failure()) return e;
  // As the quantize's transform (the reference's grouped layout would allow any M).
  if (rht_amax && s.rows % kBlock != 0)
    return invalid("grouped amax with rht_amax needs M a multiple of 16");
  if (outs.size() != 2) return invalid("grouped amax has 2 results");
  const int64_t counts[2] = {s.amax_count(per_row), s.group_amax_count(per_row)};
  for (size_t i = 0; i < 2; ++i) {
    auto buf = outs.get<ffi::AnyBuffer>(i);
    if (!buf.has_value() || (*buf)->element_type() != ffi::DataType::F32 ||
        int64_t((*buf)->element_count()) != counts[i])
      return invalid(
          "grouped amax results must be float32 [B] and [B, G] ([B, M] and [B, G, N] per row)");
    results[i] = static_cast<float*>((*buf)->untyped_data());
  }
  return ffi::Error::Success();
}

// Checks the grouped quantize's operands: the spec (a columnwise 1x16 copy), amax [B] and amax_t
// [B, G] ([B, M] and [B, G, N] row-scaled), the seeds (uint32 [2] or [4 + M] where `placed`, as
// quantize's; [G, 2]), and each output (the rowwise data and scale if requested, then the grouped
// copy's, [B, N, 8P] and [B, N, P]); fills `s` and `o`.
inline ffi::Error check_grouped_quantize(
    const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& sizes, const ffi::Buffer<ffi::F32>& amax,
    const ffi::Buffer<ffi::F32>& amax_t, const ffi::Buffer<ffi::U32>& seed,
    const ffi::Buffer<ffi::U32>& group_seeds, ffi::RemainingRets& outs, const QuantizeSpec& spec,
    GroupedShape& s, QuantizeOutputs& o, bool& placed) {
  if (auto e = check_grouped_input("grouped quantize", x, sizes, s); e.failure()) return e;
  if (auto e = spec.validate(); e.failure()) return e;
  if (auto e = spec.check_grouped(); e.failure()) return e;
  const int64_t per_row = spec.amaxes_per_entry(s.rows), per_col = spec.amaxes_per_entry(s.cols);
  if ((spec.rowwise && int64_t(amax.element_count()) != s.batch * per_row) ||
      int64_t(amax_t.element_count()) != s.batch * s.groups * per_col)
    return invalid(
        "grouped quantize amax / amax_t must be [B] / [B, G] ([B, M] / [B, G, N] row-scaled)");
  if (!seed_shape_ok(seed, s.rows, placed) || int64_t(group_seeds.element_count()) != 2 * s.groups)
    return invalid("grouped quantize seeds must be uint32 [2] (or [4 + M]) and [G, 2]");
  if (auto e = spec.check_rows(s.rows); e.failure()) return e;
  o = QuantizeOutputs{nullptr, nullptr, nullptr, nullptr};
  uint8_t** ptrs[4] = {&o.data, &o.scale, &o.data_t, &o.scale_t};
  const CopySizes rowwise = copy_sizes(s.rows, s.cols);
  const int64_t counts[4] = {s.batch * rowwise.data, s.batch * rowwise.scale,
                             s.grouped_data_count(), s.grouped_scale_count()};
  size_t next = 0;
  for (int i = spec.rowwise ? 0 : 2; i < 4; ++i) {
    auto buf = outs.get<ffi::AnyBuffer>(next++);
    const auto dtype = i % 2 ? ffi::DataType::F8E4M3FN : ffi::DataType::U8;
    if (!buf.has_value() || (*buf)->element_type() != dtype ||
        int64_t((*buf)->element_count()) != counts[i])
      return invalid("grouped quantize output is missing or has the wrong dtype or size");
    *ptrs[i] = static_cast<uint8_t*>((*buf)->untyped_data());
  }
  if (outs.size() != next) return invalid("grouped quantize has more outputs than copies");
  return ffi::Error::Success();
}

// Checks dequantize's operands against its [B, M, N] output and the spec, and
// unpacks the dims; `per_row` is set when amax is [B, M] (one per row), not [B].
inline ffi::Error check_dequantize(const ffi::Buffer<ffi::U8>& data, const ffi::AnyBuffer& scale,
                                   const ffi::Buffer<ffi::F32>& amax, const ffi::AnyBuffer& out,
                                   const DequantizeSpec& spec, int64_t& batch, int64_t& rows,
                                   int64_t& cols, bool& per_row) {
  if (!dims3(out, batch, rows, cols)) return invalid("dequantize output must be [B, M, N]");
  if (scale.element_type() != ffi::DataType::F8E4M3FN)
    return invalid("dequantize scales must be float8_e4m3fn");
  if (auto e = spec.validate(); e.failure()) return e;
  per_row = amax.dimensions().size() == 2;
  const CopySizes n = copy_sizes(rows, cols);
  if (int64_t(data.element_count()) != batch * n.data ||
      int64_t(scale.element_count()) != batch * n.scale ||
      int64_t(amax.element_count()) != (per_row ? batch * rows : batch) ||
      amax.dimensions().size() > 2)
    return invalid("dequantize operand sizes do not match the output shape (amax [B] or [B, M])");
  return ffi::Error::Success();
}

}  // namespace nvfp4
