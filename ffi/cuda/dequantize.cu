// NVFP4 dequantization on the GPU: value = fp32(E2M1 * E4M3 scale) * amax / (6 E),
// E the spec's block-scale range, with one amax per batch entry or per row, written
// as float32, bfloat16 or float16; bit-identical to the CPU kernel.
//
// Rows of whole 16-value blocks (N % 16 == 0, the usual case) take a thread per block: one
// 8-byte load of its codes, one of its scale, and 16-byte stores of its values. The codes decode
// two at a time with integer ops and float16 converts (e2m1x2_f16x2), the values round to a
// 16-bit dtype two at a time. A block whose values could be NaN (a NaN scale, a NaN or infinite
// global scale) takes the reference path. Other shapes take a thread per packed byte.
#include "cuda/common.cuh"
#include "cuda/handlers.h"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // blocks a thread loads before it decodes them (loads in flight)

// The E2M1 codes of byte k of w (the low nibble, the high nibble) as float16 bits of
// e2m1 * 2^-14, in the low and the high half: a code's 3 magnitude bits become exponent and
// mantissa bits 11-9 (codes 0 and 1 the float16 subnormals 0 and 2^-15, which keeps it a
// shift), its sign bit 15. Each multiply places both nibbles, 12 bits apart, without carries.
NVFP4_HD uint32_t e2m1x2_f16x2(uint32_t w, int k) {
  const uint32_t x = byte_perm(w, 0, 0x4440u + uint32_t(k));  // byte k alone
  const uint32_t magnitudes = x * ((1u << 9) | (1u << 21));   // bits 0-2, 4-6 -> 9-11, 25-27
  const uint32_t signs = x * ((1u << 12) | (1u << 24));       // bits 3, 7 -> 15, 31
  return (magnitudes & 0x0E000E00u) | (signs & 0x80008000u);
}

// 32-bit words of a block's 16 values in output dtype S.
template <typename S>
constexpr int kBlockWords = kBlock * int(sizeof(typename S::T)) / 4;

// The 16 values of one block (its 8 code bytes, its scale code, the global decode scale) as
// words of the output dtype.
template <typename S>
__device__ __forceinline__ void dequantize_block(uint2 codes, uint8_t scale, float gds,
                                                 uint32_t (&out)[kBlockWords<S>]) {
  const float s = e4m3_to_float(scale);
  const bool nan_free = s == s && fabsf(gds) < INFINITY;  // no product is NaN (no 0 * inf)
#if defined(NVFP4_SASS_BUDGET)
  __builtin_assume(nan_free);  // the steady state
#endif
  // Values 2k and 2k + 1 into out; `paired`: neither is NaN (one paired convert).
  const auto put = [&](int k, float lo, float hi, bool paired) {
    if constexpr (sizeof(typename S::T) == 4) {
      out[2 * k] = float_bits(lo);
      out[2 * k + 1] = float_bits(hi);
    } else {
      out[k] = paired ? store2<S>(hi, lo) : uint32_t(S::store(hi)) << 16 | S::store(lo);
    }
  };
  if (nan_free) {
    // e2m1 * 2^-14 times s * 2^14 (exact) is e2m1 * s exactly, as the reference's product.
    const float s14 = s * 16384.0f;
#pragma unroll
    for (int k = 0; k < kBlock / 2; ++k) {
      const uint32_t h = e2m1x2_f16x2(k < 4 ? codes.x : codes.y, k % 4);
      put(k, (f16_to_float(uint16_t(h)) * s14) * gds, (f16_to_float(uint16_t(h >> 16)) * s14) * gds,
          true);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kBlock / 2; ++k) {
      const uint32_t byte = ((k < 4 ? codes.x : codes.y) >> (8 * (k % 4))) & 0xFFu;
      put(k, dequantize_value(uint8_t(byte & 0xF), scale, gds),
          dequantize_value(uint8_t(byte >> 4), scale, gds), false);
    }
  }
}

// N % 16 == 0: thread t of the grid takes blocks t, t + stride, ... of the [B M, N / 16] blocks
// (fewer than 2^31), kUnroll at a time; block i's global scale is that of amax[i / per_amax].
// (Each kernel's body is a device function that benchmarks/sass_budget.py also builds.)
template <typename S>
__device__ __forceinline__ void dequantize_blocks(const uint2* __restrict__ data,
                                                  const uint8_t* __restrict__ scale,
                                                  const float* __restrict__ amax, uint32_t blocks,
                                                  uint32_t per_amax, DequantizeSpec spec,
                                                  typename S::T* __restrict__ out) {
  const bool one_amax = per_amax >= blocks;
#if defined(NVFP4_SASS_BUDGET)
  __builtin_assume(one_amax);  // the common case: one amax
#endif
  const uint32_t stride = gridDim.x * kThreads;
  uint32_t gds_of = 0;  // the amax entry whose global scale gds is
  float gds = spec.global_decode_scale(amax[0]);
  // Rolled: each iteration already has kUnroll loads in flight (and the budget counts one).
#pragma unroll 1
  for (uint32_t i0 = blockIdx.x * kThreads + threadIdx.x; i0 < blocks; i0 += kUnroll * stride) {
    uint2 codes[kUnroll];
    uint8_t scales[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * stride;
      codes[u] = i < blocks ? data[i] : uint2{0, 0};
      scales[u] = i < blocks ? scale[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * stride;
      if (i >= blocks) break;
      if (!one_amax && i / per_amax != gds_of) {
        gds_of = i / per_amax;
        gds = spec.global_decode_scale(amax[gds_of]);
      }
      uint32_t words[kBlockWords<S>];
      dequantize_block<S>(codes[u], scales[u], gds, words);
      uint4* dst = reinterpret_cast<uint4*>(out + uint64_t(i) * kBlock);
#pragma unroll
      for (int q = 0; q < kBlockWords<S> / 4; ++q)
        dst[q] = uint4{words[4 * q], words[4 * q + 1], words[4 * q + 2], words[4 * q + 3]};
    }
  }
}

// Any shape: one packed byte (two values) per iteration of a grid-stride loop.
template <typename S>
__device__ __forceinline__ void dequantize_bytes(const uint8_t* data, const uint8_t* scale,
                                                 const float* amax, int64_t rows, int64_t cols,
                                                 int64_t bytes, bool per_row, DequantizeSpec spec,
                                                 typename S::T* out) {
  const int64_t data_cols = packed_size(cols), scale_cols = num_blocks(cols);
#pragma unroll 1  // one byte an iteration (as the budget counts it)
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < bytes;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i / data_cols, c = 2 * (i % data_cols);  // row spans the batch
    const float gds = spec.global_decode_scale(amax[per_row ? row : row / rows]);
    const uint8_t s = scale[row * scale_cols + c / kBlock];  // c and c + 1 share a block
    out[row * cols + c] = S::store(dequantize_value(data[i] & 0xF, s, gds));
    if (c + 1 < cols) out[row * cols + c + 1] = S::store(dequantize_value(data[i] >> 4, s, gds));
  }
}

template <typename S>
__global__ void __launch_bounds__(kThreads)
    dequantize_blocks_kernel(const uint2* data, const uint8_t* scale, const float* amax,
                             uint32_t blocks, uint32_t per_amax, DequantizeSpec spec,
                             typename S::T* out) {
  dequantize_blocks<S>(data, scale, amax, blocks, per_amax, spec, out);
}
template <typename S>
__global__ void __launch_bounds__(kThreads)
    dequantize_bytes_kernel(const uint8_t* data, const uint8_t* scale, const float* amax,
                            int64_t rows, int64_t cols, int64_t bytes, bool per_row,
                            DequantizeSpec spec, typename S::T* out) {
  dequantize_bytes<S>(data, scale, amax, rows, cols, bytes, per_row, spec, out);
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
  if (bytes <= 0) return ffi::Error::Success();
  const int64_t blocks = batch * rows * num_blocks(cols);
  const auto* codes = data.typed_data();
  const auto* scales = static_cast<const uint8_t*>(scale.untyped_data());
  ffi::Error launched = ffi::Error::Success();
  const bool ok =
      dispatch_float<StoreF32, StoreBF16, StoreF16>(out->element_type(), [&](auto storer) {
        using S = decltype(storer);
        auto* values = static_cast<typename S::T*>(out->untyped_data());
        if (cols % kBlock == 0 && blocks < (int64_t(1) << 31)) {
          constexpr auto kKernel = dequantize_blocks_kernel<S>;
          const int64_t per_amax = (per_row ? 1 : rows) * num_blocks(cols);
          const unsigned grid = unsigned(std::min<int64_t>((blocks + kThreads - 1) / kThreads,
                                                           resident_blocks(kKernel, kThreads, 0)));
          launched = launch<kKernel>("dequantize", grid, kThreads, 0, stream,
                                     reinterpret_cast<const uint2*>(codes), scales,
                                     amax.typed_data(), uint32_t(blocks),
                                     uint32_t(std::min<int64_t>(per_amax, blocks)), spec, values);
        } else {
          launched = launch<dequantize_bytes_kernel<S>>(
              "dequantize", grid_stride_blocks(bytes, kThreads), kThreads, 0, stream, codes, scales,
              amax.typed_data(), rows, cols, bytes, per_row, spec, values);
        }
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
