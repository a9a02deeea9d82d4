// Helpers shared by the CPU FFI handlers: element loads, subnormal mode,
// a small parallel-for, and FFI buffer checks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nvfp4/numerics.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace nvfp4::cpu {

namespace ffi = xla::ffi;

// XLA runs CPU code with flush-to-zero and denormals-are-zero set; the NVFP4
// numerics need IEEE subnormals (bf16-subnormal inputs, tiny products), so
// every kernel body runs under this guard.
class SubnormalGuard {
 public:
#if defined(__x86_64__) || defined(__i386__)
  SubnormalGuard() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }  // FTZ | DAZ
  ~SubnormalGuard() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#elif defined(__aarch64__)
  SubnormalGuard() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t cleared = saved_ & ~(uint64_t(1) << 24);  // FZ
    asm volatile("msr fpcr, %0" ::"r"(cleared));
  }
  ~SubnormalGuard() { asm volatile("msr fpcr, %0" ::"r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

// Element loaders: every input dtype is read as an exact float32.
struct LoadBF16 {
  using T = uint16_t;
  static float load(T v) { return bf16_to_float(v); }
};
struct LoadF16 {
  using T = uint16_t;
  static float load(T v) { return f16_to_float(v); }
};
struct LoadF32 {
  using T = float;
  static float load(T v) { return v; }
};

// Calls fn(F32{}), fn(BF16{}) or fn(F16{}) for a float dtype; false for any
// other dtype. The tags are the loaders above or the dequantize storers.
template <typename F32, typename BF16, typename F16, typename Fn>
bool dispatch_float(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      fn(F32{});
      return true;
    case ffi::DataType::BF16:
      fn(BF16{});
      return true;
    case ffi::DataType::F16:
      fn(F16{});
      return true;
    default:
      return false;
  }
}

template <typename Fn>
bool dispatch_input(ffi::DataType dtype, Fn&& fn) {
  return dispatch_float<LoadF32, LoadBF16, LoadF16>(dtype, std::forward<Fn>(fn));
}

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

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "nvfp4: " + msg);
}

// Checks that a buffer is [B, rows, cols] and unpacks the dims.
inline bool dims3(const ffi::AnyBuffer& buf, int64_t& b, int64_t& rows, int64_t& cols) {
  const auto d = buf.dimensions();
  if (d.size() != 3) return false;
  b = d[0];
  rows = d[1];
  cols = d[2];
  return true;
}

inline int64_t packed_size(int64_t n) { return (n + 1) / 2; }
inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

}  // namespace nvfp4::cpu
