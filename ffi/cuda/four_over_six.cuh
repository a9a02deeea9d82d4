// 4over6 on the GPU, for the quantize kernel's layout: a thread holds one
// column of a 16-row stripe, a row's 1x16 chunk is 16 lanes of a warp. A
// chunk's error is still the sum of its 16 terms in element order: along a row
// the 16 lanes' terms are gathered by shuffles and added in lane order (every
// lane gets the same sum), down a column the thread adds its own terms.
#pragma once

#include "nvfp4/four_over_six.h"

namespace nvfp4::cuda {

// Sum of the 16 lanes' values of a lane group, lane 0 first; the same in every lane.
__device__ __forceinline__ float group16_sequential_sum(float e) {
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < kBlock; ++k) acc = acc + __shfl_sync(~0u, e, k, kBlock);
  return acc;
}

// Tree sum of the 16 lanes' values of a lane group (lanes i and i + 8, then 4,
// 2 and 1 apart: tree_sum16); the same in every lane, as float addition commutes.
__device__ __forceinline__ float group16_tree_sum(float e) {
#pragma unroll
  for (int h = kBlock / 2; h > 0; h /= 2) e = e + __shfl_xor_sync(~0u, e, h);
  return e;
}

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

__device__ __forceinline__ Candidate choose(float err6, float err4, const Candidate& c6,
                                            const Candidate& c4) {
  const bool map4 = prefer_map4(err4, err6);
  return Candidate{map4 ? c4.scale : c6.scale, map4 ? c4.enc : c6.enc, map4 ? c4.dec : c6.dec};
}

// The chosen candidate of a rowwise 1x16 chunk: value v of this lane, the
// chunk's 16 lanes together (every lane of the warp must call).
__device__ __forceinline__ Candidate row_chunk(float v, float bamax, const GlobalScales& g,
                                               FourOverSix fos) {
  Candidate c6, c4;
  candidates(bamax, g, c6, c4);
  float e6, e4;
  error_terms(v, c6, c4, g, fos, e6, e4);
  return choose(group16_sequential_sum(e6), group16_sequential_sum(e4), c6, c4);
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
  return choose(err6, err4, c6, c4);
}

// The chosen candidates of a 16x16 tile (16 lanes, 16 values each): for the
// rowwise copy on the tree sum of its row errors, for the columnwise copy (x^T)
// on the tree sum of its column errors (every lane of the warp must call).
__device__ __forceinline__ void tile(const float (&v)[kBlock], float bamax, const GlobalScales& g,
                                     FourOverSix fos, Candidate& row, Candidate& col) {
  Candidate c6, c4;
  candidates(bamax, g, c6, c4);
  // Row errors in tree order: rows r and r + 8 are added as they come.
  float row6[kBlock / 2], row4[kBlock / 2];
  float col6 = 0.0f, col4 = 0.0f;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    float e6, e4;
    error_terms(v[r], c6, c4, g, fos, e6, e4);
    col6 = col6 + e6;
    col4 = col4 + e4;
    const float r6 = group16_sequential_sum(e6), r4 = group16_sequential_sum(e4);
    row6[r % 8] = r < 8 ? r6 : row6[r % 8] + r6;
    row4[r % 8] = r < 8 ? r4 : row4[r % 8] + r4;
  }
#pragma unroll
  for (int h = kBlock / 4; h > 0; h /= 2) {
#pragma unroll
    for (int i = 0; i < h; ++i) {
      row6[i] = row6[i] + row6[i + h];
      row4[i] = row4[i] + row4[i + h];
    }
  }
  row = choose(row6[0], row4[0], c6, c4);
  col = choose(group16_tree_sum(col6), group16_tree_sum(col4), c6, c4);
}

}  // namespace nvfp4::cuda
