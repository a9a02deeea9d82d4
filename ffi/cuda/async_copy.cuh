// Asynchronous bulk copies from global to shared memory that complete on mbarriers (sm_90 and
// later: cp.async.bulk, mbarrier.arrive.expect_tx, mbarrier.try_wait.parity), or in the host
// model its emulation of them (cuda/host/runtime.h), which checks their use.
#pragma once

#if !defined(NVFP4_CUDA_HOST)
#include <cuda.h>  // CUtensorMap and its encoder's types only: the driver is found at run time
#endif

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

// ---- bulk tensor copies (a tiled tensor map; cp.async.bulk.tensor) ----

#if defined(NVFP4_CUDA_HOST)
using TensorMap = host::TensorMap;
#define NVFP4_GRID_CONSTANT
#else
using TensorMap = CUtensorMap;
// A kernel parameter whose address a tensor copy takes: it stays in parameter space.
#define NVFP4_GRID_CONSTANT __grid_constant__
#endif

// Copies the box of the 3-d tensor `map` describes at element coordinates (x, y, z) (innermost
// first) into shared dst (128-byte aligned), the box's elements densely, innermost first, and
// elements outside the tensor as zeros; the whole box's bytes complete on bar (announced by an
// expect_tx of them). `map` is a NVFP4_GRID_CONSTANT kernel parameter.
__device__ __forceinline__ void tensor_load_3d(void* dst, const TensorMap* map, int32_t x,
                                               int32_t y, int32_t z, Mbarrier* bar NVFP4_CALLER) {
#if defined(NVFP4_CUDA_HOST)
  const int32_t at[3] = {x, y, z};
  host::tensor_load(dst, map, at, bar, NVFP4_CALLER_SITE);
#else
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(shared_address(bar))
      : "memory");
#endif
}

// Encodes `map` for the [batch, rows, cols] tensor of `element_bytes`-byte elements at base, rows
// cols elements apart, whose copies move boxes of box_rows x box_cols (of one batch entry): no
// interleave, no swizzle, zeros outside the tensor. False where the driver refuses it (a base not
// 16-byte aligned, rows not whole 16-byte chunks, ...) or has no encoder (CUDA runtime before
// 12.5): the caller then copies rows.
inline bool encode_tensor_map_3d(TensorMap& map, const void* base, uint32_t element_bytes,
                                 uint64_t cols, uint64_t rows, uint64_t batch, uint32_t box_cols,
                                 uint32_t box_rows) {
  const uint64_t dims[3] = {cols, rows, batch};
  const uint64_t strides[2] = {cols * element_bytes, rows * cols * element_bytes};
  const uint32_t box[3] = {box_cols, box_rows, 1};
#if defined(NVFP4_CUDA_HOST)
  return host::encode_tensor_map(&map, base, 3, element_bytes, dims, strides, box).empty();
#elif CUDART_VERSION >= 12050
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {  // the driver's, once a process
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // not left for the next launch's check
      return Encode(nullptr);
    }
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return false;
  const uint32_t ones[3] = {1, 1, 1};
  const CUtensorMapDataType type = element_bytes == 4   ? CU_TENSOR_MAP_DATA_TYPE_UINT32
                                   : element_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16
                                                        : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  return encode(&map, type, 3, const_cast<void*>(base), dims, strides, box, ones,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#else
  return false;
#endif
}

// encode_tensor_map_3d through a cache of the process's last kMapCacheEntries maps (a refusal
// too), keyed by everything the encode reads, so that a hit is the map it would encode. XLA runs a
// program on the same buffers call after call (its buffer assignment), so the driver's encode runs
// once per buffer and shape instead of on every call. One cache for every thread that launches.
constexpr int kMapCacheEntries = 8;
inline bool cached_tensor_map_3d(TensorMap& map, const void* base, uint32_t element_bytes,
                                 uint64_t cols, uint64_t rows, uint64_t batch, uint32_t box_cols,
                                 uint32_t box_rows) {
  struct Entry {
    const void* base;
    uint64_t shape[6];
    bool encoded;
    TensorMap map;
  };
  static std::mutex mutex;
  static Entry cache[kMapCacheEntries];
  static int filled = 0, next = 0;  // entries in use; the next one to replace
  const uint64_t shape[6] = {element_bytes, cols, rows, batch, box_cols, box_rows};
  const std::lock_guard<std::mutex> lock(mutex);
  for (int i = 0; i < filled; ++i)
    if (cache[i].base == base && std::equal(shape, shape + 6, cache[i].shape)) {
      map = cache[i].map;
      return cache[i].encoded;
    }
  Entry& e = cache[next];
  e.base = base;
  std::copy(shape, shape + 6, e.shape);
  e.map = TensorMap{};
  e.encoded =
      encode_tensor_map_3d(e.map, base, element_bytes, cols, rows, batch, box_cols, box_rows);
  next = (next + 1) % kMapCacheEntries;
  filled = std::min(filled + 1, kMapCacheEntries);
  map = e.map;
  return e.encoded;
}

// How long a thread waits on one phase of an mbarrier before it gives up: a correct phase completes
// in microseconds (its copies' time; milliseconds under a sanitizer or a time-sliced GPU), so a
// phase still open after 10 s never completes (a lost copy, a wrong byte count). The kernel then
// traps (`BPT.TRAP`: the launch fails, and with it the call, with an illegal-instruction error)
// rather than hanging the process. A debugger that stops the kernel mid-wait for longer trips it.
constexpr uint64_t kWaitLimitNs = 10'000'000'000ull;

#if !defined(NVFP4_CUDA_HOST)
// The GPU's global timer, in nanoseconds.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Whether the phase of parity `parity` of bar has completed (mbarrier.try_wait.parity, which
// suspends the thread for a while before it answers no).
__device__ __forceinline__ bool mbarrier_try_wait(Mbarrier* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(shared_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
#endif

// Returns once the phase of parity `parity` of bar has completed (its arrivals and bytes); traps
// after kWaitLimitNs (the host model reports a deadlock instead).
__device__ __forceinline__ void mbarrier_wait(Mbarrier* bar, uint32_t parity NVFP4_CALLER) {
#if defined(NVFP4_CUDA_HOST)
  host::mbarrier_wait(bar, parity, NVFP4_CALLER_SITE);
#else
  if (mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbarrier_try_wait(bar, parity))
    if (global_timer_ns() - start > kWaitLimitNs) __trap();
#endif
}

}  // namespace nvfp4::cuda
