// Asynchronous bulk copies from global to shared memory that complete on mbarriers (sm_90 and
// later: cp.async.bulk, mbarrier.arrive.expect_tx, mbarrier.try_wait.parity), or in the host
// model its emulation of them (cuda/host/runtime.h), which checks their use.
#pragma once

#include "cuda/common.cuh"

namespace nvfp4::cuda {

#if defined(NVFP4_CUDA_HOST)
using Mbarrier = host::Mbarrier;
// The host model names the caller's line in its errors.
#define NVFP4_CALLER , const char *file = __builtin_FILE(), int line = __builtin_LINE()
#define NVFP4_CALLER_SITE ::nvfp4::host::caller_site(file, line)
#define NVFP4_CALLER_ARGS \
  , file, line  // passes the caller's site on to another NVFP4_CALLER function
#else
#define NVFP4_CALLER
#define NVFP4_CALLER_ARGS
struct alignas(8) Mbarrier {
  uint64_t state;
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
#endif

// Initializes bar for `arrivals` arrivals a phase (one thread; then mbarrier_init_fence and a
// block barrier before any thread uses it).
__device__ __forceinline__ void mbarrier_init(Mbarrier* bar, uint32_t arrivals NVFP4_CALLER) {
#if defined(NVFP4_CUDA_HOST)
  host::mbarrier_init(bar, arrivals, NVFP4_CALLER_SITE);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
#endif
}

// Makes this thread's initialized mbarriers visible to the asynchronous copies.
__device__ __forceinline__ void mbarrier_init_fence() {
#if !defined(NVFP4_CUDA_HOST)
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival on bar, announcing `bytes` of copies that complete on its current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(Mbarrier* bar,
                                                          uint32_t bytes NVFP4_CALLER) {
#if defined(NVFP4_CUDA_HOST)
  host::mbarrier_arrive_expect_tx(bar, bytes, NVFP4_CALLER_SITE);
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Orders this thread's earlier shared-memory accesses before the asynchronous copies it issues
// next (a copy into a buffer the block has just read).
__device__ __forceinline__ void fence_proxy_async() {
#if !defined(NVFP4_CUDA_HOST)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst,
// completing them on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          Mbarrier* bar NVFP4_CALLER) {
#if defined(NVFP4_CUDA_HOST)
  host::bulk_load(dst, src, bytes, bar, NVFP4_CALLER_SITE);
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
#endif
}

// Copies `rows` rows of `bytes` each (multiples of 16, 16-byte aligned), row r from
// src + r * src_stride to dst + r * dst_stride (elements), completing on bar, whose arrival (lane
// 0's) announces their bytes; first orders the block's earlier reads of dst before the copies.
// Every lane of one warp calls, after a block barrier that follows those reads.
template <typename T>
__device__ __forceinline__ void warp_bulk_load_rows(T* dst, int64_t dst_stride, const T* src,
                                                    int64_t src_stride, uint32_t rows,
                                                    uint32_t bytes, Mbarrier* bar NVFP4_CALLER) {
  const uint32_t lane = threadIdx.x % 32;
  if (lane == 0) mbarrier_arrive_expect_tx(bar, rows * bytes NVFP4_CALLER_ARGS);
  __syncwarp();
  fence_proxy_async();
  for (uint32_t r = lane; r < rows; r += 32)
    bulk_load(dst + r * dst_stride, src + r * src_stride, bytes, bar NVFP4_CALLER_ARGS);
}

// Returns once the phase of parity `parity` of bar has completed (its arrivals and bytes).
__device__ __forceinline__ void mbarrier_wait(Mbarrier* bar, uint32_t parity NVFP4_CALLER) {
#if defined(NVFP4_CUDA_HOST)
  host::mbarrier_wait(bar, parity, NVFP4_CALLER_SITE);
#else
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
#endif
}

}  // namespace nvfp4::cuda
