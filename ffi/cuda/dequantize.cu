// NVFP4 dequantization on the GPU: value = fp32(E2M1 * E4M3 scale) * amax / (6 E),
// E the spec's block-scale range, with one amax per batch entry or per row, written
// as float32, bfloat16 or float16; bit-identical to the CPU kernel.
#include "cuda/common.cuh"
#include "cuda/handlers.h"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 256;

// One packed byte (two values) per iteration of a grid-stride loop.
template <typename S>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* data, const uint8_t* scale, const float* amax, int64_t rows,
                      int64_t cols, int64_t bytes, bool per_row, DequantizeSpec spec,
                      typename S::T* out) {
  const int64_t data_cols = packed_size(cols), scale_cols = num_blocks(cols);
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < bytes;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i / data_cols, c = 2 * (i % data_cols);  // row spans the batch
    const float gds = spec.global_decode_scale(amax[per_row ? row : row / rows]);
    const uint8_t s = scale[row * scale_cols + c / kBlock];  // c and c + 1 share a block
    out[row * cols + c] = S::store(dequantize_value(data[i] & 0xF, s, gds));
    if (c + 1 < cols) out[row * cols + c + 1] = S::store(dequantize_value(data[i] >> 4, s, gds));
  }
}

ffi::Error dequantize_impl(cudaStream_t stream, ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale,
                           ffi::Buffer<ffi::F32> amax, ffi::Result<ffi::AnyBuffer> out,
                           DequantizeSpec spec) {
  int64_t batch = 0, rows = 0, cols = 0;
  bool per_row = false;
  if (auto e = check_dequantize(data, scale, amax, *out, spec, batch, rows, cols, per_row);
      e.failure())
    return e;
  const int64_t bytes = batch * rows * packed_size(cols);
  ffi::Error launched = ffi::Error::Success();
  const bool ok =
      dispatch_float<StoreF32, StoreBF16, StoreF16>(out->element_type(), [&](auto storer) {
        using S = decltype(storer);
        if (bytes > 0)
          launched = launch<dequantize_kernel<S>>(
              "dequantize", grid_stride_blocks(bytes, kThreads), kThreads, 0, stream,
              data.typed_data(), static_cast<const uint8_t*>(scale.untyped_data()),
              amax.typed_data(), rows, cols, bytes, per_row, spec,
              static_cast<typename S::T*>(out->untyped_data()));
      });
  if (!ok) return invalid("dequantize output must be float32, bfloat16 or float16");
  return launched;
}

}  // namespace
}  // namespace nvfp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4DequantizeCuda, nvfp4::cuda::dequantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<nvfp4::cuda::StreamContext>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attrs<nvfp4::DequantizeSpec>());
