// 4over6 on the GPU, for the quantize kernel's layout: a thread holds 16 rows x 8 columns, so
// a columnwise 1x16 chunk is one thread's and a rowwise chunk is two lanes' (lanes 2k and
// 2k + 1, columns 0-7 and 8-15 of the block). A chunk's error is still the sum of its 16
// terms in element order from 0: the even lane sums its 8, the odd lane continues from that
// sum, decides, and hands the decision back.
#pragma once

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

// The chosen candidate of a rowwise 1x16 chunk: this lane's 8 values (columns 0-7 of the
// block in the even lane, 8-15 in the odd one).
__device__ __forceinline__ Candidate row_chunk(const float (&v)[8], float bamax,
                                               const GlobalScales& g, FourOverSix fos) {
  Candidate c6, c4;
  candidates(bamax, g, c6, c4);
  float t6[8], t4[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) error_terms(v[k], c6, c4, g, fos, t6[k], t4[k]);
  const float err6 = pair_sequential_sum(t6), err4 = pair_sequential_sum(t4);
  return choose(pair_decision(prefer_map4(err4, err6)), c6, c4);
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
