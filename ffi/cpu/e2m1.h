// E2M1 rounding to nearest written for the CPU's vector loops: the grid position of a magnitude
// by three roundings (no compare chain), its code and its grid value.
#pragma once

#include <cmath>
#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4::cpu {

// The E2M1 grid position of a >= 0 (its code magnitude 0..7, as a float): the E2M1 grid has
// steps of 1/2 below 2, 1 up to 4 and 2 up to 6, so it is min(rint(2a), rint(a) + 2, rint(a/2)
// + 4, 7), every operation exact and rint rounding ties to even as the grid's codes do (an even
// code is an even mantissa). A NaN gives a NaN, which no caller reads.
inline float e2m1_position(float a) {
  float c = std::rint(a * 2.0f);
  const float c2 = std::rint(a) + 2.0f, c4 = std::rint(a * 0.5f) + 4.0f;
  c = c2 < c ? c2 : c;
  c = c4 < c ? c4 : c;
  return 7.0f < c ? 7.0f : c;
}

// The E2M1 magnitude of grid position c (e2m1_to_float of code c): c / 2, c - 2 or 2c - 8.
inline float e2m1_grid(float c) {
  const float h = c * 0.5f, m = c - 2.0f, t = (c + c) - 8.0f;
  const float r = h < m ? m : h;
  return r < t ? t : r;
}

// float_to_e2m1(y) (nvfp4/numerics.h) computed from the grid position, for the CPU loops: NaN
// gives 0 and the sign bit 8 as there. Checked equal to float_to_e2m1 for all 2^32 inputs; its
// vector code is about twice as fast as the seven compares'.
inline uint32_t e2m1_code(float y) {
  const float a = std::fabs(y);
  const uint32_t m = a == a ? uint32_t(int32_t(e2m1_position(a))) : 0u;
  return m | (y < 0.0f ? 8u : 0u);
}

// The packed byte of two values with their encode scales (quantize_value), v0 in the low nibble.
inline uint32_t encode_pair(float v0, float e0, float v1, float e1) {
  return e2m1_code(v0 * e0) | (e2m1_code(v1 * e1) << 4);
}

}  // namespace nvfp4::cpu
