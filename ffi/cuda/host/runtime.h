// The CUDA host execution model: the part of CUDA our kernels use, run on the CPU.
//
// A test-only build (CMake option NVFP4_CUDA_HOST) compiles the unchanged .cu sources with the
// host C++ compiler against this header instead of <cuda_runtime.h>. A launch runs the whole
// grid: blocks spread over worker threads, the threads of a block as fibers on one worker, so
// that __syncthreads() is a real barrier and a warp exchange waits for the lanes it names. What
// a GPU would hang or corrupt on ends the launch with cudaErrorLaunchFailure, whose error string
// names the kernel, block, thread and cause (the handlers return it as an FFI error):
//   - a warp exchange (__shfl*_sync, __ballot_sync, __syncwarp) whose mask leaves out the calling
//     lane, names a lane that does not exist, reads a lane outside the mask, or names a lane that
//     never arrives (it exited, waits at a __syncthreads(), or at another exchange or mask);
//   - a __syncthreads() that some thread of the block never reaches;
//   - lanes that meet at different call sites (stricter than sm_70+ needs: a sign of divergence);
//   - a launch or memset on the default stream (XLA passes the stream to use).
// Launches outside the hardware's limits fail as on the GPU: cudaErrorInvalidConfiguration
// (or cudaErrorInvalidValue for shared memory), returned by the next cudaGetLastError().
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>

#include "nvfp4/ptx.h"  // emulated_sm()

// ---- CUDA keywords ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static storage, one copy per worker thread: a worker runs one block at a time, all its threads.
#define __shared__ static thread_local

// ---- runtime types and errors (codes as in the CUDA runtime) ----
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,  // in the model: what a GPU would hang or corrupt on (see above)
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);
// One device, with nvfp4::host::kMultiprocessors multiprocessors.
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);

namespace nvfp4::host {

// sm_90's limits on a launch.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned kMaxGridDim[3] = {0x7FFFFFFFu, 65535, 65535};
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // without cudaFuncSetAttribute
// The opt-in maximum of shared memory per block (static and dynamic): 227 KB on sm_90 and sm_100,
// 99 KB on sm_120 (consumer Blackwell has 100 KB a multiprocessor).
size_t max_shared_per_block();
constexpr int kWarpSize = 32;
// Few, so that persistent grids loop over several tiles per block in the tests.
constexpr int kMultiprocessors = 2;

// The built-in variables of the running thread (set by the scheduler on every switch).
extern thread_local uint3 thread_idx, block_idx;
extern thread_local dim3 block_dim, grid_dim;

// The GPU the model stands for (90, 100, 120): which sm-specific code paths run (emulated_sm() is
// inline, in ffi/nvfp4/ptx.h).
void set_emulated_sm(int sm);

// A stream object for the handlers (XLA passes one; the model runs every launch synchronously).
cudaStream_t xla_stream();

cudaError_t set_max_dynamic_shared(const void* kernel, size_t bytes);

// The running block's dynamic shared memory: the launch's `shared` bytes, one buffer per worker
// (a worker runs one block at a time), filled with garbage at each launch as a GPU's is.
unsigned char* dynamic_shared();
size_t dynamic_shared_size();

// Blocks of `threads` threads and `shared` dynamic bytes a multiprocessor holds at once, from
// sm_90's limits (2048 threads, 32 blocks, 228 KB of shared memory with 1 KB reserved per block;
// the model does not see static shared memory, so it counts 48 KB for it).
int blocks_per_multiprocessor(int threads, size_t shared);

// Runs `thread` once per thread of the grid; the launch error, or cudaSuccess once it finished.
cudaError_t launch(const std::string& kernel_name, const void* kernel, dim3 grid, dim3 block,
                   size_t shared, cudaStream_t stream, const std::function<void()>& thread);

// ---- asynchronous bulk copies into shared memory, completing on mbarriers (sm_90) ----
//
// A copy's destination holds kInFlight bytes from its issue until it completes, and reading or
// writing it (through cuda/memory.cuh's shared accesses) fails the launch until the reading thread
// has waited on the copy's mbarrier for the copy's phase: a missing wait is an error, not a race a
// test may or may not see. Copies complete when a thread waits on their mbarrier. Failing too: a
// copy of a size or address not a multiple of 16, two copies in flight into the same bytes, more
// bytes completed than expect_tx announced, a block that exits with a copy in flight, and a wait
// no thread can end (a deadlock: the message names the mbarrier's pending arrivals and bytes).
constexpr unsigned char kInFlight = 0x5A;

// An mbarrier: phases completed, arrivals a phase takes, arrivals pending, transaction bytes
// announced and not yet completed.
struct Mbarrier {
  uint32_t phase, arrivals;
  int32_t pending;
  int64_t tx;
};
// "file:line", kept for the process (the site of a wrapper's caller: __builtin_FILE/LINE).
const char* caller_site(const char* file, int line);
void mbarrier_init(Mbarrier* bar, uint32_t arrivals, const char* site);
void mbarrier_arrive_expect_tx(Mbarrier* bar, uint32_t bytes, const char* site);
void bulk_load(void* dst, const void* src, uint32_t bytes, Mbarrier* bar, const char* site);
// Returns once the phase of parity `parity` of bar has completed.
void mbarrier_wait(Mbarrier* bar, uint32_t parity, const char* site);

// ---- tensor maps and the bulk tensor copies through them (sm_90: cuTensorMapEncodeTiled, then
// cp.async.bulk.tensor in tile mode, no interleave, no swizzle, zero fill) ----
//
// A tiled tensor map as the model holds it (a GPU's is an opaque 128-byte object): the tensor's
// base, its dimensions (elements, innermost first), the byte strides of dimensions 1.., and the box
// a copy moves. A copy's box lands in shared memory densely, innermost dimension first; elements
// outside the tensor arrive as zeros, and the copy completes the whole box's bytes.
constexpr uint32_t kMaxTensorRank = 3;  // the model's (the driver's: 5)
struct TensorMap {
  const unsigned char* base;
  uint32_t rank, element_bytes;
  // Dimensions past the rank: dims and box 1.
  uint64_t dims[kMaxTensorRank], strides[kMaxTensorRank];  // strides[0]: element_bytes
  uint32_t box[kMaxTensorRank];
  bool encoded;  // by encode_tensor_map
};
// Encodes map as cuTensorMapEncodeTiled does, checking what its documentation requires (a base
// 16-byte aligned; dimensions 1..2^32; strides multiples of 16 below 2^40, each at least the
// extent of the dimension below it; box sizes 1..256, the innermost of a multiple of 16 bytes).
// Returns the first requirement broken, or "" (encoded).
std::string encode_tensor_map(TensorMap* map, const void* base, uint32_t rank,
                              uint32_t element_bytes, const uint64_t* dims, const uint64_t* strides,
                              const uint32_t* box);
// How many maps encode_tensor_map has encoded in this process (the handlers' cache keeps it to one
// per buffer and shape).
uint64_t tensor_map_encodes();
// Copies map's box at element coordinates `at` (rank of them, innermost first) into shared dst,
// completing on bar. Fails the launch as bulk_load does, and where the map was never encoded or
// dst is not 128-byte aligned.
void tensor_load(void* dst, const TensorMap* map, const int32_t* at, Mbarrier* bar,
                 const char* site);
// Fails the launch where the running thread's shared-memory access of [p, p + bytes) touches an
// asynchronous copy's destination before it completed, or (a load) before this thread waited for
// it.
void check_shared_access(const void* p, size_t bytes, bool store, const char* site);

enum class WarpOp { kIdx, kUp, kDown, kXor, kBallot, kSync };

// One lane's part of a warp exchange: waits for the lanes named in `mask`; returns the value this
// lane receives (the ballot for kBallot).
uint64_t warp_exchange(const char* site, WarpOp op, unsigned mask, uint64_t value, int lane_arg,
                       int width);
void syncthreads(const char* site);

// The kernel's name from launch<Kernel>'s __PRETTY_FUNCTION__ (its template argument).
std::string kernel_name(const char* pretty_function);

}  // namespace nvfp4::host

#define NVFP4_HOST_STR2(x) #x
#define NVFP4_HOST_STR(x) NVFP4_HOST_STR2(x)
#define NVFP4_HOST_SITE __FILE__ ":" NVFP4_HOST_STR(__LINE__)

#define threadIdx (::nvfp4::host::thread_idx)
#define blockIdx (::nvfp4::host::block_idx)
#define blockDim (::nvfp4::host::block_dim)
#define gridDim (::nvfp4::host::grid_dim)
#define warpSize (::nvfp4::host::kWarpSize)

#define __syncthreads() ::nvfp4::host::syncthreads(NVFP4_HOST_SITE)
#define __syncwarp(...) ::nvfp4::host::syncwarp(NVFP4_HOST_SITE, ##__VA_ARGS__)
#define __shfl_sync(...) \
  ::nvfp4::host::shfl(NVFP4_HOST_SITE, ::nvfp4::host::WarpOp::kIdx, __VA_ARGS__)
#define __shfl_up_sync(...) \
  ::nvfp4::host::shfl(NVFP4_HOST_SITE, ::nvfp4::host::WarpOp::kUp, __VA_ARGS__)
#define __shfl_down_sync(...) \
  ::nvfp4::host::shfl(NVFP4_HOST_SITE, ::nvfp4::host::WarpOp::kDown, __VA_ARGS__)
#define __shfl_xor_sync(...) \
  ::nvfp4::host::shfl(NVFP4_HOST_SITE, ::nvfp4::host::WarpOp::kXor, __VA_ARGS__)
#define __ballot_sync(mask, predicate) ::nvfp4::host::ballot(NVFP4_HOST_SITE, mask, predicate)

namespace nvfp4::host {

// __shfl*_sync of any 4- or 8-byte value, as its bits.
template <typename T>
T shfl(const char* site, WarpOp op, unsigned mask, T var, int lane_arg, int width = kWarpSize) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t),
                "shuffle of this type");
  uint64_t bits = 0;
  __builtin_memcpy(&bits, &var, sizeof(T));
  bits = warp_exchange(site, op, mask, bits, lane_arg, width);
  T out;
  __builtin_memcpy(&out, &bits, sizeof(T));
  return out;
}
inline unsigned ballot(const char* site, unsigned mask, int predicate) {
  return unsigned(warp_exchange(site, WarpOp::kBallot, mask, predicate != 0, 0, kWarpSize));
}
inline void syncwarp(const char* site, unsigned mask = 0xFFFFFFFFu) {
  warp_exchange(site, WarpOp::kSync, mask, 0, 0, kWarpSize);
}

}  // namespace nvfp4::host

// ---- atomics (device-wide: blocks run on several worker threads) ----
template <typename T>
T nvfp4_host_atomic_max(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (old < value && !ref.compare_exchange_weak(old, value)) {
  }
  return old;
}
inline unsigned int atomicMax(unsigned int* a, unsigned int v) {
  return nvfp4_host_atomic_max(a, v);
}
inline int atomicMax(int* a, int v) { return nvfp4_host_atomic_max(a, v); }
inline unsigned long long atomicMax(unsigned long long* a, unsigned long long v) {
  return nvfp4_host_atomic_max(a, v);
}
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) {
  return std::atomic_ref<unsigned int>(*a).fetch_add(v);
}
inline int atomicAdd(int* a, int v) { return std::atomic_ref<int>(*a).fetch_add(v); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*a).fetch_add(v);
}
inline float atomicAdd(float* a, float v) { return std::atomic_ref<float>(*a).fetch_add(v); }
inline unsigned int atomicCAS(unsigned int* a, unsigned int compare, unsigned int v) {
  std::atomic_ref<unsigned int>(*a).compare_exchange_strong(compare, v);
  return compare;  // the old value, whether or not it was replaced
}
inline int atomicCAS(int* a, int compare, int v) {
  std::atomic_ref<int>(*a).compare_exchange_strong(compare, v);
  return compare;
}

// ---- device math: min/max of integers as CUDA's overloads (the usual arithmetic conversions) ----
template <typename A, typename B,
          std::enable_if_t<std::is_integral_v<A> && std::is_integral_v<B>, int> = 0>
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
template <typename A, typename B,
          std::enable_if_t<std::is_integral_v<A> && std::is_integral_v<B>, int> = 0>
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}

// The PTX architecture a kernel's code was built for: the emulated GPU's (its code paths).
struct cudaFuncAttributes {
  int ptxVersion;
};
template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, Kernel* kernel) {
  (void)kernel;
  attr->ptxVersion = ::nvfp4::host::emulated_sm();
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel* kernel, int threads,
                                                          size_t shared) {
  (void)kernel;
  *blocks = ::nvfp4::host::blocks_per_multiprocessor(threads, shared);
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0)
    return cudaErrorInvalidValue;
  return ::nvfp4::host::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel),
                                               size_t(value));
}
