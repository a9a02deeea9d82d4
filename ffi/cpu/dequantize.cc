// NVFP4 dequantization: value = fp32(E2M1 * E4M3 scale) * amax / (6 E), E the
// spec's block-scale range (448, or 256 with 4over6), with one amax per tensor
// or per row; written as float32, bfloat16 or float16.
#include "cpu/common.h"
#include "cpu/handlers.h"

namespace nvfp4::cpu {
namespace {

// Rows [row_begin, row_end) of one matrix; row r's amax is amax[r * amax_stride].
template <typename S>
void dequantize_rows(const uint8_t* data, const uint8_t* scale, const float* amax,
                     int64_t amax_stride, const DequantizeSpec& spec, int64_t cols,
                     int64_t row_begin, int64_t row_end, typename S::T* out) {
  const int64_t data_cols = packed_size(cols), scale_cols = num_blocks(cols);
  std::vector<float> row(scale_cols * kBlock, 0.0f);
  float* __restrict v = row.data();
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float gds = spec.global_decode_scale(amax[r * amax_stride]);
    const uint8_t* __restrict d = data + r * data_cols;
    const uint8_t* __restrict s = scale + r * scale_cols;
    // Split into loops that vectorize: decode codes, scale by blocks, convert.
    for (int64_t i = 0; i < data_cols; ++i) {
      v[2 * i] = e2m1_to_float(d[i] & 0xF);
      v[2 * i + 1] = e2m1_to_float(d[i] >> 4);
    }
    for (int64_t b = 0; b < scale_cols; ++b) {
      const float sb = e4m3_to_float(s[b]);
      for (int k = 0; k < kBlock; ++k) v[b * kBlock + k] = scale_value(v[b * kBlock + k], sb, gds);
    }
    typename S::T* __restrict o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = S::store(v[c]);
  }
}

ffi::Error dequantize_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale,
                           ffi::Buffer<ffi::F32> amax, ffi::Result<ffi::AnyBuffer> out,
                           DequantizeSpec spec) {
  int64_t batch = 0, rows = 0, cols = 0;
  bool per_row = false;
  if (auto e = check_dequantize(data, scale, amax, *out, spec, batch, rows, cols, per_row);
      e.failure())
    return e;
  const uint8_t* d = data.typed_data();
  const auto* s = static_cast<const uint8_t*>(scale.untyped_data());
  const float* a = amax.typed_data();
  const bool ok =
      dispatch_float<StoreF32, StoreBF16, StoreF16>(out->element_type(), [&](auto storer) {
        using S = decltype(storer);
        auto* o = static_cast<typename S::T*>(out->untyped_data());
        parallel_for(pool, batch * rows, batch * rows * cols * int64_t(sizeof(typename S::T)),
                     [&](int64_t lo, int64_t hi) {
                       // Row index i spans batches; split it per batch entry.
                       for (int64_t i = lo; i < hi;) {
                         const int64_t b = i / rows, r = i % rows;
                         const int64_t end = std::min(hi - i + r, rows);
                         const CopySizes n = copy_sizes(rows, cols);
                         dequantize_rows<S>(d + b * n.data, s + b * n.scale,
                                            per_row ? a + b * rows : a + b, per_row ? 1 : 0, spec,
                                            cols, r, end, o + b * rows * cols);
                         i += end - r;
                       }
                     });
      });
  return ok ? ffi::Error::Success()
            : invalid("dequantize output must be float32, bfloat16 or float16");
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4DequantizeCpu, nvfp4::cpu::dequantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attrs<nvfp4::DequantizeSpec>());
