// NVFP4 quantization: one pass over the input in 16x16 tiles produces the
// rowwise copy and/or the columnwise copy (quantization of x^T, stored
// transposed), with 1x16 or 16x16 blocks.
#include "cpu/common.h"
#include "cpu/handlers.h"

namespace nvfp4::cpu {
namespace {

// Output pointers for one batch entry; null where a copy was not requested.
struct Outputs {
  uint8_t* data;
  uint8_t* scale;
  uint8_t* data_t;
  uint8_t* scale_t;
};

struct Tile {
  float value[kBlock][kBlock];
  uint32_t mag[kBlock][kBlock];
  uint8_t code[kBlock][kBlock];    // rowwise codes, [row][col]
  uint8_t code_t[kBlock][kBlock];  // columnwise codes, [col][row]
};

// Packs 16 codes into at most 8 bytes (fewer at the padded end of a row).
inline void pack(const uint8_t* codes, uint8_t* dst, int64_t nbytes) {
  for (int64_t k = 0; k < nbytes; ++k) dst[k] = uint8_t(codes[2 * k] | (codes[2 * k + 1] << 4));
}

inline void encode_run(const float* v, float enc, uint8_t* codes, int64_t stride = 1) {
  for (int k = 0; k < kBlock; ++k) codes[k] = quantize_value(v[k * stride], enc);
}

template <typename L>
void load_tile(const typename L::T* x, int64_t cols, int64_t nrows, int64_t ncols, Tile& t) {
  for (int r = 0; r < kBlock; ++r) {
    for (int c = 0; c < kBlock; ++c) {
      // Zero padding past the matrix edge, as the reference pads.
      const float v = (r < nrows && c < ncols) ? L::load(x[r * cols + c]) : 0.0f;
      t.value[r][c] = v;
      t.mag[r][c] = magnitude_bits(v);
    }
  }
}

// Quantizes the 16-row stripe starting at row m0 of one [rows, cols] matrix.
template <typename L>
void quantize_stripe(const typename L::T* x, int64_t rows, int64_t cols, int64_t m0,
                     const GlobalScales& g, bool block_2d, const Outputs& o) {
  const int64_t nrows = std::min<int64_t>(kBlock, rows - m0);
  const int64_t data_cols = packed_size(cols), scale_cols = num_blocks(cols);
  const int64_t data_t_cols = packed_size(rows), scale_t_cols = num_blocks(rows);
  const int64_t mb = m0 / kBlock;
  Tile t;
  for (int64_t n0 = 0; n0 < cols; n0 += kBlock) {
    const int64_t ncols = std::min<int64_t>(kBlock, cols - n0), nb = n0 / kBlock;
    const int64_t row_bytes = std::min<int64_t>(kBlock / 2, data_cols - n0 / 2);
    const int64_t col_bytes = std::min<int64_t>(kBlock / 2, data_t_cols - m0 / 2);
    load_tile<L>(x + m0 * cols + n0, cols, nrows, ncols, t);
    if (block_2d) {
      uint32_t m = 0;
      for (int r = 0; r < kBlock; ++r)
        for (int c = 0; c < kBlock; ++c) m = std::max(m, t.mag[r][c]);
      const uint8_t s = block_scale(amax_from_bits(m), g);
      const float enc = block_encode_scale(s, g);
      for (int r = 0; r < kBlock; ++r) encode_run(t.value[r], enc, t.code[r]);
      for (int r = 0; r < kBlock; ++r)
        for (int c = 0; c < kBlock; ++c) t.code_t[c][r] = t.code[r][c];
      if (o.data) {
        for (int64_t r = 0; r < nrows; ++r) {
          pack(t.code[r], o.data + (m0 + r) * data_cols + n0 / 2, row_bytes);
          o.scale[(m0 + r) * scale_cols + nb] = s;
        }
      }
      if (o.data_t) {
        for (int64_t c = 0; c < ncols; ++c) {
          pack(t.code_t[c], o.data_t + (n0 + c) * data_t_cols + m0 / 2, col_bytes);
          o.scale_t[(n0 + c) * scale_t_cols + mb] = s;
        }
      }
      continue;
    }
    if (o.data) {
      for (int64_t r = 0; r < nrows; ++r) {
        uint32_t m = 0;
        for (int c = 0; c < kBlock; ++c) m = std::max(m, t.mag[r][c]);
        const uint8_t s = block_scale(amax_from_bits(m), g);
        encode_run(t.value[r], block_encode_scale(s, g), t.code[r]);
        pack(t.code[r], o.data + (m0 + r) * data_cols + n0 / 2, row_bytes);
        o.scale[(m0 + r) * scale_cols + nb] = s;
      }
    }
    if (o.data_t) {
      uint32_t m[kBlock] = {};
      for (int r = 0; r < kBlock; ++r)
        for (int c = 0; c < kBlock; ++c) m[c] = std::max(m[c], t.mag[r][c]);
      for (int64_t c = 0; c < ncols; ++c) {
        const uint8_t s = block_scale(amax_from_bits(m[c]), g);
        encode_run(&t.value[0][c], block_encode_scale(s, g), t.code_t[c], kBlock);
        pack(t.code_t[c], o.data_t + (n0 + c) * data_t_cols + m0 / 2, col_bytes);
        o.scale_t[(n0 + c) * scale_t_cols + mb] = s;
      }
    }
  }
}

// Fetches output `index` of the remaining results, checking dtype and size.
ffi::Error output(ffi::RemainingRets& outs, size_t index, ffi::DataType dtype, int64_t count,
                  uint8_t*& ptr) {
  auto buf = outs.get<ffi::AnyBuffer>(index);
  if (!buf.has_value()) return invalid("quantize is missing an output");
  if ((*buf)->element_type() != dtype || int64_t((*buf)->element_count()) != count)
    return invalid("quantize output has the wrong dtype or size");
  ptr = static_cast<uint8_t*>((*buf)->untyped_data());
  return ffi::Error::Success();
}

ffi::Error quantize_impl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax, ffi::RemainingRets outs,
                         bool rowwise, bool columnwise, bool block_2d) {
  int64_t batch, rows, cols;
  if (!dims3(x, batch, rows, cols)) return invalid("quantize expects a [B, M, N] input");
  if (int64_t(amax.element_count()) != batch) return invalid("quantize amax must be [B]");
  Outputs o{nullptr, nullptr, nullptr, nullptr};
  size_t next = 0;
  if (rowwise) {
    if (auto e = output(outs, next++, ffi::DataType::U8, batch * rows * packed_size(cols), o.data);
        e.failure())
      return e;
    if (auto e = output(outs, next++, ffi::DataType::F8E4M3FN, batch * rows * num_blocks(cols),
                        o.scale);
        e.failure())
      return e;
  }
  if (columnwise) {
    if (auto e = output(outs, next++, ffi::DataType::U8, batch * cols * packed_size(rows), o.data_t);
        e.failure())
      return e;
    if (auto e = output(outs, next++, ffi::DataType::F8E4M3FN, batch * cols * num_blocks(rows),
                        o.scale_t);
        e.failure())
      return e;
  }
  const float* amax_data = amax.typed_data();
  const int64_t stripes = num_blocks(rows);
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    const int64_t cost = batch * rows * cols * int64_t(sizeof(typename L::T));
    parallel_for(batch * stripes, cost, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / stripes, stripe = i % stripes;
        const Outputs ob{
            o.data ? o.data + b * rows * packed_size(cols) : nullptr,
            o.scale ? o.scale + b * rows * num_blocks(cols) : nullptr,
            o.data_t ? o.data_t + b * cols * packed_size(rows) : nullptr,
            o.scale_t ? o.scale_t + b * cols * num_blocks(rows) : nullptr,
        };
        quantize_stripe<L>(data + b * rows * cols, rows, cols, stripe * kBlock,
                           global_scales(amax_data[b]), block_2d, ob);
      }
    });
  });
  return ok ? ffi::Error::Success() : invalid("quantize input must be bfloat16, float16 or float32");
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCpu, nvfp4::cpu::quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("columnwise")
                                  .Attr<bool>("block_2d"));
