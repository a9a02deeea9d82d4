// IEEE subnormals for the code that runs in its scope.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace nvfp4 {

// XLA runs CPU code with flush-to-zero and denormals-are-zero set; the NVFP4
// numerics need IEEE subnormals (bf16-subnormal inputs, tiny products), as
// the GPU kernels keep them (nvcc -ftz=false), so every CPU kernel body, and
// every block of the CUDA host model, runs under this guard.
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

}  // namespace nvfp4
