// Helpers of the CUDA FFI handlers: kernel launches with their error checks, grid sizes, and
// the stream context. Built for the GPU with nvcc, or with NVFP4_CUDA_HOST for the CPU over the
// host execution model (cuda/host/runtime.h), where the same launch code runs the grid there.
#pragma once

#if defined(NVFP4_CUDA_HOST)
#include "cuda/host/ffi_stream.h"
#include "cuda/host/runtime.h"
#else
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "nvfp4/ffi_common.h"

namespace nvfp4::cuda {

#if defined(NVFP4_CUDA_HOST)
using StreamContext = host::StreamContext;
#else
using StreamContext = ffi::PlatformStream<cudaStream_t>;  // the stream XLA runs the op on
#endif

inline ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("nvfp4: ") + what + ": " + cudaGetErrorString(err));
}

// Launches Kernel<<<grid, block, shared, stream>>>(args...) and returns its launch error (an
// invalid configuration, or an earlier asynchronous failure) as an FFI error.
template <auto Kernel, typename... Args>
ffi::Error launch(const char* op, dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                  const Args&... args) {
#if defined(NVFP4_CUDA_HOST)
  host::launch(host::kernel_name(__PRETTY_FUNCTION__), reinterpret_cast<const void*>(Kernel), grid,
               block, shared, stream, [&] { Kernel(args...); });
#else
  // clang-format reads a template argument's <<< >>> as template brackets.
  // clang-format off
  Kernel<<<grid, block, shared, stream>>>(args...);
  // clang-format on
#endif
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    return cuda_error((std::string(op) + " launch failed").c_str(), err);
  return ffi::Error::Success();
}

// Zeroes `bytes` at `ptr` on the stream (outputs that kernels then accumulate into atomically).
inline ffi::Error zero(void* ptr, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return ffi::Error::Success();
  if (const cudaError_t err = cudaMemsetAsync(ptr, 0, size_t(bytes), stream); err != cudaSuccess)
    return cuda_error("cudaMemsetAsync", err);
  return ffi::Error::Success();
}

// Whether the environment asks for the kernels that load through a ring of asynchronous copies
// (quantize's and the grouped quantize's), a switch for measuring them on a GPU
// (benchmarks/gpu_quantize.py), read on every call. NVFP4_QUANTIZE_LOAD unset: the direct
// kernels; "ring": the ring, the quantize kernel's filled by tensor copies where the input's
// tensor map encodes; "ring-rows": the ring filled by a bulk copy a row.
enum class RingLoad { kNone, kTensor, kRows };
inline RingLoad ring_load() {
  const char* load = std::getenv("NVFP4_QUANTIZE_LOAD");
  if (load == nullptr) return RingLoad::kNone;
  const std::string_view v(load);
  return v == "ring" ? RingLoad::kTensor : v == "ring-rows" ? RingLoad::kRows : RingLoad::kNone;
}
inline bool ring_asked() { return ring_load() != RingLoad::kNone; }

// Blocks for a grid-stride loop over n items: enough to fill the GPU, no more.
inline unsigned grid_stride_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return unsigned(std::clamp<int64_t>(blocks, 1, int64_t(1) << 16));
}

// The current device, as a key of once_per (in the host model, with the GPU it emulates: a
// kernel's attributes depend on it).
inline int device_key() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
#if defined(NVFP4_CUDA_HOST)
  device = device * 1000 + host::emulated_sm();
#endif
  return device;
}

// query() asked once per key and remembered, per call site (each lambda type has its own cache):
// the runtime's answers about a kernel and a device (attributes, occupancy) cost host time on
// every call otherwise. A failed query (ok false) is not remembered.
template <typename Key, typename Query>
auto once_per(const Key& key, Query query) {
  using Value = decltype(query(std::declval<bool&>()));
  static std::mutex mutex;
  static std::map<Key, Value> answers;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = answers.find(key); it != answers.end()) return it->second;
  bool ok = true;
  Value value = query(ok);
  if (ok) answers.emplace(key, value);
  return value;
}

// CUDA blocks of a persistent grid of Kernel (`threads` threads and `shared` dynamic bytes a
// block): as many as the current device holds at once, at most 4 per multiprocessor.
template <typename Kernel>
int resident_blocks(Kernel* kernel, int threads, size_t shared) {
  const auto key = std::tuple(reinterpret_cast<const void*>(kernel), threads, shared, device_key());
  return once_per(key, [&](bool& ok) {
    int device = 0, multiprocessors = 1, per_multiprocessor = 4;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess) {
      multiprocessors = 1;
      ok = false;
    }
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads,
                                                      shared) != cudaSuccess) {
      per_multiprocessor = 1;
      ok = false;
    }
    return std::clamp(per_multiprocessor, 1, 4) * std::max(multiprocessors, 1);
  });
}

// The block's dynamic shared memory (the launch's `shared` bytes), and its size.
__device__ __forceinline__ unsigned char* dynamic_shared() {
#if defined(NVFP4_CUDA_HOST)
  return host::dynamic_shared();
#else
  extern __shared__ __align__(128) unsigned char bytes[];  // 128: tensor copies land there
  return bytes;
#endif
}
__device__ __forceinline__ uint32_t dynamic_shared_size() {
#if defined(NVFP4_CUDA_HOST)
  return uint32_t(host::dynamic_shared_size());
#else
  uint32_t bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
#endif
}

// ---- magnitudes of input words (quantize and amax) ----

template <typename L>
constexpr bool kPacked = sizeof(typename L::T) == 2;  // bfloat16 or float16: two per word

// The larger magnitude of two words of dtype L (packed: of each half; the sign bits of a packed
// result are garbage, a NaN wins).
template <typename L>
__device__ __forceinline__ uint32_t max_magnitude(uint32_t a, uint32_t b) {
  if constexpr (kPacked<L>)
    return max_magnitude_x2<std::is_same_v<L, LoadBF16>>(a, b);
  else
    return max(a & 0x7FFFFFFFu, b & 0x7FFFFFFFu);
}

// The float value of a magnitude in the dtype's bits (the low half of a packed word; the sign
// bits may be garbage). A NaN stays a NaN, of any payload.
template <typename L>
__device__ __forceinline__ float magnitude_value(uint32_t m) {
  if constexpr (std::is_same_v<L, LoadBF16>)
    return fabsf(bits_float(m << 16));
  else if constexpr (kPacked<L>)
    return fabsf(L::load(uint16_t(m)));
  else
    return fabsf(bits_float(m));
}

// ---- amaxes accumulated as magnitude bits (atomicMax on the float's bits) ----

// Turns the magnitude bits into the amax floats in place, NaN canonical (a grid-stride loop). A
// template, so that each file that launches it has its own instance.
template <int = 0>
__global__ void amax_from_bits_kernel(uint32_t* bits, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    reinterpret_cast<float*>(bits)[i] = amax_from_bits(bits[i]);
}

inline ffi::Error finish_amax(const char* op, cudaStream_t stream, uint32_t* bits, int64_t n) {
  constexpr int kFinishThreads = 256;
  if (n <= 0) return ffi::Error::Success();
  return launch<amax_from_bits_kernel<>>(op, grid_stride_blocks(n, kFinishThreads), kFinishThreads,
                                         0, stream, bits, n);
}

}  // namespace nvfp4::cuda
