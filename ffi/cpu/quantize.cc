// NVFP4 quantization: one pass over the input, 16 rows at a time, produces the
// rowwise copy and/or the columnwise copy (quantization of x^T, stored
// transposed), with 1x16 or 16x16 blocks. Each 16-row stripe is converted to
// float32 once and stays in cache for both copies. Options: the columnwise copy
// of the Random Hadamard Transform of x^T (rht), and stochastic rounding with
// counter-based Philox random bytes, one hash per block (stochastic_rounding); row-scaled global
// scales (one amax per row of x and per row of x^T) and 4over6 block scaling.
#include "cpu/handlers.h"
#include "cpu/stripe.h"

namespace nvfp4::cpu {
namespace {

// Quantizes the 16-row stripe starting at row m0 of one [rows, cols] matrix, stripe `slot` of
// its band: its columnwise copy is kept for store_band.
// Columnwise 1x16 blocks (16 rows of one column) and 16x16 blocks both take
// one encode scale per column of the stripe, so they share one vector loop.
template <typename L>
void quantize_stripe(const typename L::T* x, int64_t rows, int64_t cols, int64_t m0, int64_t slot,
                     const Options& p, const QuantizeOutputs& o, Stripe& st) {
  const bool block_2d = p.spec.block_2d;
  const int64_t nrows = std::min<int64_t>(kBlock, rows - m0);
  const int64_t width = num_blocks(cols) * kBlock;
  st.value.resize(kBlock * width);
  load_stripe<L>(x + m0 * cols, cols, nrows, width, st.value.data());
  if (o.data && !block_2d) rowwise_1d(st, rows, nrows, cols, width, m0, p, o);
  if (!block_2d && !o.data_t) return;

  // Columnwise 1x16 or 16x16: one encode scale per column of the stripe.
  // The columnwise copy of the RHT of x^T (M % 16 == 0: no padded rows); the
  // rowwise copy is done, so the stripe is transformed in place.
  if (p.spec.columnwise_rht()) transform_stripe<L>(st, width);
  column_maxima(st, width);
  if (block_2d)
    tile_scales(st, width, p);
  else
    column_scales(st, cols, width, p);
  encode_columns(st, width, m0, p);
  if (o.data && block_2d) store_rows_2d(st, nrows, cols, width, m0, o);
  if (!o.data_t) return;
  if (block_2d && p.spec.four_over_six().on()) {
    // x^T's own 4over6 choice: re-encode with the columnwise copy's scales.
    st.scale.swap(st.scale_t);
    st.enc.swap(st.enc_t);
    encode_columns(st, width, m0, p);
  }
  band_columns(st, width, slot);
}

ffi::Error quantize_impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                         ffi::Buffer<ffi::F32> amax_t, ffi::Buffer<ffi::U32> seed,
                         ffi::RemainingRets outs, QuantizeSpec spec) {
  int64_t batch = 0, rows = 0, cols = 0;
  QuantizeOutputs all;
  bool placed = false;
  if (auto e = check_quantize(x, amax, amax_t, seed, outs, spec, batch, rows, cols, all, placed);
      e.failure())
    return e;
  const float* amax_data = amax.typed_data();
  const float* amax_t_data = amax_t.typed_data();
  const Stream key = stream_of(seed.typed_data(), placed, rows);
  const int64_t stripes = num_blocks(rows);
  const int64_t bands = (stripes + kBandStripes - 1) / kBandStripes;
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    const int64_t cost =
        batch * rows * cols * int64_t(sizeof(typename L::T)) * spec.cost_per_byte();
    parallel_for(pool, batch * bands, cost, [&](int64_t lo, int64_t hi) {
      Stripe st;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / bands, band = i % bands;
        Options p{spec, GlobalScales{}, GlobalScales{}, nullptr, nullptr, key, uint32_t(b)};
        p.set_rows(amax_data, b, rows);
        p.set_columns(amax_t_data, b, cols);
        const QuantizeOutputs o = all.entry(b, rows, cols);
        const int64_t first = band * kBandStripes;
        const int64_t last = std::min(stripes, first + kBandStripes);
        for (int64_t stripe = first; stripe < last; ++stripe)
          quantize_stripe<L>(data + b * rows * cols, rows, cols, stripe * kBlock, stripe - first, p,
                             o, st);
        if (o.data_t) store_band(st, rows, cols, first * kBlock, o);
      }
    });
  });
  return ok ? ffi::Error::Success()
            : invalid("quantize input must be bfloat16, float16 or float32");
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCpu, nvfp4::cpu::quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingRets()
                                  .Attrs<nvfp4::QuantizeSpec>());
