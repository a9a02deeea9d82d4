// NVFP4 quantization on the GPU, bit-identical to the CPU kernel: one pass over
// the input produces the rowwise and/or columnwise copy with 1x16 or 16x16
// blocks. A CUDA block owns a 16-row stripe x 128 columns; each thread holds
// one column of the stripe (16 values) in registers, so the columnwise block is
// thread-local and the rowwise blocks (16 consecutive columns) are 16 lanes of
// a warp, reduced with shuffles. Every input value is read once.
#include "cuda/common.cuh"
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

template <typename L>
__global__ void __launch_bounds__(kTile)
    quantize_kernel(const typename L::T* x, const float* amax, int64_t rows, int64_t cols,
                    int64_t stripes, int64_t tiles, bool block_2d, QuantizeOutputs o) {
  const int64_t tile = blockIdx.x % tiles, stripe = (blockIdx.x / tiles) % stripes;
  const int64_t b = blockIdx.x / (tiles * stripes);
  const int64_t c = tile * kTile + threadIdx.x, m0 = stripe * kBlock;
  const int64_t nrows = min(int64_t(kBlock), rows - m0);
  const GlobalScales g = global_scales(amax[b]);

  // The thread's column of the stripe, zero-padded, as the reference pads.
  float v[kBlock];
  uint32_t column_mag = 0;
  const typename L::T* xc = x + (b * rows + m0) * cols + c;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    v[r] = (r < nrows && c < cols) ? L::load(xc[r * cols]) : 0.0f;
    column_mag = max(column_mag, magnitude_bits(v[r]));
  }
  uint8_t code[kBlock];
  const int64_t row0 = b * rows + m0;  // first output row of the stripe

  if (block_2d) {
    // One scale for the 16x16 block, shared by both copies.
    const uint8_t s = block_scale(amax_from_bits(group16_max(column_mag)), g);
    const float enc = block_encode_scale(s, g);
#pragma unroll
    for (int r = 0; r < kBlock; ++r) code[r] = quantize_value(v[r], enc);
    if (o.data) {
#pragma unroll
      for (int r = 0; r < kBlock; ++r) store_row(code[r], s, row0 + r, c, cols, r < nrows, o);
    }
    if (o.data_t) store_column(code, s, b, m0, c, rows, cols, o);
    return;
  }
  if (o.data) {
    // 1x16 rowwise: each row's block spans the 16 lanes of a group.
#pragma unroll
    for (int r = 0; r < kBlock; ++r) {
      const uint8_t s = block_scale(amax_from_bits(group16_max(magnitude_bits(v[r]))), g);
      store_row(quantize_value(v[r], block_encode_scale(s, g)), s, row0 + r, c, cols, r < nrows, o);
    }
  }
  if (o.data_t) {
    // 1x16 columnwise: the thread's own 16 values are the block.
    const uint8_t s = block_scale(amax_from_bits(column_mag), g);
    const float enc = block_encode_scale(s, g);
#pragma unroll
    for (int r = 0; r < kBlock; ++r) code[r] = quantize_value(v[r], enc);
    store_column(code, s, b, m0, c, rows, cols, o);
  }
}

ffi::Error quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                         ffi::RemainingRets outs, bool rowwise, bool columnwise, bool block_2d) {
  int64_t batch, rows, cols;
  QuantizeOutputs o;
  if (auto e = check_quantize(x, amax, outs, rowwise, columnwise, batch, rows, cols, o);
      e.failure())
    return e;
  const int64_t stripes = num_blocks(rows), tiles = (cols + kTile - 1) / kTile;
  const int64_t blocks = batch * stripes * tiles;
  if (blocks > INT32_MAX) return invalid("quantize input is too large for one launch");
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    if (blocks > 0)
      quantize_kernel<L><<<unsigned(blocks), kTile, 0, stream>>>(
          static_cast<const typename L::T*>(x.untyped_data()), amax.typed_data(), rows, cols,
          stripes, tiles, block_2d, o);
  });
  if (!ok) return invalid("quantize input must be bfloat16, float16 or float32");
  return launch_status("quantize");
}

}  // namespace
}  // namespace nvfp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCuda, nvfp4::cuda::quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("columnwise")
                                  .Attr<bool>("block_2d"));
