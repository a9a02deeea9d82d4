// Compiles the shared numerics (ffi/nvfp4/numerics.h) as device code for every
// target architecture, so a CUDA compile error in them fails the build.
#include "cuda/handlers.h"
#include "nvfp4/numerics.h"

namespace nvfp4::cuda {

__global__ void numerics_compile_check(const float* x, float amax, uint8_t* codes, uint8_t* scales,
                                       float* out) {
  const GlobalScales g = global_scales(amax);
  const uint8_t s = block_scale(x[0], g);
  codes[0] = quantize_value(x[1], block_encode_scale(s, g));
  scales[0] = s;
  out[0] = dequantize_value(codes[0], s, g.decode) + bf16_to_float(float_to_bf16(x[2])) +
           f16_to_float(float_to_f16(x[3]));
}

std::vector<std::pair<const char*, Handler*>> handlers() { return {}; }

}  // namespace nvfp4::cuda
