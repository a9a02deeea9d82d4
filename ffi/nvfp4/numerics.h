// NVFP4 numerics shared by the CPU and CUDA kernels: one source of truth.
//
// Every function is the exact IEEE float32 computation written in
// tests/golden/README.md (TransformerEngine's reference quantizer). The pure-JAX
// spec in jax_nvfp4/reference/ computes the same bits. Callers must run with
// subnormals preserved (no flush-to-zero, no fast-math, no FMA contraction).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "nvfp4/ptx.h"

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__ __forceinline__
#else
#define NVFP4_HD inline
#endif

namespace nvfp4 {

constexpr int kBlock = 16;          // values per block (1x16) or block side (16x16)
constexpr float kE2M1Max = 6.0f;    // largest E2M1 magnitude
constexpr float kE4M3Max = 448.0f;  // largest E4M3 magnitude
constexpr float kFloatMax = 3.40282346638528859812e+38f;
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;
constexpr uint8_t kE4M3NaN = 0xFF;  // what the reference writes for a NaN scale

NVFP4_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

NVFP4_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// ---- input / output element conversions (exact, bit-level) ----

NVFP4_HD float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

NVFP4_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  // The convert instruction: exact, subnormals included (a NaN's payload may differ, which no
  // caller reads: products make it canonical, maxima canonicalize it).
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal half: normalize into a float32 normal.
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    return bits_float(sign | (exp << 23) | ((mant & 0x3FFu) << 13));
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (mant << 13));
#endif
}

// float32 -> bfloat16 bits, round to nearest even; NaN -> canonical quiet NaN.
NVFP4_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float16 bits, round to nearest even (subnormals, overflow to inf).
NVFP4_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7E00;
  if (mag >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to inf
  const int exp = int(mag >> 23) - 127;
  if (exp >= -14) {
    const uint32_t r = mag - ((127u - 15u) << 23);
    return sign | uint16_t((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (exp < -25) return sign;  // below half the smallest subnormal
  // Subnormal half: value = sig * 2^(exp-23); quantum 2^-24.
  const uint32_t sig = (mag & 0x7FFFFFu) | 0x800000u;
  const int shift = -exp - 1;  // 14..24
  const uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t up = (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  return sign | uint16_t(q + up);
}

// |x| as ordered integer bits: integer max == float max, and any NaN wins.
NVFP4_HD uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

// Turns a max of magnitude_bits into the amax float, NaN made canonical.
NVFP4_HD float amax_from_bits(uint32_t m) {
  return bits_float(m > 0x7F800000u ? kCanonicalNaN : m);
}

// ---- E4M3 (float8_e4m3fn) ----

// Branch-free (selects only) so that the CPU loops over blocks vectorize.
NVFP4_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xFu;
  const uint32_t mant = c & 0x7u;
  const uint32_t normal = ((exp + 120u) << 23) | (mant << 20);
  const uint32_t subnormal = float_bits(float(mant) * (1.0f / 512.0f));  // exact
  const uint32_t mag = exp == 0 ? subnormal : normal;
  return bits_float(sign | ((c & 0x7Fu) == 0x7Fu ? kCanonicalNaN : mag));
}

NVFP4_HD float round_to_integer(float v) {  // round to nearest even
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::rint(v);
#endif
}

// Round to nearest even E4M3. The caller clamps to [-448, 448] first; NaN -> 0xFF.
NVFP4_HD uint8_t float_to_e4m3(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t mag = u & 0x7FFFFFFFu;
  // Normal E4M3 (|v| >= 2^-6): keep 3 mantissa bits, rebias the exponent.
  const uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal E4M3: code = round(|v| * 2^9), the multiply being exact. Computed for every v
  // (selects, no branch), so only from a subnormal-range input: converting a NaN or an
  // out-of-range float to an integer is undefined behaviour (UBSan's float-cast-overflow).
  const uint32_t subnormal =
      uint32_t(round_to_integer(bits_float(mag < 0x3C800000u ? mag : 0u) * 512.0f));
  const uint32_t code = sign | (mag >= 0x3C800000u ? normal : subnormal);
  return uint8_t(mag > 0x7F800000u ? kE4M3NaN : code);
}

// v clamped to the E4M3 range [-448, 448]; NaN passes through.
NVFP4_HD float clamp_e4m3(float v) {
  v = v > kE4M3Max ? kE4M3Max : v;
  return v < -kE4M3Max ? -kE4M3Max : v;
}

// The E4M3 codes of two block scales as cvt.rn.satfinite.e4m3x2.f32 gives them: (code(hi) << 8)
// | code(lo) in the low 16 bits, rounded to nearest even, clamped to +-448, a NaN as 0x7F
// (fix_nan_scales turns it into the reference's 0xFF). The high 16 bits are zero (the convert's
// result zero-extended, which costs no instruction); callers take bytes 0 and 1 only. The host
// computes it with float_to_e4m3.
NVFP4_HD uint32_t e4m3x2_satfinite(float hi, float lo) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, %1, %2;\ncvt.u32.u16 %0, t;\n}"
      : "=r"(d)
      : "f"(hi), "f"(lo));
  return d;
#else
  const auto code = [](float v) -> uint32_t {
    return v != v ? 0x7Fu : float_to_e4m3(clamp_e4m3(v));
  };
  return (code(hi) << 8) | code(lo);
#endif
}

// Scale codes packed in bytes, none 0xFF: the NaN code 0x7F becomes the reference's 0xFF.
NVFP4_HD uint32_t fix_nan_scales(uint32_t packed) {
  return packed | ((packed + 0x01010101u) & 0x80808080u);
}

// ---- E2M1 ----

NVFP4_HD float e2m1_to_float(uint8_t code) {
  // Bits built arithmetically (no table) so that the loops vectorize.
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t normal = ((e + 126u) << 23) | (m << 22);  // (1 + m/2) * 2^(e-1)
  const uint32_t small = m ? 0x3F000000u : 0u;             // 0.5 or 0
  return bits_float((uint32_t(code & 8u) << 28) | (e ? normal : small));
}

// E2M1 code of a value already scaled into the E2M1 range: clamp to +-6, round
// to nearest even (ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
// 5->4). -0.0 gives code 0, negative values that round to 0 give 8, NaN gives 0
// (every comparison is false): the reference's choices. Branch-free so that
// the CPU loop vectorizes. On sm_100a/sm_120a the hardware convert does it
// (NVFP4_HAS_FP4_CVT, nvfp4/ptx.h; a compile-time false for the CPU kernels).
NVFP4_HD uint8_t float_to_e2m1(float v) {
  if (NVFP4_HAS_FP4_CVT()) {
    // cvt.rn.satfinite rounds to nearest even and clamps +-inf to +-6, like the
    // software path; it keeps the sign of -0.0 and maps NaN to +6, so those two
    // cases are set to the reference's code 0 explicitly.
    const uint8_t code = cvt_rn_satfinite_e2m1x2(v, v) & 0xF;
    return (v == 0.0f || v != v) ? uint8_t(0) : code;
  }
  const float a = fabsf(v);
  const int m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                (a > 5.0f);
  return uint8_t(m | (v < 0.0f ? 8 : 0));
}

// ---- stochastic rounding (jax_nvfp4/reference/stochastic.py is the spec) ----

// 256 times the E2M1 grid position of magnitude bits `mag` (the position: 0 for 0, 2 for 1.0, 7 for
// 6), rounded half up: from 1.0 on the top 9 bits of exponent and mantissa less 252 and 8 more
// mantissa bits; below 1.0 floor(512 |v| + 1/2) = (floor(1024 |v|) + 1) >> 1, 1024 |v| being exact
// and its conversion a truncation. Magnitudes from 6 (inf and NaN too) give at least 7 * 256.
NVFP4_HD uint32_t sr_position(uint32_t mag) {
  const float a = bits_float(mag);
  // (int32 conversion: it vectorizes on x86 without AVX-512.)
  const uint32_t small = (uint32_t(int32_t(a < 1.0f ? a * 1024.0f : 0.0f)) + 1u) >> 1;
  return mag >= 0x3F800000u ? ((mag + 0x2000u) >> 14) - 0xFC00u : small;
}

// E2M1 code of a value already scaled into the E2M1 range, rounded stochastically by a random
// byte: up iff X + rbyte >= 256, X = sr_position's 8 low bits of the step (min((T + rbyte) >> 8,
// 7) in all), so with probability X / 256, X = floor(256 f + 1/2) for the fraction f of the step.
// Magnitudes >= 6 (inf too) give 6; signs, -0.0 and NaN as float_to_e2m1. Branch-free (selects
// only) so that the CPU loops vectorize.
NVFP4_HD uint8_t float_to_e2m1_stochastic(float v, uint32_t rbyte) {
  const uint32_t u = float_bits(v);
  const uint32_t mag = u & 0x7FFFFFFFu;
  uint32_t code = (sr_position(mag) + rbyte) >> 8;
  code = code < 7u ? code : 7u;
  code = (u >> 31) != 0u && mag != 0u ? code | 8u : code;
  return uint8_t(mag > 0x7F800000u ? 0u : code);
}

// ---- random bytes: Philox-4x32-10 (Random123's), one hash per 1x16 block ----

struct Seed {
  uint32_t k0, k1;
};

// Philox-4x32-10 of the counter (c0, c1, c2, c3) under `key`: a round is two 32x32 -> 64
// multiplies and two XORs, the key bumped by the Weyl constants between rounds.
NVFP4_HD void philox4x32_10(Seed key, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                            uint32_t (&out)[4]) {
  uint32_t k0 = key.k0, k1 = key.k1;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 10; ++i) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// The 16 random bytes of block j of row r of batch entry b of a copy's `stream` (0 rowwise, 1
// columnwise) as four words: value k's byte is byte k % 4 of word k / 4.
NVFP4_HD void block_random(Seed key, uint32_t j, uint32_t r, uint32_t b, uint32_t stream,
                           uint32_t (&out)[4]) {
  philox4x32_10(key, j, r, b, stream, out);
}

// Where a copy's values sit in the whole tensor, for stochastic rounding's counters: positions
// in the whole tensor, so that a shard of it draws the bytes the whole tensor would there. The
// shard's first batch entry b and first column n of x, and the whole tensor's index of each of
// its m rows (null: its rows from 0, an unsharded call; a padded row r >= m keeps r). From the
// seed operand, uint32 [2] (the key) or [4 + M] (the key, b, n, then the M rows' indices; n a
// multiple of 16 where the rowwise copy is made, and each run of 16 rows from a multiple of 16
// where the columnwise one is).
struct Stream {
  Seed key;
  uint32_t b = 0, n = 0;
  const uint32_t* rows = nullptr;
  int64_t m = 0;

  NVFP4_HD uint32_t row(int64_t r) const { return rows && r < m ? rows[r] : uint32_t(r); }
  // Rowwise: block j of row r of batch entry e, counter (j + n / 16, row(r), e + b, 0).
  NVFP4_HD void row_block(uint32_t j, int64_t r, uint32_t e, uint32_t (&out)[4]) const {
    block_random(key, j + n / kBlock, row(r), e + b, 0, out);
  }
  // Columnwise: the block of rows m0..m0 + 15 of x, block m0 / 16 of each row of x^T, is block
  // column_index(m0) of the whole tensor's; in column c, counter (that index, c + n, e + b, 1).
  NVFP4_HD uint32_t column_index(int64_t m0) const { return row(m0) / kBlock; }
  NVFP4_HD void column_block(uint32_t index, uint32_t c, uint32_t e, uint32_t (&out)[4]) const {
    block_random(key, index, c + n, e + b, 1, out);
  }
};

// The Stream of a seed operand of a copy of m rows: `placed` where it holds 4 + m words, else the
// key alone.
NVFP4_HD Stream stream_of(const uint32_t* seed, bool placed, int64_t m) {
  Stream s{Seed{seed[0], seed[1]}};
  if (placed) {
    s.b = seed[2];
    s.n = seed[3];
    s.rows = seed + 4;
    s.m = m;
  }
  return s;
}

// Value k's random byte of a block's words.
NVFP4_HD uint32_t random_byte(const uint32_t (&w)[4], int k) {
  return (w[k >> 2] >> (8 * (k & 3))) & 0xFFu;
}

// ---- Random Hadamard Transform of 16 values ----

// Bit i set where the fixed RHT sign i is -1 (formats.RHT_SIGNS):
// (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1).
constexpr uint32_t kRhtNegative = 0xD7E8u;

// Signs, four float32 butterfly stages (pairs 1, 2, 4, 8 apart: (a, b) -> (a + b,
// a - b)), then * 1/4; the caller rounds the result to the input dtype.
NVFP4_HD void rht16(float (&v)[kBlock]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kBlock; ++i) v[i] = (kRhtNegative >> i) & 1u ? -v[i] : v[i];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int h = 1; h < kBlock; h *= 2) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < kBlock; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kBlock; ++i) v[i] = v[i] * 0.25f;
}

// ---- scales ----

// Global scales derived from an amax (one per tensor, or one per row when
// row-scaled). The spec's range E (448, or 256 with 4over6) is the block-scale
// range the global scale aims at; the scales see it only as the divisor
// fp32(6 E), which changes ges alone (QuantizeSpec::global_scales passes it).
struct GlobalScales {
  float encode;       // ges = min(6 E / amax, FLT_MAX), 0 replaced by 1
  float encode_div6;  // ges * fp32(1/6): the block-scale multiplier
  float decode;       // gds = 1 / ges
  float amax;         // the amax itself (4over6's exact error)
  float divisor;      // fp32(6 E)
};

// fp32(6 E) of a block-scale range E: 2688 or 1536, both exact.
NVFP4_HD float six_times(int32_t range) { return kE2M1Max * float(range); }

// The global scales of an amax for the divisor fp32(6 E).
NVFP4_HD GlobalScales global_scales(float amax, float divisor) {
  float ges = divisor / amax;
  if (ges > kFloatMax) ges = kFloatMax;  // NaN stays NaN
  if (ges == 0.0f) ges = 1.0f;           // only when amax is inf
  const float one_sixth = 1.0f / 6.0f;
  return GlobalScales{ges, ges * one_sixth, 1.0f / ges, amax, divisor};
}

// E4M3 decode scale of a block with max magnitude `block_amax`.
NVFP4_HD uint8_t block_scale(float block_amax, const GlobalScales& g) {
  float s = block_amax * g.encode_div6;
  if (s > kFloatMax) s = kFloatMax;
  if (s > kE4M3Max) s = kE4M3Max;
  if (s < -kE4M3Max) s = -kE4M3Max;
  return float_to_e4m3(s);
}

// Element encode scale of a block: min(1 / (s * gds), FLT_MAX).
NVFP4_HD float block_encode_scale(uint8_t scale, const GlobalScales& g) {
  const float enc = 1.0f / (e4m3_to_float(scale) * g.decode);
  return enc > kFloatMax ? kFloatMax : enc;
}

NVFP4_HD uint8_t quantize_value(float x, float encode_scale) {
  return float_to_e2m1(x * encode_scale);
}

NVFP4_HD uint8_t quantize_value_stochastic(float x, float encode_scale, uint32_t rbyte) {
  return float_to_e2m1_stochastic(x * encode_scale, rbyte);
}

// Global decode scale of dequantization and of the GEMM: amax / (6 E), the
// divisor fp32(6 E) as GlobalScales::divisor, as the reference GEMM applies it
// (DequantizeSpec::global_decode_scale passes it). Unlike the quantizer's
// 1 / ges it stays inf for an infinite amax, so a tensor that held inf never
// dequantizes to finite values.
NVFP4_HD float dequantize_scale(float amax, float divisor) { return amax / divisor; }

// Dequantized value in float32: fp32(e2m1 * s) * dequantize_scale(amax). Any NaN (a NaN scale or
// global scale) comes out as the canonical quiet NaN, so the bytes are defined.
NVFP4_HD float scale_value(float e2m1, float scale, float global_decode) {
  const float r = (e2m1 * scale) * global_decode;
  return r != r ? bits_float(kCanonicalNaN) : r;
}

NVFP4_HD float dequantize_value(uint8_t code, uint8_t scale, float global_decode) {
  return scale_value(e2m1_to_float(code), e4m3_to_float(scale), global_decode);
}

}  // namespace nvfp4
