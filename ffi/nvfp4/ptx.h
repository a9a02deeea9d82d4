// Inline PTX of sm-specific instructions, and their exact portable equivalents.
//
// NVFP4_SM100_PTX is the one switch: defined where nvcc compiles for sm_100a/sm_120a, whose FP4
// convert the functions here use; elsewhere each function computes the instruction's documented
// result in portable code. The CUDA host model (NVFP4_CUDA_HOST) runs the sm_100a code paths
// through these equivalents when it emulates such a GPU (nvfp4::host::set_emulated_sm), so the
// code around each instruction is tested on the CPU too; tests/cuda/test_cuda_host_model.py checks
// the equivalents against the semantics the CUDA documentation gives the instructions.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDA_ARCH__) && \
    (defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL))
#define NVFP4_SM100_PTX 1
#endif

#if defined(__CUDACC__)
#define NVFP4_PTX_HD __host__ __device__ __forceinline__
#else
#define NVFP4_PTX_HD inline
#endif

#if defined(NVFP4_SM100_PTX)
#define NVFP4_HAS_FP4_CVT() true
#elif defined(NVFP4_CUDA_HOST)
#include <atomic>
namespace nvfp4::host {
// The GPU the host model stands for (90, 100, 120). Inline: the kernels ask per element
// (float_to_e2m1), and a call into another translation unit each time cost the exhaustive table
// check about a tenth.
inline std::atomic<int> emulated_sm_value{90};
inline int emulated_sm() { return emulated_sm_value.load(std::memory_order_relaxed); }
// 2^15 (a + 1) rounded toward zero to float, for a >= 0 (a product's magnitude): one FFMA.RZ on
// the GPU. The host sums in double, exactly unless one term is below half a double ulp of the
// other (a >= 2^38, or a below 2^-38), where the float result is the larger term's alone (the
// smaller is below half its float ulp, so no rounding can reach the next float), then rounds
// the double toward zero.
NVFP4_PTX_HD float rz_2_15_a_plus_1(float a) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rz(a, 32768.0f, 32768.0f);
#else
  const double s = double(a) * 32768.0 + 32768.0;
  const float f = float(s);
  return double(f) > s ? __builtin_nextafterf(f, 0.0f) : f;
#endif
}

// max.u16x2 and min.u16x2 (sm_90+): the unsigned maximum or minimum of each 16-bit half.
NVFP4_PTX_HD uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | std::max(a >> 16, b >> 16) << 16;
#endif
}
NVFP4_PTX_HD uint32_t min_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("min.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return std::min(a & 0xFFFFu, b & 0xFFFFu) | std::min(a >> 16, b >> 16) << 16;
#endif
}

}  // namespace nvfp4::host
#define NVFP4_HAS_FP4_CVT() (::nvfp4::host::emulated_sm() >= 100)
#else
#define NVFP4_HAS_FP4_CVT() false
#endif

namespace nvfp4 {

// E2M1 code of x as cvt.rn.satfinite converts it (cuda_fp4.h's documented semantics): round to
// nearest even; magnitudes above 6 (inf too) saturate to 6 with their sign; NaN gives +6 (0x7);
// the sign bit is kept otherwise (-0.0 and negative values that round to zero give 0x8).
NVFP4_PTX_HD uint8_t e2m1_rn_satfinite(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7;
  float a;
  __builtin_memcpy(&a, &mag, sizeof(a));
  // The grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; a midpoint goes to the even code.
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                   (a >= 3.5f) + (a > 5.0f);
  return uint8_t(code | ((u >> 31) << 3));
}

// cvt.rn.satfinite.e2m1x2.f32 d, hi, lo: the byte (E2M1(hi) << 4) | E2M1(lo).
NVFP4_PTX_HD uint8_t cvt_rn_satfinite_e2m1x2(float hi, float lo) {
#if defined(NVFP4_SM100_PTX)
  uint32_t packed;
  asm("{\n.reg .b8 b;\ncvt.rn.satfinite.e2m1x2.f32 b, %1, %2;\ncvt.u32.u8 %0, b;\n}"
      : "=r"(packed)
      : "f"(hi), "f"(lo));
  return uint8_t(packed & 0xFF);
#else
  return uint8_t((e2m1_rn_satfinite(hi) << 4) | e2m1_rn_satfinite(lo));
#endif
}

// ---- Hopper-and-later instructions of the quantize kernels (sm_89+: every target we build) ----

// __byte_perm(a, b, sel): byte k of the result is byte (sel >> 4k) & 7 of the 8 bytes b:a.
NVFP4_PTX_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t bytes = (uint64_t(b) << 32) | a;
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k)
    out |= uint32_t((bytes >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k);
  return out;
#endif
}

// prmt.b32 d, a, b, sel in its default mode: byte_perm, but where bit 3 of a selector nibble is
// set, the selected byte's sign bit replicated over the result byte (0x00 or 0xFF).
NVFP4_PTX_HD uint32_t prmt_b32(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t bytes = (uint64_t(b) << 32) | a;
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t s = (sel >> (4 * k)) & 0xFu, byte = uint32_t(bytes >> (8 * (s & 7))) & 0xFFu;
    out |= (s & 8u ? (byte & 0x80u ? 0xFFu : 0u) : byte) << (8 * k);
  }
  return out;
#endif
}

// float16 bits of x rounded toward zero (IEEE): a magnitude at or above 65520 becomes the largest
// finite 65504, inf stays inf, a NaN becomes the canonical 0x7FFF with x's sign; float16
// subnormals are kept.
NVFP4_PTX_HD uint32_t f16_rz_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  const uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7FFFFFFFu, e = mag >> 23;
  if (mag > 0x7F800000u) return sign | 0x7FFFu;
  if (mag == 0x7F800000u) return sign | 0x7C00u;
  if (e >= 127 + 16) return sign | 0x7BFFu;                                     // >= 2^16
  if (e >= 127 - 14) return sign | ((e - 112) << 10) | ((mag >> 13) & 0x3FFu);  // normal
  const uint32_t shift = 126 - e;  // a subnormal's 10 bits: the significand / 2^-24
  return sign | (shift < 32 ? ((mag & 0x7FFFFFu) | 0x800000u) >> shift : 0u);
}

// cvt.rz.f16x2.f32 d, hi, lo: hi's float16 bits in the upper half, lo's in the lower.
NVFP4_PTX_HD uint32_t cvt_rz_f16x2(float hi, float lo) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return (f16_rz_bits(hi) << 16) | f16_rz_bits(lo);
#endif
}

// The larger magnitude of each 16-bit half of two bfloat16x2 (kBf16) or float16x2 words, as
// max.NaN.xorsign.abs does it: a NaN wins; the sign bits are garbage (the caller masks them).
// The portable version takes the integer max of the magnitudes, which orders non-negative
// floats alike and puts every NaN above inf; only a NaN's payload may differ, and callers
// read any NaN as NaN.
template <bool kBf16>
NVFP4_PTX_HD uint32_t max_magnitude_x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  if constexpr (kBf16)
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  const uint32_t lo = std::max(a & 0x7FFFu, b & 0x7FFFu);
  const uint32_t hi = std::max((a >> 16) & 0x7FFFu, (b >> 16) & 0x7FFFu);
  return lo | (hi << 16);
#endif
}

// v, which the compiler may no longer see through: a value computed once stays computed once
// (nvcc otherwise sinks a per-block quotient into the per-element select that uses it, one
// correctly rounded division per element instead of two per block). No instruction is emitted.
NVFP4_PTX_HD float opaque(float v) {
#if defined(__CUDA_ARCH__)
  asm("" : "+f"(v));
#endif
  return v;
}

// x * y + z rounded once (the FFMA instruction; std::fma on the host).
NVFP4_PTX_HD float fma_rn(float x, float y, float z) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(x, y, z);
#else
  return __builtin_fmaf(x, y, z);
#endif
}

// 2^15 (a + 1) rounded toward zero to float, for a >= 0 (a product's magnitude): one FFMA.RZ on
// the GPU. The host sums in double, exactly unless one term is below half a double ulp of the
// other (a >= 2^38, or a below 2^-38), where the float result is the larger term's alone (the
// smaller is below half its float ulp, so no rounding can reach the next float), then rounds
// the double toward zero.
NVFP4_PTX_HD float rz_2_15_a_plus_1(float a) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rz(a, 32768.0f, 32768.0f);
#else
  const double s = double(a) * 32768.0 + 32768.0;
  const float f = float(s);
  return double(f) > s ? __builtin_nextafterf(f, 0.0f) : f;
#endif
}

// max.u16x2 and min.u16x2 (sm_90+): the unsigned maximum or minimum of each 16-bit half.
NVFP4_PTX_HD uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | std::max(a >> 16, b >> 16) << 16;
#endif
}
NVFP4_PTX_HD uint32_t min_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("min.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return std::min(a & 0xFFFFu, b & 0xFFFFu) | std::min(a >> 16, b >> 16) << 16;
#endif
}

}  // namespace nvfp4
