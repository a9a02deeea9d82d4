// NVFP4 dequantization on the GPU: value = fp32(E2M1 * E4M3 scale) * amax / (6 E),
// E the spec's block-scale range, with one amax per batch entry or per row, written
// as float32, bfloat16 or float16; bit-identical to the CPU kernel.
//
// Rows of whole 16-value blocks (N % 16 == 0, the usual case) take a thread per piece: the values
// of one 16-byte store (8 of a 16-bit dtype, 4 of float32), so that a warp's stores fill 512
// consecutive bytes, whole sectors (a thread per block stored 32 or 64 bytes a lane, each 16-byte
// store touching half sectors: twice the sectors). A piece's codes are one 4- or 2-byte load, its
// block's scale one byte that the block's pieces share. The codes decode two at a time with
// integer ops and float16 converts (e2m1x2_f16x2), the values round to a 16-bit dtype two at a
// time. A block whose values could be NaN (a NaN scale, a NaN or infinite global scale) takes the
// reference path. Other shapes take a thread per packed byte. Global accesses go through
// cuda/memory.cuh, which the host model's profiler counts.
// No ring of bulk copies as quantize has: reads are a fifth of the bytes (0.56 a value against 2
// written for bfloat16), and each thread issues kUnroll pieces' loads before it decodes any.
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/handlers.h"
#include "cuda/memory.cuh"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;  // pieces a thread loads before it decodes them (loads in flight)

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

// A piece of output dtype S: the values of one 16-byte store, their codes' bytes and type, and
// the pieces of a 16-value block.
template <typename S>
constexpr int kPieceValues = 16 / int(sizeof(typename S::T));
template <typename S>
constexpr int kPiecesPerBlock = kBlock / kPieceValues<S>;
template <typename S>
using PieceCodes = std::conditional_t<kPieceValues<S> == 8, uint32_t, uint16_t>;

// An E4M3 scale code's value times 2^14 by bit placement: its sign and 7 magnitude bits as a
// float16's sign, exponent and top mantissa bits are its value times 2^-8 (E4M3's subnormals
// float16's), times 2^22 exactly. The NaN codes (magnitude 0x7F) are not NaN here: the caller
// tests them.
__device__ __forceinline__ float scale_times_2_14(uint32_t code) {
  const uint32_t h = ((code << 8) & 0x8000u) | ((code << 7) & 0x3F80u);
  return f16_to_float(uint16_t(h)) * 0x1p22f;
}

// The values of one piece (its code bytes, its block's scale code, the global decode scale) as
// the 4 words of its 16-byte store.
template <typename S>
__device__ __forceinline__ uint4 dequantize_piece(uint32_t codes, uint8_t scale, float gds) {
  // No product is NaN: no NaN scale, no 0 * inf.
  const bool nan_free = (scale & 0x7Fu) != 0x7Fu && fabsf(gds) < INFINITY;
#if defined(NVFP4_SASS_BUDGET)
  __builtin_assume(nan_free);  // the steady state
#endif
  uint32_t out[4];
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
    const float s14 = scale_times_2_14(scale);
#pragma unroll
    for (int k = 0; k < kPieceValues<S> / 2; ++k) {
      const uint32_t h = e2m1x2_f16x2(codes, k);
      put(k, (f16_to_float(uint16_t(h)) * s14) * gds, (f16_to_float(uint16_t(h >> 16)) * s14) * gds,
          true);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPieceValues<S> / 2; ++k) {
      const uint32_t byte = (codes >> (8 * k)) & 0xFFu;
      put(k, dequantize_value(uint8_t(byte & 0xF), scale, gds),
          dequantize_value(uint8_t(byte >> 4), scale, gds), false);
    }
  }
  return uint4{out[0], out[1], out[2], out[3]};
}

// N % 16 == 0: thread t of the grid takes pieces t, t + stride, ... of the [B M, N / 16] blocks'
// pieces (fewer than 2^31), kUnroll at a time; piece i's global scale is that of
// amax[i / per_amax] (per_amax: pieces an amax covers).
// (Each kernel's body is a device function that benchmarks/sass_budget.py also builds.)
template <typename S>
__device__ __forceinline__ void dequantize_pieces(const PieceCodes<S>* __restrict__ data,
                                                  const uint8_t* __restrict__ scale,
                                                  const float* __restrict__ amax, uint32_t pieces,
                                                  uint32_t per_amax, DequantizeSpec spec,
                                                  typename S::T* __restrict__ out) {
  const bool one_amax = per_amax >= pieces;
#if defined(NVFP4_SASS_BUDGET)
  __builtin_assume(one_amax);  // the common case: one amax
#endif
  const uint32_t stride = gridDim.x * kThreads;
  uint32_t gds_of = 0;  // the amax entry whose global scale gds is
  // (A broadcast read of one float a thread: not traced.)
  float gds = spec.global_decode_scale(amax[0]);
  uint4* const values = reinterpret_cast<uint4*>(out);
  // Rolled: each iteration already has kUnroll loads in flight (and the budget counts one).
#pragma unroll 1
  for (uint32_t i0 = blockIdx.x * kThreads + threadIdx.x; i0 < pieces; i0 += kUnroll * stride) {
    PieceCodes<S> codes[kUnroll];
    uint8_t scales[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * stride;
      codes[u] = NVFP4_LDG_IF(i < pieces, data + i, PieceCodes<S>(0));
      scales[u] = NVFP4_LDG_IF(i < pieces, scale + i / kPiecesPerBlock<S>, uint8_t(0));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = i0 + u * stride;
      if (i >= pieces) break;
      if (!one_amax && i / per_amax != gds_of) {
        gds_of = i / per_amax;
        gds = spec.global_decode_scale(amax[gds_of]);
      }
      NVFP4_STG(values + i, dequantize_piece<S>(codes[u], scales[u], gds));
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
    dequantize_pieces_kernel(const PieceCodes<S>* data, const uint8_t* scale, const float* amax,
                             uint32_t pieces, uint32_t per_amax, DequantizeSpec spec,
                             typename S::T* out) {
  dequantize_pieces<S>(data, scale, amax, pieces, per_amax, spec, out);
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
        const int64_t pieces = blocks * kPiecesPerBlock<S>;
        if (cols % kBlock == 0 && pieces < (int64_t(1) << 31)) {
          constexpr auto kKernel = dequantize_pieces_kernel<S>;
          const int64_t per_amax = (per_row ? 1 : rows) * num_blocks(cols) * kPiecesPerBlock<S>;
          const unsigned grid = unsigned(std::min<int64_t>((pieces + kThreads - 1) / kThreads,
                                                           resident_blocks(kKernel, kThreads, 0)));
          launched = launch<kKernel>("dequantize", grid, kThreads, 0, stream,
                                     reinterpret_cast<const PieceCodes<S>*>(codes), scales,
                                     amax.typed_data(), uint32_t(pieces),
                                     uint32_t(std::min<int64_t>(per_amax, pieces)), spec, values);
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
