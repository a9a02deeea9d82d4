// 4over6 on the CPU: the map-6 / map-4 choice of many blocks at once. Blocks
// are laid out as the columns of a [16][n] array (a columnwise stripe as is,
// rowwise chunks transposed), so every loop runs across blocks and vectorizes
// while each chunk's error is still summed in element order.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/e2m1.h"
#include "nvfp4/four_over_six.h"

namespace nvfp4::cpu {

// Per-thread scratch of the 4over6 choice, reused across stripes.
struct FosScratch {
  std::vector<uint8_t> s6, s4;                  // [n] candidate scales (E4M3 codes)
  std::vector<float> enc6, enc4;                // [n] their element encode scales
  std::vector<float> dec6, dec4;                // [n] their decoded values
  std::vector<float> ges, amax;                 // [n] the blocks' global encode scales and amaxes
  std::vector<float> e6, e4;                    // [16][n] element error terms
  std::vector<float> err6, err4;                // [n] column sums: chunk errors
  std::vector<float> d1_6, d1_4, d15_6, d15_4;  // [n] exact error: quotients d1, d1.5 (choose_1d)
  std::vector<uint8_t> safe;                    // [n] whether errors_1d takes the block (choose_1d)
  std::vector<GlobalScales> g;                  // [n] one set of global scales, repeated (16x16)
  std::vector<uint8_t> tile6, tile4;            // [tiles] 16x16 candidates before spreading
  std::vector<float> tile_enc6, tile_enc4;
};

// Calls fn(mse, fast_math) with both as compile-time constants.
template <typename Fn>
void with_error_mode(FourOverSix fos, Fn&& fn) {
  using T = std::true_type;
  using F = std::false_type;
  if (fos.mse())
    fos.fast_math ? fn(T{}, T{}) : fn(T{}, F{});
  else
    fos.fast_math ? fn(F{}, T{}) : fn(F{}, F{});
}

// Candidate scales of n blocks from their max magnitudes (bits), block j with
// global scales g[j].
inline void candidates(const uint32_t* __restrict mag, const GlobalScales* __restrict g, int64_t n,
                       FosScratch& f) {
  for (auto* v : {&f.enc6, &f.enc4, &f.dec6, &f.dec4, &f.ges, &f.amax}) v->resize(n);
  f.s6.resize(n);
  f.s4.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    const Candidates c = candidate_scales(amax_from_bits(mag[j]), g[j]);
    f.s6[j] = c.s6;
    f.s4[j] = c.s4;
    f.enc6[j] = block_encode_scale(c.s6, g[j]);
    f.enc4[j] = block_encode_scale(c.s4, g[j]);
    f.dec6[j] = e4m3_to_float(c.s6);
    f.dec4[j] = e4m3_to_float(c.s4);
    f.ges[j] = g[j].encode;
    f.amax[j] = g[j].amax;
  }
}

// Both candidates' error terms of n values x, value j with the candidates at j.
// Every operand an array of its own (restrict), so that the loop vectorizes.
template <bool kMse, bool kFast>
void error_row(const float* __restrict x, int64_t n, float divisor, const float* __restrict enc6,
               const float* __restrict enc4, const float* __restrict dec6,
               const float* __restrict dec4, const float* __restrict ges,
               const float* __restrict amax, float* __restrict e6, float* __restrict e4) {
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t c6 = quantize_value(x[j], enc6[j]), c4 = quantize_value(x[j], enc4[j]);
    e6[j] = element_error(c6, dec6[j], x[j], ges[j], amax[j], divisor, kMse, kFast);
    e4[j] = element_error(c4, dec4[j], x[j], ges[j], amax[j], divisor, kMse, kFast);
  }
}

// Both candidates' error terms of v [16][n], column j with the candidates at j.
template <bool kMse, bool kFast>
void error_terms(const float* v, int64_t n, float divisor, FosScratch& f) {
  f.e6.resize(kBlock * n);
  f.e4.resize(kBlock * n);
  for (int r = 0; r < kBlock; ++r)
    error_row<kMse, kFast>(v + r * n, n, divisor, f.enc6.data(), f.enc4.data(), f.dec6.data(),
                           f.dec4.data(), f.ges.data(), f.amax.data(), f.e6.data() + r * n,
                           f.e4.data() + r * n);
}

// Sums of the columns of e [16][n], row 0 first: the chunk errors.
inline void column_sums(const std::vector<float>& e, int64_t n, std::vector<float>& out) {
  out.assign(n, 0.0f);
  float* __restrict o = out.data();
  for (int r = 0; r < kBlock; ++r) {
    const float* __restrict er = e.data() + r * n;
    for (int64_t j = 0; j < n; ++j) o[j] = o[j] + er[j];
  }
}

// The exact error term's dequantized magnitude fp32(fp32(q s amax) / divisor) of the grid value
// q of a block's candidate scale s, from two quotients of the block: q = 2^k m with m 1 or 1.5
// (0.5, 1, 2, 4 and 1.5, 3, 6), and q s amax and its quotient scale by 2^k exactly while every
// such value is a finite normal float, so the value is 2^k d_m, d_m = fp32(fp32(m s amax) /
// divisor): 2^k is q's exponent bits, m is 1.5 where q's top mantissa bit is set. (q = 0 gives
// 0.) exact_units marks the blocks where that range does not hold.
inline float dequantized(float q, float d1, float d15) {
  const uint32_t u = float_bits(q);
  return bits_float(u & 0x7F800000u) * ((u & 0x00400000u) ? d15 : d1);
}

// Whether a candidate scale s of a block keeps dequantized exact: s = 0 with a finite amax (every
// value 0), or its smallest nonzero value d1 / 2 normal and its largest product 4 fp32(1.5 s
// amax) finite (the quotients are smaller: the divisor is over 1). NaNs fail.
inline uint32_t scaling_exact(float s, float amax, float r15, float d1) {
  constexpr float kFloatMin = 1.17549435082228750797e-38f;
  const uint32_t finite_amax = amax <= kFloatMax ? 1u : 0u;
  const uint32_t zero = s == 0.0f ? 1u : 0u;
  const uint32_t normal = d1 >= 2.0f * kFloatMin ? 1u : 0u;
  const uint32_t finite = r15 <= kFloatMax * 0.25f ? 1u : 0u;
  return finite_amax & (zero | (normal & finite));
}

// The quotients d1 and d1.5 of dequantized for both candidates of n blocks (after candidates),
// and whether errors_1d takes each block (with fast math, every block).
inline void exact_units(int64_t n, float divisor, bool fast_math, FosScratch& f) {
  for (auto* v : {&f.d1_6, &f.d1_4, &f.d15_6, &f.d15_4}) v->resize(n);
  f.safe.resize(n);
  const float* __restrict dec6 = f.dec6.data();
  const float* __restrict dec4 = f.dec4.data();
  const float* __restrict amax = f.amax.data();
  float* __restrict d1_6 = f.d1_6.data();
  float* __restrict d1_4 = f.d1_4.data();
  float* __restrict d15_6 = f.d15_6.data();
  float* __restrict d15_4 = f.d15_4.data();
  uint8_t* __restrict safe = f.safe.data();
  for (int64_t j = 0; j < n; ++j) {
    const float r15_6 = (dec6[j] * 1.5f) * amax[j], r15_4 = (dec4[j] * 1.5f) * amax[j];
    d1_6[j] = (dec6[j] * amax[j]) / divisor;
    d1_4[j] = (dec4[j] * amax[j]) / divisor;
    d15_6[j] = r15_6 / divisor;
    d15_4[j] = r15_4 / divisor;
    safe[j] = uint8_t(fast_math | (scaling_exact(dec6[j], amax[j], r15_6, d1_6[j]) &
                                   scaling_exact(dec4[j], amax[j], r15_4, d1_4[j])));
  }
}

// Both candidates' errors of n blocks, the columns of v [16][n], summed in element order (from
// 0, row 0 first) into f.err6 and f.err4, each element's code, dequantized value and error term
// made in registers. Exact mode: d = dequantized - |x| (the term of the code of x: its sign is
// x's, so d is negated or kept, which |d| and d d do not see); fast math: d = q s - |x| ges.
template <bool kMse, bool kFast>
void errors_row(const float* __restrict x, int64_t n, const float* __restrict enc6,
                const float* __restrict enc4, const float* __restrict a6,
                const float* __restrict a4, const float* __restrict b6, const float* __restrict b4,
                float* __restrict err6, float* __restrict err4) {
  for (int64_t j = 0; j < n; ++j) {
    const float ax = std::fabs(x[j]);
    const float q6 = e2m1_grid(e2m1_position(ax * enc6[j]));
    const float q4 = e2m1_grid(e2m1_position(ax * enc4[j]));
    float d6, d4;
    if (kFast) {
      const float xg = ax * b6[j];
      d6 = q6 * a6[j] - xg;
      d4 = q4 * a4[j] - xg;
    } else {
      d6 = dequantized(q6, a6[j], b6[j]) - ax;
      d4 = dequantized(q4, a4[j], b4[j]) - ax;
    }
    err6[j] = err6[j] + (kMse ? d6 * d6 : std::fabs(d6));
    err4[j] = err4[j] + (kMse ? d4 * d4 : std::fabs(d4));
  }
}

template <bool kMse, bool kFast>
void errors_1d(const float* v, int64_t n, FosScratch& f) {
  f.err6.assign(n, 0.0f);
  f.err4.assign(n, 0.0f);
  for (int k = 0; k < kBlock; ++k)
    errors_row<kMse, kFast>(
        v + k * n, n, f.enc6.data(), f.enc4.data(), kFast ? f.dec6.data() : f.d1_6.data(),
        kFast ? f.dec4.data() : f.d1_4.data(), kFast ? f.ges.data() : f.d15_6.data(),
        kFast ? f.ges.data() : f.d15_4.data(), f.err6.data(), f.err4.data());
}

// The errors of block j (a column of v [16][n]) as element_error gives them, for the blocks
// that errors_1d cannot take.
inline void exact_errors(const float* v, int64_t n, int64_t j, const GlobalScales& g, float divisor,
                         FourOverSix fos, FosScratch& f) {
  const float sc6 = f.dec6[j], sc4 = f.dec4[j];
  float e6 = 0.0f, e4 = 0.0f;
  for (int k = 0; k < kBlock; ++k) {
    const float x = v[k * n + j];
    e6 = e6 + element_error(quantize_value(x, f.enc6[j]), sc6, x, g.encode, g.amax, divisor,
                            fos.mse(), fos.fast_math);
    e4 = e4 + element_error(quantize_value(x, f.enc4[j]), sc4, x, g.encode, g.amax, divisor,
                            fos.mse(), fos.fast_math);
  }
  f.err6[j] = e6;
  f.err4[j] = e4;
}

// 4over6 of n 1x16 blocks, the columns of v [16][n], with max magnitudes mag
// and global scales g: the chosen scale and element encode scale of each.
inline void choose_1d(const float* v, int64_t n, const uint32_t* mag, const GlobalScales* g,
                      FourOverSix fos, FosScratch& f, uint8_t* __restrict scale,
                      float* __restrict enc) {
  const float divisor = n > 0 ? g[0].divisor : 0.0f;  // one range E per call
  candidates(mag, g, n, f);
  exact_units(n, divisor, fos.fast_math, f);
  with_error_mode(fos, [&](auto mse, auto fast) { errors_1d<mse, fast>(v, n, f); });
  for (int64_t j = 0; j < n; ++j)
    if (!f.safe[j]) exact_errors(v, n, j, g[j], divisor, fos, f);
  for (int64_t j = 0; j < n; ++j) {
    const bool map4 = prefer_map4(f.err4[j], f.err6[j]);
    scale[j] = map4 ? f.s4[j] : f.s6[j];
    enc[j] = map4 ? f.enc4[j] : f.enc6[j];
  }
}

// The 16 values of the chosen 4over6 candidate, copied to the 16 columns of a tile.
template <typename T>
void spread_tiles(std::vector<T>& a, int64_t tiles) {
  a.resize(tiles * kBlock);
  for (int64_t c = tiles * kBlock - 1; c >= 0; --c) a[c] = a[c / kBlock];
}

// 4over6 of the 16x16 tiles of a stripe v [16][width] (tile t: columns 16t to
// 16t + 15) with max magnitudes tile_mag and one set of global scales g. The
// candidates are the tile's, the choice is made twice: for the rowwise copy on
// the tile's 16 row errors, for the columnwise copy (x^T) on its 16 column
// errors, each a tree sum. Per tile: scale and encode scale of both copies.
inline void choose_2d(const float* v, int64_t width, const uint32_t* tile_mag,
                      const GlobalScales& g, FourOverSix fos, FosScratch& f, uint8_t* scale_row,
                      float* enc_row, uint8_t* scale_col, float* enc_col) {
  const int64_t tiles = width / kBlock;
  f.g.assign(width, g);
  candidates(tile_mag, f.g.data(), tiles, f);
  f.tile6.assign(f.s6.begin(), f.s6.end());
  f.tile4.assign(f.s4.begin(), f.s4.end());
  f.tile_enc6.assign(f.enc6.begin(), f.enc6.end());
  f.tile_enc4.assign(f.enc4.begin(), f.enc4.end());
  for (auto* a : {&f.enc6, &f.enc4, &f.dec6, &f.dec4, &f.ges, &f.amax}) spread_tiles(*a, tiles);
  with_error_mode(fos,
                  [&](auto mse, auto fast) { error_terms<mse, fast>(v, width, g.divisor, f); });
  column_sums(f.e6, width, f.err6);
  column_sums(f.e4, width, f.err4);
  float r6[kBlock], r4[kBlock];
  for (int64_t t = 0; t < tiles; ++t) {
    // Rowwise: row r's error sums its 16 columns in order.
    for (int r = 0; r < kBlock; ++r) {
      const float* e6 = f.e6.data() + r * width + t * kBlock;
      const float* e4 = f.e4.data() + r * width + t * kBlock;
      float a6 = 0.0f, a4 = 0.0f;
      for (int k = 0; k < kBlock; ++k) {
        a6 = a6 + e6[k];
        a4 = a4 + e4[k];
      }
      r6[r] = a6;
      r4[r] = a4;
    }
    const bool row4 = prefer_map4(tree_sum16(r4), tree_sum16(r6));
    scale_row[t] = row4 ? f.tile4[t] : f.tile6[t];
    enc_row[t] = row4 ? f.tile_enc4[t] : f.tile_enc6[t];
    // Columnwise: x^T's rows are the tile's columns, their errors summed down the rows.
    for (int k = 0; k < kBlock; ++k) {
      r6[k] = f.err6[t * kBlock + k];
      r4[k] = f.err4[t * kBlock + k];
    }
    const bool col4 = prefer_map4(tree_sum16(r4), tree_sum16(r6));
    scale_col[t] = col4 ? f.tile4[t] : f.tile6[t];
    enc_col[t] = col4 ? f.tile_enc4[t] : f.tile_enc6[t];
  }
}

}  // namespace nvfp4::cpu
