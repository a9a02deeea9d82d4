// 4over6 on the GPU, for the quantize kernel's layout: a thread holds 16 rows x 8 columns, so
// a columnwise 1x16 chunk is one thread's and a rowwise chunk is two lanes' (lanes 2k and
// 2k + 1, columns 0-7 and 8-15 of the block). A chunk's error is still the sum of its 16
// terms in element order from 0: the even lane sums its 8, the odd lane continues from that
// sum, decides, and hands the decision back.
//
// The quantize kernel's 1x16 chunks take a faster path with the same bytes (row_choice,
// column_choice): a candidate's rounded value comes from the float16 class of the product (one
// truncating convert for two values and a lookup, the class table's classes: e2m1_lut.cuh) instead
// of float_to_e2m1 and e2m1_to_float; the exact error's division moves out of the element loop
// (exact_units); candidate encode scales come from the entry's table where it has one. The
// grouped kernel and 16x16 blocks keep the reference path (candidates, error_terms).
#pragma once

#include "cuda/e2m1_lut.cuh"
#include "nvfp4/four_over_six.h"

namespace nvfp4::cuda {

// A block's two candidates: scale codes, element encode scales and decoded scales.
struct Candidate {
  uint8_t scale;
  float enc, dec;
};

__device__ __forceinline__ void candidates(float bamax, const GlobalScales& g, Candidate& c6,
                                           Candidate& c4) {
  const Candidates c = candidate_scales(bamax, g);
  c6 = Candidate{c.s6, block_encode_scale(c.s6, g), e4m3_to_float(c.s6)};
  c4 = Candidate{c.s4, block_encode_scale(c.s4, g), e4m3_to_float(c.s4)};
}

// The error terms of value v under both candidates.
__device__ __forceinline__ void error_terms(float v, const Candidate& c6, const Candidate& c4,
                                            const GlobalScales& g, FourOverSix fos, float& e6,
                                            float& e4) {
  e6 = element_error(quantize_value(v, c6.enc), c6.dec, v, g, fos.mse(), fos.fast_math);
  e4 = element_error(quantize_value(v, c4.enc), c4.dec, v, g, fos.mse(), fos.fast_math);
}

__device__ __forceinline__ Candidate choose(bool map4, const Candidate& c6, const Candidate& c4) {
  return map4 ? c4 : c6;
}

// ---- the faster path of 1x16 chunks ----

// The signed E2M1 value float_to_e2m1 rounds every float of float16 class b to (f16_class_code).
NVFP4_HD float f16_class_value(uint32_t b) { return e2m1_to_float(f16_class_code(b)); }

// A candidate of the faster path: with the exact error, its per-block units u1 = fp32(fp32(dec *
// amax) / divisor) and u15 (of 1.5 dec), where `exact` says they give element_error's bits.
struct FastCandidate {
  Candidate c;
  float u1, u15;
  bool exact;
};

// The exact error's dequantized value fp32(fp32(q dec amax) / divisor) of a rounded value
// q = +-2^k m (m 1 or 1.5, 2^k in [1/2, 4]) is +-2^k u_m: scaling by 2^k is exact wherever dec *
// amax lies in [2^-113, 2^125] (every product and quotient then stays a normal float; the
// divisors are 1536 and 2688), or is 0 with a finite amax (every term then 0 - x).
__device__ __forceinline__ FastCandidate exact_units(const Candidate& c, const GlobalScales& g) {
  const float t = c.dec * g.amax;
  const bool exact = (t >= 0x1p-113f && t <= 0x1p125f) || (c.dec == 0.0f && g.amax <= kFloatMax);
  return FastCandidate{c, opaque(t / g.divisor), opaque((1.5f * c.dec * g.amax) / g.divisor),
                       exact};
}

// Whether every block of a copy with this amax has exact units (exact_units): nonzero scales lie
// in [2^-9, 448], so dec * amax stays in range for amax in [2^-104, 2^116].
NVFP4_HD bool units_always_exact(float amax) { return amax >= 0x1p-104f && amax <= 0x1p116f; }

// The two candidates of a block: their scale codes by one convert (candidate_scales' clamp is its
// saturation; a NaN gives 0x7F, which reads as NaN everywhere below and is stored fixed, as the
// reference's 0xFF), encode scales from the entry's table `enc` (nullptr: row-scaled copies,
// computed), decoded scales from `dec` (e4m3_to_float of each code).
__device__ __forceinline__ void fast_candidates(float bamax, const GlobalScales& g,
                                                const float* enc, const float* dec, bool fast_math,
                                                FastCandidate& c6, FastCandidate& c4) {
  const float base = candidate_base(bamax, g);
  const uint32_t codes = e4m3x2_satfinite(base * 1.5f, base);
  const auto one = [&](uint32_t code) {
    const Candidate c{uint8_t(code),
                      enc ? NVFP4_LDS(enc + code) : block_encode_scale(uint8_t(code), g),
                      NVFP4_LDS(dec + code)};
    return fast_math ? FastCandidate{c, 0.0f, 0.0f, true} : exact_units(c, g);
  };
  c6 = one(codes & 0xFFu);
  c4 = one(codes >> 8);
}

// This lane's candidate c where `mine`, else its pair partner's (every lane of the warp calls),
// field by field so that nothing leaves registers.
__device__ __forceinline__ FastCandidate pick_candidate(bool mine, const FastCandidate& c) {
  const auto pick = [&](auto v) {
    const auto other = __shfl_xor_sync(~0u, v, 1);
    return mine ? v : other;
  };
  return FastCandidate{Candidate{uint8_t(pick(uint32_t(c.c.scale))), pick(c.c.enc), pick(c.c.dec)},
                       pick(c.u1), pick(c.u15), pick(int(c.exact)) != 0};
}

// The rounded values (float_to_e2m1 then e2m1_to_float) of fp32(v0 * enc) and fp32(v1 * enc) from
// `values` (f16_class_value by class); kSafe: any product (tie_safe_bits), else no round-down tie
// or -0.0 (the entry's tie_possible).
template <bool kSafe>
__device__ __forceinline__ void rounded2(const float* values, float v0, float v1, float enc,
                                         float& r0, float& r1) {
  const uint32_t h = truncated_pair<kSafe>(v0, v1, enc);
  r0 = NVFP4_LDS(values + byte_perm(h, 0, 0x4441));
  r1 = NVFP4_LDS(values + byte_perm(h, 0, 0x4443));
}

// element_error of value x rounded to r under candidate c; xg = fp32(x * ges) (fast math).
__device__ __forceinline__ float fast_term(float r, float x, float xg, const FastCandidate& c,
                                           FourOverSix fos) {
  float d;
  if (fos.fast_math) {
    d = fma_rn(r, c.c.dec, -xg);  // r dec is exact: fp32(r dec - xg)
  } else {
    const uint32_t rb = float_bits(r);
    d = bits_float(rb & 0xFF800000u) * ((rb & 0x400000u) ? c.u15 : c.u1) - x;
  }
  return fos.mse() ? d * d : fabsf(d);
}

// Both candidates' terms of n values (pairs) by the faster path.
template <bool kSafe, int kN, typename Get>
__device__ __forceinline__ void class_terms(const float* values, Get x, const FastCandidate& c6,
                                            const FastCandidate& c4, const GlobalScales& g,
                                            FourOverSix fos, float (&t6)[kN], float (&t4)[kN]) {
#pragma unroll
  for (int k = 0; k < kN; k += 2) {
    float r6[2], r4[2];
    rounded2<kSafe>(values, x(k), x(k + 1), c6.c.enc, r6[0], r6[1]);
    rounded2<kSafe>(values, x(k), x(k + 1), c4.c.enc, r4[0], r4[1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float xg = fos.fast_math ? x(k + i) * g.encode : 0.0f;
      t6[k + i] = fast_term(r6[i], x(k + i), xg, c6, fos);
      t4[k + i] = fast_term(r4[i], x(k + i), xg, c4, fos);
    }
  }
}

// Up to 16 values of a chunk and both candidates' error terms of them, by value: reference_terms'
// arguments and result.
struct ChunkValues {
  float v[kBlock];
};
struct ChunkTerms {
  float t6[kBlock], t4[kBlock];
};

// error_terms of the first n values, out of line: the rare blocks without exact units take it, and
// every call site of every kernel shares one copy of its code (the kernels' build time).
#if defined(__CUDACC__)
#define NVFP4_OUT_OF_LINE inline __device__ __noinline__
#else  // the host model: CUDA's keyword is not a GCC attribute there
#define NVFP4_OUT_OF_LINE inline __attribute__((noinline))
#endif
NVFP4_OUT_OF_LINE ChunkTerms reference_terms(ChunkValues x, int n, Candidate c6, Candidate c4,
                                             GlobalScales g, FourOverSix fos) {
  ChunkTerms t{};
  for (int k = 0; k < n; ++k) error_terms(x.v[k], c6, c4, g, fos, t.t6[k], t.t4[k]);
  return t;
}

// Both candidates' terms of n values (pairs): by the faster path where both candidates allow it
// (`exact`: all blocks of the copy do), with tie-safe products where `safe` (rounded2), else by
// reference_terms. The choices are arguments, not template parameters, so that each call site
// compiles the faster path twice, not four times; every caller's values of them are uniform
// across a warp.
template <int kN, typename Get>
__device__ __forceinline__ void fast_terms(const float* values, Get x, const FastCandidate& c6,
                                           const FastCandidate& c4, const GlobalScales& g,
                                           FourOverSix fos, bool exact, bool safe, float (&t6)[kN],
                                           float (&t4)[kN]) {
  if (exact || (c6.exact && c4.exact)) {
    if (safe)
      class_terms<true>(values, x, c6, c4, g, fos, t6, t4);
    else
      class_terms<false>(values, x, c6, c4, g, fos, t6, t4);
  } else {
    ChunkValues xs;
#pragma unroll
    for (int k = 0; k < kN; ++k) xs.v[k] = x(k);
    const ChunkTerms t = reference_terms(xs, kN, c6.c, c4.c, g, fos);
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      t6[k] = t.t6[k];
      t4[k] = t.t4[k];
    }
  }
}

// Sums the 16 terms of a chunk held 8 by 8 in a lane pair, in element order: the odd lane's
// result is the sum, the even lane's its first half (every lane of the warp must call).
__device__ __forceinline__ float pair_sequential_sum(const float (&t)[8]) {
  float first = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) first = first + t[k];
  float sum = __shfl_xor_sync(~0u, first, 1);
#pragma unroll
  for (int k = 0; k < 8; ++k) sum = sum + t[k];
  return sum;
}

// The odd lane's decision, in both lanes of the pair.
__device__ __forceinline__ bool pair_decision(bool odd_lane_decides) {
  const bool other = __shfl_xor_sync(~0u, int(odd_lane_decides), 1) != 0;
  return (threadIdx.x & 1u) ? odd_lane_decides : other;
}

// The chosen candidate of a columnwise 1x16 chunk: this thread's 16 values.
__device__ __forceinline__ Candidate column_chunk(const float (&v)[kBlock], float bamax,
                                                  const GlobalScales& g, FourOverSix fos) {
  Candidate c6, c4;
  candidates(bamax, g, c6, c4);
  float err6 = 0.0f, err4 = 0.0f;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    float e6, e4;
    error_terms(v[r], c6, c4, g, fos, e6, e4);
    err6 = err6 + e6;
    err4 = err4 + e4;
  }
  return choose(prefer_map4(err4, err6), c6, c4);
}

// The chosen candidate of a rowwise 1x16 chunk by the faster path: this lane's 8 values (columns
// 0-7 of the block in the even lane, 8-15 in the odd one) and the row's candidates
// (fast_candidates; both lanes of the pair pass the same); `exact`, `safe`: as fast_terms takes
// them.
__device__ __forceinline__ Candidate row_choice(const float* values, const float (&v)[8],
                                                const FastCandidate& c6, const FastCandidate& c4,
                                                const GlobalScales& g, FourOverSix fos, bool exact,
                                                bool safe) {
  float t6[8], t4[8];
  fast_terms(values, [&](int k) { return v[k]; }, c6, c4, g, fos, exact, safe, t6, t4);
  const float err6 = pair_sequential_sum(t6), err4 = pair_sequential_sum(t4);
  return choose(pair_decision(prefer_map4(err4, err6)), c6.c, c4.c);
}

// column_chunk by the faster path (`enc`, `dec`: as fast_candidates takes them).
__device__ __forceinline__ Candidate column_choice(const float* values, const float (&v)[kBlock],
                                                   float bamax, const GlobalScales& g,
                                                   const float* enc, const float* dec,
                                                   FourOverSix fos, bool exact, bool safe) {
  FastCandidate c6, c4;
  fast_candidates(bamax, g, enc, dec, fos.fast_math, c6, c4);
  float t6[kBlock], t4[kBlock];
  fast_terms(values, [&](int k) { return v[k]; }, c6, c4, g, fos, exact, safe, t6, t4);
  float err6 = 0.0f, err4 = 0.0f;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    err6 = err6 + t6[r];
    err4 = err4 + t4[r];
  }
  return choose(prefer_map4(err4, err6), c6.c, c4.c);
}

// The chosen candidates of a 16x16 tile held by a lane pair (16 rows x 8 columns each): for
// the rowwise copy on the tree sum (tree_sum16) of its 16 row errors, for the columnwise copy
// on the tree sum of its 16 column errors (every lane of the warp must call). v(r, c): the
// value of row r, column c, unpacked where it is used (a 16 x 8 float array would not fit).
template <typename Get>
__device__ __forceinline__ void tile_choice(Get v, float bamax, const GlobalScales& g,
                                            FourOverSix fos, Candidate& row, Candidate& col) {
  Candidate c6, c4;
  candidates(bamax, g, c6, c4);
  float row6[kBlock], row4[kBlock], col6[8], col4[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) col6[c] = col4[c] = 0.0f;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    float t6[8], t4[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      error_terms(v(r, c), c6, c4, g, fos, t6[c], t4[c]);
      col6[c] = col6[c] + t6[c];
      col4[c] = col4[c] + t4[c];
    }
    row6[r] = pair_sequential_sum(t6);
    row4[r] = pair_sequential_sum(t4);
  }
  // Rows: the odd lane has the row errors. Columns: the tree's first level adds columns i and
  // i + 8, one in each lane (addition commutes, so both lanes get the same sums).
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    col6[c] = col6[c] + __shfl_xor_sync(~0u, col6[c], 1);
    col4[c] = col4[c] + __shfl_xor_sync(~0u, col4[c], 1);
  }
#pragma unroll
  for (int h = 4; h > 0; h /= 2) {
#pragma unroll
    for (int i = 0; i < h; ++i) {
      col6[i] = col6[i] + col6[i + h];
      col4[i] = col4[i] + col4[i + h];
    }
  }
  row = choose(pair_decision(prefer_map4(tree_sum16(row4), tree_sum16(row6))), c6, c4);
  col = choose(prefer_map4(col4[0], col6[0]), c6, c4);
}

}  // namespace nvfp4::cuda
