// Helpers of the CPU FFI handlers: a small parallel-for
// (the loaders, dispatch and buffer checks are in nvfp4/ffi_common.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "nvfp4/ffi_common.h"
#include "nvfp4/subnormal_guard.h"

namespace nvfp4::cpu {

// Runs body(begin, end) over [0, n) split across hardware threads when the
// work (`cost`, roughly bytes touched) is large enough to pay for the threads.
template <typename Body>
void parallel_for(int64_t n, int64_t cost, Body&& body) {
  constexpr int64_t kMinCostPerThread = int64_t(1) << 20;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::min({hw, n, std::max<int64_t>(1, cost / kMinCostPerThread)});
  if (threads <= 1) {
    SubnormalGuard guard;
    body(int64_t(0), n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = std::min(n, t * chunk), end = std::min(n, begin + chunk);
    pool.emplace_back([&body, begin, end] {
      SubnormalGuard guard;
      body(begin, end);
    });
  }
  {
    SubnormalGuard guard;
    body(int64_t(0), std::min(n, chunk));
  }
  for (auto& th : pool) th.join();
}

// The RHT (rht16, before rounding to the input dtype) of every column of a
// 16-row block v [16][width], in place: the same float32 operations as rht16,
// vectorized across the columns.
inline void rht_rows(float* __restrict v, int64_t width) {
  for (int i = 0; i < kBlock; ++i) {
    if (!((kRhtNegative >> i) & 1u)) continue;
    float* __restrict row = v + i * width;
    for (int64_t c = 0; c < width; ++c) row[c] = -row[c];
  }
  for (int h = 1; h < kBlock; h *= 2) {
    for (int i = 0; i < kBlock; ++i) {
      if (i & h) continue;
      float* __restrict lo = v + i * width;
      float* __restrict hi = v + (i + h) * width;
      for (int64_t c = 0; c < width; ++c) {
        const float a = lo[c], b = hi[c];
        lo[c] = a + b;
        hi[c] = a - b;
      }
    }
  }
  for (int64_t k = 0; k < kBlock * width; ++k) v[k] = v[k] * 0.25f;
}

}  // namespace nvfp4::cpu
