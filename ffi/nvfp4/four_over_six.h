// 4over6 adaptive block scaling, shared by the CPU and CUDA kernels.
//
// Every block is quantized with two candidate scales: map-6 (the block's max on
// E2M1 6) and map-4 (a 1.5x larger scale, the max on 4, so the values use the
// finer low end of the grid). The candidate with the smaller error is kept;
// ties and NaN errors keep map-6. Exact float32 numerics of
// jax_nvfp4/reference/four_over_six.py (tests/golden/README.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "nvfp4/numerics.h"

namespace nvfp4 {

// The 4over6 error mode of a QuantizeSpec: 0 off, 1 MAE, 2 MSE.
constexpr int32_t kFourOverSixOff = 0;
constexpr int32_t kFourOverSixMae = 1;
constexpr int32_t kFourOverSixMse = 2;

struct FourOverSix {
  int32_t mode;    // kFourOverSix*
  bool fast_math;  // the error of TransformerEngine's fast kernel: d = q s - fp32(x ges)

  NVFP4_HD bool on() const { return mode != kFourOverSixOff; }
  NVFP4_HD bool mse() const { return mode == kFourOverSixMse; }
};

// The two candidate scales (E4M3 codes) of a block with max magnitude `bamax`:
// base = fp32(bamax / 6) * ges (not the default path's bamax * fp32(ges / 6)),
// s6 = E4M3(clamp(base)), s4 = E4M3(clamp(fp32(base * 1.5))). The clamp stays
// 448 whatever the spec's range E.
struct Candidates {
  uint8_t s6, s4;
};

// The map-6 candidate's scale before rounding: fp32(bamax / 6) * ges.
NVFP4_HD float candidate_base(float bamax, const GlobalScales& g) {
  return (bamax / kE2M1Max) * g.encode;
}

NVFP4_HD Candidates candidate_scales(float bamax, const GlobalScales& g) {
  const float base = candidate_base(bamax, g);
  return Candidates{float_to_e4m3(clamp_e4m3(base)), float_to_e4m3(clamp_e4m3(base * 1.5f))};
}

// One element's error term for a candidate: its E2M1 code, its decoded block
// scale and the element x. q * s is exact (at most 8 significant bits).
//   exact:     d = fp32(fp32(q s * amax) / fp32(6 E)) - x
//   fast_math: d = q s - fp32(x * ges)
// -> |d| (MAE) or d * d (MSE). The caller sums the 16 terms of a 1x16 chunk in
// element order, from 0 (the terms are never -0).
NVFP4_HD float element_error(uint8_t code, float scale, float x, float ges, float amax,
                             float divisor, bool mse, bool fast_math) {
  const float qs = e2m1_to_float(code) * scale;
  const float d = fast_math ? qs - x * ges : (qs * amax) / divisor - x;
  return mse ? d * d : fabsf(d);
}

NVFP4_HD float element_error(uint8_t code, float scale, float x, const GlobalScales& g, bool mse,
                             bool fast_math) {
  return element_error(code, scale, x, g.encode, g.amax, g.divisor, mse, fast_math);
}

// map-4 iff its error is smaller; ties and NaN (every comparison false) keep map-6.
NVFP4_HD bool prefer_map4(float err4, float err6) { return err4 < err6; }

// One level of tree_sum16: r_i += r_{i+h} for i < h, written out (no loop: nvcc left a loop here
// rolled, with r in local memory).
template <int kH, size_t... kI>
NVFP4_HD void tree_level(float (&r)[kBlock], std::index_sequence<kI...>) {
  ((r[kI] = r[kI] + r[kI + kH]), ...);
}

// The error of a 16x16 block from its 16 chunk errors: a tree (r_i + r_{i+8},
// then 4, 2 and 1 apart), not the sequential sum. Overwrites r.
NVFP4_HD float tree_sum16(float (&r)[kBlock]) {
  tree_level<8>(r, std::make_index_sequence<8>{});
  tree_level<4>(r, std::make_index_sequence<4>{});
  tree_level<2>(r, std::make_index_sequence<2>{});
  tree_level<1>(r, std::make_index_sequence<1>{});
  return r[0];
}

}  // namespace nvfp4
