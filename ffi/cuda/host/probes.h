// The host execution model's self-tests (probes.cu), called from the host module.
#pragma once

#include <string>
#include <vector>

namespace nvfp4::cuda::probes {

// Runs probe kernel `name` with arguments a, b, c and mask; its int output of `size` elements
// (-1 where nothing was written). Raises std::runtime_error with the launch error.
std::vector<int> probe(const std::string& name, int size, int a, int b, int c, unsigned mask);

}  // namespace nvfp4::cuda::probes
