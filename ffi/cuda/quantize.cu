// NVFP4 quantization on the GPU, bit-identical to the CPU kernel: one pass over
// the input produces the rowwise and/or columnwise copy with 1x16 or 16x16
// blocks. A CUDA block owns a 16-row stripe x 128 columns; each thread holds
// one column of the stripe (16 values) in registers, so the columnwise block is
// thread-local and the rowwise blocks (16 consecutive columns) are 16 lanes of
// a warp, reduced with shuffles. Every input value is read once. With rht the
// thread transforms its column's 16 values in registers for the columnwise
// copy; with stochastic rounding each code draws a Threefry random word; with
// 4over6 each block picks between two candidate scales (four_over_six.cuh);
// row-scaled, each row of either copy has its own global scales.
#include "cuda/common.cuh"
#include "cuda/four_over_six.cuh"
#include "cuda/handlers.h"

namespace nvfp4::cuda {
namespace {

constexpr int kTile = 128;  // columns per CUDA block (4 warps)

// Max over the 16 lanes of a block (xor offsets < 16 stay inside the group).
__device__ __forceinline__ uint32_t group16_max(uint32_t m) {
  for (int offset = 8; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(~0u, m, offset));
  return m;
}

// Writes row r of the rowwise copy: even lanes pack their code with the odd
// neighbour's; the first lane of each 16 writes the block scale.
__device__ __forceinline__ void store_row(uint8_t code, uint8_t scale, int64_t row, int64_t c,
                                          int64_t cols, bool valid_row, const QuantizeOutputs& o) {
  const uint8_t high = uint8_t(__shfl_down_sync(~0u, unsigned(code), 1));
  if (!valid_row || c >= cols) return;
  if (c % 2 == 0) o.data[row * packed_size(cols) + c / 2] = uint8_t(code | (high << 4));
  if (c % kBlock == 0) o.scale[row * num_blocks(cols) + c / kBlock] = scale;
}

// Writes column c's 16 codes (rows m0..m0+15) and scale to the columnwise copy.
__device__ __forceinline__ void store_column(const uint8_t (&code)[kBlock], uint8_t scale,
                                             int64_t b, int64_t m0, int64_t c, int64_t rows,
                                             int64_t cols, const QuantizeOutputs& o) {
  if (c >= cols) return;
  const int64_t data_t_cols = packed_size(rows);
  uint8_t* dst = o.data_t + (b * cols + c) * data_t_cols + m0 / 2;
  const int64_t nbytes = min(int64_t(kBlock / 2), data_t_cols - m0 / 2);
  for (int k = 0; k < nbytes; ++k) dst[k] = uint8_t(code[2 * k] | (code[2 * k + 1] << 4));
  o.scale_t[(b * cols + c) * num_blocks(rows) + m0 / kBlock] = scale;
}

// The kernel's operands and options (by value).
struct Params {
  const float* amax;     // [B] (row-scaled: [B, M]): the rowwise copy and 16x16 blocks
  const float* amax_t;   // [B] (row-scaled: [B, N]): the columnwise 1x16 copy
  const uint32_t* seed;  // [2]: the Threefry key of stochastic rounding (device memory)
  int64_t rows, cols, stripes, tiles;
  QuantizeSpec spec;  // its rht applies as columnwise_rht(): a columnwise 1x16 copy
  QuantizeOutputs o;
};

// How the codes round: to nearest, stochastically, or to nearest with the
// 4over6 choice of the block scale (a kernel each, so that each keeps its registers).
enum class Mode { kNearest, kStochastic, kFourOverSix };

// E2M1 code of v * enc: round to nearest even, or stochastically by `word`.
template <Mode kMode>
__device__ __forceinline__ uint8_t encode(float v, float enc, uint32_t word) {
  if constexpr (kMode == Mode::kStochastic) return quantize_value_stochastic(v, enc, word);
  return quantize_value(v, enc);
}

// The 16x16 blocks of the thread's column: one quantization for both copies
// (with 4over6 each copy makes its own choice).
template <Mode kMode>
__device__ __forceinline__ void quantize_tile(const float (&v)[kBlock], uint32_t column_mag,
                                              const GlobalScales& g, int64_t b, int64_t m0,
                                              int64_t c, int64_t nrows, const Params& p,
                                              Seed seed) {
  const int64_t rows = p.rows, cols = p.cols, row0 = b * rows + m0;
  const QuantizeOutputs& o = p.o;
  const float bamax = amax_from_bits(group16_max(column_mag));
  uint8_t code[kBlock];
  if constexpr (kMode == Mode::kFourOverSix) {
    Candidate row, col;
    tile(v, bamax, g, p.spec.four_over_six(), row, col);
    if (o.data) {
#pragma unroll
      for (int r = 0; r < kBlock; ++r)
        store_row(quantize_value(v[r], row.enc), row.scale, row0 + r, c, cols, r < nrows, o);
    }
    if (o.data_t) {
#pragma unroll
      for (int r = 0; r < kBlock; ++r) code[r] = quantize_value(v[r], col.enc);
      store_column(code, col.scale, b, m0, c, rows, cols, o);
    }
    return;
  }
  // Stochastic words are drawn from the rowwise stream. The reference indexes
  // the padded [B, Mp, Np] tile array: row stride Mp = M padded to 16.
  const uint8_t s = block_scale(bamax, g);
  const float enc = block_encode_scale(s, g);
  const uint32_t rows_padded = uint32_t(p.stripes * kBlock);
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    uint32_t word = 0;
    if constexpr (kMode == Mode::kStochastic)
      word = random_word(
          seed, (uint32_t(b) * rows_padded + uint32_t(m0 + r)) * uint32_t(cols) + uint32_t(c), 0);
    code[r] = encode<kMode>(v[r], enc, word);
  }
  if (o.data) {
#pragma unroll
    for (int r = 0; r < kBlock; ++r) store_row(code[r], s, row0 + r, c, cols, r < nrows, o);
  }
  if (o.data_t) store_column(code, s, b, m0, c, rows, cols, o);
}

template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_stripe(const typename L::T* x, const Params& p) {
  const int64_t rows = p.rows, cols = p.cols;
  const QuantizeOutputs& o = p.o;
  const int64_t tile = blockIdx.x % p.tiles, stripe = (blockIdx.x / p.tiles) % p.stripes;
  const int64_t b = blockIdx.x / (p.tiles * p.stripes);
  const int64_t c = tile * kTile + threadIdx.x, m0 = stripe * kBlock;
  const int64_t nrows = min(int64_t(kBlock), rows - m0);
  const GlobalScales g = p.spec.row_scaled ? GlobalScales{} : p.spec.global_scales(p.amax[b]);
  Seed seed{0, 0};
  if constexpr (kMode == Mode::kStochastic) seed = Seed{p.seed[0], p.seed[1]};

  // The thread's column of the stripe, zero-padded, as the reference pads.
  float v[kBlock];
  uint32_t column_mag = 0;
  const typename L::T* xc = x + (b * rows + m0) * cols + c;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    v[r] = (r < nrows && c < cols) ? L::load(xc[r * cols]) : 0.0f;
    column_mag = max(column_mag, magnitude_bits(v[r]));
  }
  if (p.spec.block_2d) {
    quantize_tile<kMode>(v, column_mag, g, b, m0, c, nrows, p, seed);
    return;
  }
  const int64_t row0 = b * rows + m0;  // first output row of the stripe
  // Random word indices (uint32, wrapping): rowwise element (b, m, n) is
  // (b M + m) N + n, stream 0; columnwise element (b, n, m) is (b N + n) M + m, stream 1.
  const uint32_t ucols = uint32_t(cols), ub = uint32_t(b);
  if (o.data) {
    // 1x16 rowwise: each row's block spans the 16 lanes of a group.
#pragma unroll
    for (int r = 0; r < kBlock; ++r) {
      const GlobalScales g_r =
          p.spec.row_scaled ? p.spec.global_scales(r < nrows ? p.amax[row0 + r] : 0.0f) : g;
      const float bamax = amax_from_bits(group16_max(magnitude_bits(v[r])));
      uint8_t s, code;
      if constexpr (kMode == Mode::kFourOverSix) {
        const Candidate chosen = row_chunk(v[r], bamax, g_r, p.spec.four_over_six());
        s = chosen.scale;
        code = quantize_value(v[r], chosen.enc);
      } else {
        s = block_scale(bamax, g_r);
        uint32_t word = 0;
        if constexpr (kMode == Mode::kStochastic)
          word = random_word(seed, uint32_t(row0 + r) * ucols + uint32_t(c), 0);
        code = encode<kMode>(v[r], block_encode_scale(s, g_r), word);
      }
      store_row(code, s, row0 + r, c, cols, r < nrows, o);
    }
  }
  if (o.data_t) {
    // 1x16 columnwise: the thread's own 16 values are the block, or with rht
    // their transform (M % 16 == 0, so all 16 rows are real), in registers.
    if (p.spec.columnwise_rht()) {
      rht16_narrow<L>(v);
      column_mag = 0;
#pragma unroll
      for (int r = 0; r < kBlock; ++r) column_mag = max(column_mag, magnitude_bits(v[r]));
    }
    const float amax_t =
        p.spec.row_scaled ? (c < cols ? p.amax_t[b * cols + c] : 0.0f) : p.amax_t[b];
    const GlobalScales g_t = p.spec.global_scales(amax_t);
    uint8_t s;
    float enc;
    if constexpr (kMode == Mode::kFourOverSix) {
      const Candidate chosen =
          column_chunk(v, amax_from_bits(column_mag), g_t, p.spec.four_over_six());
      s = chosen.scale;
      enc = chosen.enc;
    } else {
      s = block_scale(amax_from_bits(column_mag), g_t);
      enc = block_encode_scale(s, g_t);
    }
    uint32_t word[kBlock];
    if constexpr (kMode == Mode::kStochastic)
      random_words16(seed, (ub * ucols + uint32_t(c)) * uint32_t(rows) + uint32_t(m0), 1, word);
    uint8_t code[kBlock];
#pragma unroll
    for (int r = 0; r < kBlock; ++r)
      code[r] = encode<kMode>(v[r], enc, kMode == Mode::kStochastic ? word[r] : 0u);
    store_column(code, s, b, m0, c, rows, cols, o);
  }
}

template <typename L, Mode kMode>
__global__ void __launch_bounds__(kTile) quantize_kernel(const typename L::T* x, Params p) {
  quantize_stripe<L, kMode>(x, p);
}

// 4over6 keeps two candidates per block live: at least one block per SM lets
// ptxas use the registers it needs, where its default heuristic spills (f16, sm_90).
template <typename L>
__global__ void __launch_bounds__(kTile, 1)
    quantize_4over6_kernel(const typename L::T* x, Params p) {
  quantize_stripe<L, Mode::kFourOverSix>(x, p);
}

ffi::Error quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                         ffi::Buffer<ffi::F32> amax_t, ffi::Buffer<ffi::U32> seed,
                         ffi::RemainingRets outs, QuantizeSpec spec) {
  int64_t batch = 0, rows = 0, cols = 0;
  QuantizeOutputs o;
  if (auto e = check_quantize(x, amax, amax_t, seed, outs, spec, batch, rows, cols, o); e.failure())
    return e;
  const int64_t stripes = num_blocks(rows), tiles = (cols + kTile - 1) / kTile;
  const int64_t blocks = batch * stripes * tiles;
  if (blocks > INT32_MAX) return invalid("quantize input is too large for one launch");
  const Params p{amax.typed_data(),
                 amax_t.typed_data(),
                 seed.typed_data(),
                 rows,
                 cols,
                 stripes,
                 tiles,
                 spec,
                 o};
  ffi::Error launched = ffi::Error::Success();
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    if (blocks <= 0) return;
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    if (spec.stochastic_rounding)
      launched = launch<quantize_kernel<L, Mode::kStochastic>>("quantize", unsigned(blocks), kTile,
                                                               0, stream, data, p);
    else if (spec.four_over_six().on())
      launched = launch<quantize_4over6_kernel<L>>("quantize", unsigned(blocks), kTile, 0, stream,
                                                   data, p);
    else
      launched = launch<quantize_kernel<L, Mode::kNearest>>("quantize", unsigned(blocks), kTile, 0,
                                                            stream, data, p);
  });
  if (!ok) return invalid("quantize input must be bfloat16, float16 or float32");
  return launched;
}

}  // namespace
}  // namespace nvfp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCuda, nvfp4::cuda::quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<nvfp4::cuda::StreamContext>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingRets()
                                  .Attrs<nvfp4::QuantizeSpec>());
