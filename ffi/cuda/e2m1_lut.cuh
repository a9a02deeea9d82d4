// E2M1 codes by table, for Hopper, which has no E2M1 convert: the code of v = x * enc is
// lut[bits(v) >> 21]. Every rounding threshold of float_to_e2m1 (0.25, 0.75, 1.25, 1.75, 2.5,
// 3.5 and 5) is a multiple of 2^21 in float bits, so the code is constant on each chunk of
// 2^21 bit patterns but for its lowest pattern, and an entry holds the code of the rest.
// Three lowest patterns need more than a shift (an exhaustive check over all 2^32 floats in
// tests/cuda/test_cuda_host.py proves both indices):
//   - a threshold where the tie rounds down (0.25, 1.25, 2.5, 5): the chunk below's code;
//   - -0.0, whose code is 0 where the rest of its chunk (tiny negatives) gives 8;
//   - inf, whose chunk holds no other float that arithmetic produces: its entry is inf's code.
// The tie-safe index (bits + bit 22 - 1) >> 21 sends exactly those to the chunk below (bit 22
// is clear at these thresholds and set at those whose tie rounds up). The fast index, a shift,
// is right wherever no product is a round-down tie or an underflow to -0.0: the kernel checks
// that once per batch entry and copy, for all 256 block scale codes (tie_possible), and takes the
// tie-safe index where it cannot rule them out. -0.0 inputs never reach the table: products
// are x * enc + 0, which IEEE rounds to +0.0 where x * enc is exactly -0.0.
#pragma once

#include <type_traits>

#include "cuda/memory.cuh"
#include "nvfp4/ffi_common.h"
#include "nvfp4/ptx.h"

namespace nvfp4::cuda {

// How a kernel finds a copy's nearest-rounding codes: kFast, by the E2M1 convert or the class
// table, where no product can be a round-down tie or -0.0 (tie_possible); else by the class table
// on tie-safe bits (kClassSafe), or without a class table the code table's tie-safe index
// (kLutSafe), which with the convert (sm_100a/sm_120a) is the convert of x * enc + 0 (it rounds
// ties as the reference does; only -0.0 needs the extra add). Ordered: a pass serving two copies
// takes the later of their two.
enum class Index { kFast, kClassSafe, kLutSafe };

constexpr int kLutShift = 21;
constexpr int kLutSize = 1 << (32 - kLutShift);

// Entry i: the code of the floats with bits in ((i << 21), (i + 1) << 21), or of inf.
NVFP4_HD uint8_t lut_entry(uint32_t i) {
  const uint32_t bits = i << kLutShift;
  const bool inf = (bits & 0x7FFFFFFFu) == 0x7F800000u;
  return float_to_e2m1(bits_float(inf ? bits : bits | 1u));
}

// The tie-safe step on a product's bits: u - 1 where bit 22 is clear (the round-down ties, -0.0
// and inf go one pattern down, into the chunk below), u where it is set (every quiet NaN too).
// Any other pattern stays in its chunk of 2^21.
NVFP4_HD uint32_t tie_safe_bits(uint32_t u) { return u + ((u >> 22) & 1u) - 1u; }

// The E2M1 code of fp32(x * enc) from the table (the tie-safe index with kSafe).
template <bool kSafe>
NVFP4_HD uint32_t lut_code(const uint8_t* lut, float x, float enc) {
  const uint32_t u = float_bits(fma_rn(x, enc, 0.0f));
  return NVFP4_LDS(lut + ((kSafe ? tie_safe_bits(u) : u) >> kLutShift));
}

// Whether fp32(x * enc) can be a round-down tie (0.25, 1.25, 2.5 or 5, either sign) or an
// underflow to -0.0 for some x of loader L's dtype, so that lut_code needs its tie-safe index.
// x * enc is monotonic in x, and the x with fp32(x * enc) == t lie within 2^-23 of t / enc,
// closer than the dtype's spacing: only its two neighbours of fp32(t / enc) can hit. float32
// inputs (24-bit significands) can hit almost always: they always take the tie-safe index.
template <typename L>
NVFP4_HD bool tie_possible(float enc) {
  if constexpr (sizeof(typename L::T) == 4) {
    return true;
  } else {
    constexpr bool kBf16 = std::is_same_v<L, LoadBF16>;
    // -0.0 needs |x * enc| <= 2^-150 for the smallest x > 0: 2^-133 (bfloat16), 2^-24 (float16).
    if (enc <= (kBf16 ? 0x1p-17f : 0x1p-126f)) return true;
    const float ties[4] = {0.25f, 1.25f, 2.5f, 5.0f};
    for (float t : ties) {
      const float q = t / enc;
      const uint32_t near = kBf16 ? float_to_bf16(q) : float_to_f16(q);
      for (uint32_t h = near - 1u; h != near + 2u; ++h)
        if (fma_rn(L::load(uint16_t(h)), enc, 0.0f) == t) return true;
    }
    return false;
  }
}

// Whether fp32(x * enc) can underflow to 0 for a nonzero x of loader L's dtype, so that
// fma_rn(x, enc, 0) can be -0.0 where x * enc + 0 is +0.0 (stochastic rounding's kFast index takes
// the FFMA). |x * enc| grows with |x|: the smallest subnormal decides. float32 inputs: always.
template <typename L>
NVFP4_HD bool underflow_possible(float enc) {
  if constexpr (sizeof(typename L::T) == 4)
    return true;
  else
    return fma_rn(L::load(uint16_t(1)), enc, 0.0f) == 0.0f;
}

// ---- Codes by float16 class, for the fast index (no round-down tie, no -0.0 product) ----
//
// A product truncated to float16 (one cvt.rz.f16x2 for two) has a high byte (sign, exponent, two
// mantissa bits) that names the class [L, L + 2^e / 4) of floats that truncate to it, and every
// E2M1 rounding threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is the lower bound L of a class, so
// the code is the same for the whole class but for its lower bound. There it is the code above the
// threshold: right for the round-up ties (0.75, 1.75, 3.5), and the round-down ties (0.25, 1.25,
// 2.5, 5) are what the fast index rules out. Truncation saturates at 65504 (code 7) and keeps a
// tiny negative product's sign (code 8). A NaN product (only in a block with a NaN, whose encode
// scale is NaN) becomes float16 NaN 0x7FFF, code 0; inf keeps its class (code 7).
// tests/cuda/test_cuda_host.py checks the classes exhaustively over all 2^32 floats.
//
// The class table is one code a 4-byte word, 32 copies side by side, and a lane reads its own:
// class b's copy for lane l is word 32 b + l, in bank l, so a warp's 32 lookups take one
// wavefront whatever the classes (a table indexed by the classes themselves cannot: they cluster
// by exponent, and 32 random lookups into 32 banks take about 3.5). 256 classes x 32 lanes x 4
// bytes: 32 KB of dynamic shared memory. (Until issue 48 a 64 KB table of code pairs, one lookup
// for two values, took 4.3 wavefronts a lookup on N(0, 1) data, swizzled, and 10.1 unswizzled.)

constexpr int kLaneTableWords = 256 * 32;
constexpr int kLaneTableBytes = kLaneTableWords * 4;

// The code of the floats whose float16 truncation has high byte `b`.
NVFP4_HD uint8_t f16_class_code(uint32_t b) {
  const uint32_t h = b << 8;
  if ((h & 0x7C00u) == 0x7C00u)  // inf (7 with its sign) or NaN (0)
    return (h & 0x3FFu) ? 0 : float_to_e2m1(bits_float((h & 0x8000u) << 16 | 0x7F800000u));
  return float_to_e2m1(f16_to_float(uint16_t(h | 0x80u)));  // inside the class, not its bound
}

// The products fp32(v0 * enc) and fp32(v1 * enc) truncated to float16 by one convert (v1's in the
// high half), whose high bytes are their classes. kSafe: the truncations of their tie_safe_bits,
// right for any product, the round-down ties and -0.0 included (float16 classes are chunks of
// 2^21 float32 patterns as the code table's are, and -0.0 becomes NaN, code 0): three integer
// instructions a value more.
template <bool kSafe>
NVFP4_HD uint32_t truncated_pair(float v0, float v1, float enc) {
  uint32_t u0 = float_bits(fma_rn(v0, enc, 0.0f)), u1 = float_bits(fma_rn(v1, enc, 0.0f));
  if (kSafe) {
    u0 = tie_safe_bits(u0);
    u1 = tie_safe_bits(u1);
  }
  return cvt_rz_f16x2(bits_float(u1), bits_float(u0));
}

// The byte (code(v1) << 4) | code(v0) of truncated pair h from the class table at `table`, this
// lane's copy `lane4` = 4 x lane bytes in: two lookups, each a prmt for the class and one
// shift-add for the byte address (written in bytes, so that the table's base stays the load's
// uniform-register operand).
NVFP4_HD uint32_t class_pair_code(const uint8_t* table, uint32_t lane4, uint32_t h) {
  const auto code = [&](uint32_t cls) {
    return NVFP4_LDS(reinterpret_cast<const uint32_t*>(table + ((cls << 7) + lane4)));
  };
  return code(byte_perm(h, 0, 0x4441)) + (code(byte_perm(h, 0, 0x4443)) << 4);
}

// The byte (code(v1) << 4) | code(v0) of fp32(v * enc) for both, from the class table; kSafe:
// for any product (truncated_pair's), else under the fast index.
template <bool kSafe>
NVFP4_HD uint32_t pair_code(const uint8_t* table, uint32_t lane4, float v0, float v1, float enc) {
  return class_pair_code(table, lane4, truncated_pair<kSafe>(v0, v1, enc));
}

// ---- Stochastic rounding's positions: float16 arithmetic, two values a word ----
//
// The code of a product q (not NaN) is (T + rbyte + sign 2^11) >> 8, T = sr_position of its
// magnitude a clamped to 7 * 256 (float_to_e2m1_stochastic). Two candidates give T:
//   - from a = 1.0 on, T = ((m + 1) >> 1) - 0x1C00, m the float16 bits of a truncated: T is
//     linear in float32 bits 13 and up, which float16 keeps (to 65504), because the E2M1 grid's
//     step doubles at 2 and 4 as the binade does;
//   - below 1.0, T = (F + 1) >> 1, F = floor(1024 a): the float16 truncation of 2^15 (a + 1) is
//     2^15 + 32 F (its step is 32), and it saturates at F = 1023 from a = 1 on.
// As D = 2 T + e (e the bit >> 1 drops): D_hi = m + 1 - 0x3800 and D_lo = F + 1. Below 1.0,
// D_hi >> 1 is at most T, and 512 where T is (a >= 1 - 2^-10); from 1.0 on, D_lo's saturated
// 1024 gives 512, the least T there. So T = min(max(D_hi, D_lo), 3585) >> 1, with 16-bit
// SIMD max and min on two values a word, each half offset by 2^15 so that nothing goes negative
// or carries: one float16 convert a pair for m and one for F, no table. (Until issue 48 a 64 KB
// table of T by m, two lookups a pair, took 3.5 wavefronts a lookup on N(0, 1) data: random
// indices into 32 banks.) tests/cuda/test_cuda_host.py checks T over every float32 magnitude and
// the codes over every float16 value and random byte.

// The word of sums 2^15 + 2 (T + rbyte) + e + sign 2^12 of two products q0 = fp32(v0 * enc) + 0
// and q1 (the high half), from h = their float16 truncations (q1's in the high half), g = the
// float16 truncations of rz_2_15_a_plus_1(|q|), and the random bytes in bytes b and b + 1 of
// `random` (sel: 0xF1D0 for bytes 0-1, 0xF3D2 for 2-3): prmt's sign-replicating selector nibbles
// 0xD and 0xF turn the float16 signs into bytes 0x00 or 0xFF, of which 0x08FF08FF keeps bit 11 (no
// -0.0, so the sign bit alone marks a negative code). Each half is below 2^16; its bits 9-12 are
// the code (2^15 / 2^9 = 64 leaves them alone).
NVFP4_HD uint32_t sr_pair_sums(uint32_t h, uint32_t g, uint32_t random, uint32_t sel) {
  constexpr uint32_t kOffset = 0x80008000u;  // 2^15 a half
  const uint32_t rs = prmt_b32(random, h, sel) & 0x08FF08FFu;
  const uint32_t from_one = (h & 0x7FFF7FFFu) + (kOffset - 0x37FF37FFu);  // m + 1 - 0x3800
  const uint32_t below_one = g + (kOffset - 0x77FF77FFu);                 // F + 1
  const uint32_t d = min_u16x2(max_u16x2(from_one, below_one), kOffset + 0x0E010E01u);
  return d + rs + rs;
}

// g of sr_pair_sums for products q0 and q1 (the high half).
NVFP4_HD uint32_t sr_below_one_pair(float q0, float q1) {
  return cvt_rz_f16x2(rz_2_15_a_plus_1(fabsf(q1)), rz_2_15_a_plus_1(fabsf(q0)));
}

}  // namespace nvfp4::cuda
