// Kernels that test the host execution model itself (tests/cuda/test_cuda_host_model.py): what each
// warp exchange returns, that __syncthreads() is a barrier, atomics across blocks, the launch
// limits, and the misuse the model must abort on. Written as CUDA, as our kernels are.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "cuda/async_copy.cuh"
#include "cuda/common.cuh"
#include "cuda/host/probes.h"
#include "cuda/memory.cuh"

namespace nvfp4::cuda::probes {
namespace {

// out[t] = what thread t receives from each exchange with argument `arg` and `width`.
__global__ void shuffles(int op, int arg, int width, unsigned mask, int* out) {
  const int t = int(threadIdx.x);
  if (!(mask >> (t % 32) & 1u)) return;  // lanes outside the mask take no part
  const int v = 1000 + t;
  switch (op) {
    case 0:
      out[t] = __shfl_sync(mask, v, arg, width);
      break;
    case 1:
      out[t] = __shfl_up_sync(mask, v, unsigned(arg), width);
      break;
    case 2:
      out[t] = __shfl_down_sync(mask, v, unsigned(arg), width);
      break;
    case 3:
      out[t] = __shfl_xor_sync(mask, v, arg, width);
      break;
    default:
      out[t] = int(__ballot_sync(mask, t % arg == 0));
  }
}

// out[0] = the sum of every thread's index, read by thread 0 after a barrier; a model without a
// real barrier gives thread 0's partial sum.
__global__ void barrier_sum(int* out) {
  __shared__ int values[1024];
  values[threadIdx.x] = int(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) sum += values[i];
    out[blockIdx.x] = sum;
  }
  __syncthreads();  // values is reused by the next block on this worker
}

// Every thread of every block: atomicAdd 1, atomicMax its global index, and one atomicCAS per
// block.
__global__ void atomics(unsigned* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&out[0], 1u);
  atomicMax(&out[1], i);
  if (threadIdx.x == 0) atomicCAS(&out[2 + blockIdx.x], 0u, blockIdx.x + 1);
}

__global__ void opt_in_shared(int* out) { out[threadIdx.x] = 1; }

__global__ void mask_leaves_out_caller(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(threadIdx.x == 5 ? 0xFFFFFFDFu : ~0u, int(threadIdx.x), 1);
}

__global__ void lane_exits_before_shuffle(int* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(~0u, int(threadIdx.x), 1);
}

__global__ void barrier_in_branch(int* out) {
  if (threadIdx.x < 40) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void shuffle_reads_outside_mask(int* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xFFFFu, int(threadIdx.x), 16, 32);  // lane 0 reads lane 16
}

__global__ void divergent_sites(int* out) {
  if (threadIdx.x % 2)
    out[threadIdx.x] = __shfl_xor_sync(~0u, 1, 1);
  else
    out[threadIdx.x] = __shfl_xor_sync(~0u, 2, 1);
}

__global__ void mask_names_missing_lanes(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(~0u, 1, 1);
}

// For the profiler's counters (cuda/host/trace.h): lane l loads shared word l * stride (mod 1024)
// and stores it to out[l * out_stride]; lanes named in `mask` store a second time, predicated.
__global__ void access_pattern(int stride, int out_stride, unsigned mask, int* out) {
  __shared__ int words[1024];
  const int lane = int(threadIdx.x);
  for (int i = lane; i < 1024; i += int(blockDim.x)) words[i] = i;
  __syncthreads();
  const int v = NVFP4_LDS(words + lane * stride % 1024);
  NVFP4_STG(out + lane * out_stride, v);
  NVFP4_STG_IF(mask >> lane & 1u, out + lane * out_stride, v);
}

// A two-stage ring of bulk copies (cuda/async_copy.cuh): buf[256 + i] = 2 buf[i] for 256 ints,
// 16 a copy, one warp. `mode` plants one mistake the host model must catch (BulkMistake).
enum BulkMistake {
  kNone,
  kNoWait,
  kShortTx,
  kMisaligned,
  kExitInFlight,
  kOverwrite,
  kWrongParity,
  kOnlyOneWaits
};

__global__ void bulk_ring(int mode, int* buf) {
  __shared__ uint4 stage4[2][4];  // 16-byte aligned
  int (*stage)[16] = reinterpret_cast<int (*)[16]>(stage4);
  __shared__ Mbarrier full[2];
  const int t = int(threadIdx.x);
  if (t == 0) {
    mbarrier_init(&full[0], 1);
    mbarrier_init(&full[1], 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  const auto issue = [&](int k) {
    if (t != 0) return;
    mbarrier_arrive_expect_tx(&full[k % 2], mode == kShortTx ? 128 : 64);
    bulk_load(stage[k % 2], buf + 16 * k, mode == kMisaligned ? 24 : 64, &full[k % 2]);
    if (mode == kOverwrite) bulk_load(stage[k % 2], buf + 16 * k, 64, &full[k % 2]);
  };
  issue(0);
  for (int k = 0; k < 16; ++k) {
    if (k + 1 < 16) issue(k + 1);  // its stage was last read before the previous barrier
    const uint32_t parity = uint32_t(k / 2) & 1u;
    if (mode != kNoWait && (mode != kOnlyOneWaits || t == 0))
      mbarrier_wait(&full[k % 2], mode == kWrongParity ? parity ^ 1u : parity);
    if (t < 16) buf[256 + 16 * k + t] = 2 * NVFP4_LDS(&stage[k % 2][t]);
    __syncthreads();
  }
  if (mode == kExitInFlight && t == 0) {
    mbarrier_arrive_expect_tx(&full[0], 64);
    bulk_load(stage[0], buf, 64, &full[0]);
  }
}

// Tensor copies (cuda/async_copy.cuh) from the [2, 5, 24] int tensor buf[0, 240) in boxes of 4
// rows x 8 columns, box k (of kTensorBoxes) at coordinates kBoxAt[k] (column, row, entry: some
// past an edge, whose elements arrive as zeros) into out[32 k, 32 k + 32). `mode` plants one
// mistake the host model must catch (TensorMistake).
enum TensorMistake { kTensorNone, kUnencoded, kUnaligned, kBoxTxShort };
constexpr int kTensorBoxes = 6;
constexpr int32_t kBoxAt[kTensorBoxes][3] = {{0, 0, 0},   {16, 1, 0}, {20, 3, 1},
                                             {-4, -2, 1}, {8, 4, 0},  {0, 0, 2}};

__global__ void tensor_boxes(int mode, int* out, const NVFP4_GRID_CONSTANT TensorMap map) {
  struct alignas(128) Stage {  // where tensor copies land
    int v[64];
  };
  __shared__ Stage staged;
  int* stage = staged.v;
  __shared__ Mbarrier full;
  const int t = int(threadIdx.x);
  if (t == 0) {
    mbarrier_init(&full, 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  for (int k = 0; k < kTensorBoxes; ++k) {
    if (t == 0) {
      mbarrier_arrive_expect_tx(&full, mode == kBoxTxShort ? 64 : 128);
      const int* at = kBoxAt[k];
      tensor_load_3d(stage + (mode == kUnaligned ? 4 : 0), &map, at[0], at[1], at[2], &full);
    }
    mbarrier_wait(&full, uint32_t(k) & 1u);
    out[32 * k + t] = NVFP4_LDS(stage + t);
    __syncthreads();
  }
}

// The first requirement of cuTensorMapEncodeTiled that case `which` breaks (TensorMap), or "".
std::string tensor_map_refusal(int which, const int* buf) {
  uint64_t dims[3] = {24, 5, 2}, strides[2] = {96, 480};
  uint32_t box[3] = {8, 4, 1};
  const void* base = buf;
  switch (which) {
    case 1:
      base = buf + 1;
      break;
    case 2:
      dims[1] = 0;
      break;
    case 3:
      strides[0] = 100;
      break;
    case 4:
      strides[1] = 96 * 4;  // under the 5 rows of 96 bytes it spans
      break;
    case 5:
      box[1] = 257;
      break;
    case 6:
      box[0] = 3;  // 12 bytes
      break;
  }
  host::TensorMap map{};
  return host::encode_tensor_map(&map, base, 3, 4, dims, strides, box);
}

ffi::Error run(const std::string& name, std::vector<int>& out, int a, int b, int c, unsigned mask) {
  const cudaStream_t s = host::xla_stream();
  int* o = out.data();
  if (name == "shuffles") return launch<shuffles>("probe", 1, 64, 0, s, a, b, c, mask, o);
  if (name == "barrier_sum") return launch<barrier_sum>("probe", unsigned(a), unsigned(b), 0, s, o);
  if (name == "atomics")
    return launch<atomics>("probe", unsigned(a), unsigned(b), 0, s, reinterpret_cast<unsigned*>(o));
  if (name == "launch")
    return launch<barrier_sum>("probe", dim3(1, unsigned(a), unsigned(b)), unsigned(c), 0, s, o);
  if (name == "shared") return launch<barrier_sum>("probe", 1, 32, size_t(a), s, o);
  if (name == "shared_opt_in") {  // a bytes of dynamic shared memory after opting in to b
    const cudaError_t err =
        cudaFuncSetAttribute(opt_in_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, b);
    cudaGetLastError();  // the error is returned here, not left for the launch
    if (err != cudaSuccess) return cuda_error("cudaFuncSetAttribute", err);
    return launch<opt_in_shared>("probe", 1, 32, size_t(a), s, o);
  }
  if (name == "default_stream") return launch<barrier_sum>("probe", 1, 32, 0, nullptr, o);
  if (name == "mask_leaves_out_caller")
    return launch<mask_leaves_out_caller>("probe", 1, 32, 0, s, o);
  if (name == "lane_exits_before_shuffle")
    return launch<lane_exits_before_shuffle>("probe", 1, 32, 0, s, o);
  if (name == "barrier_in_branch") return launch<barrier_in_branch>("probe", 1, 64, 0, s, o);
  if (name == "shuffle_reads_outside_mask")
    return launch<shuffle_reads_outside_mask>("probe", 1, 32, 0, s, o);
  if (name == "divergent_sites") return launch<divergent_sites>("probe", 1, 32, 0, s, o);
  if (name == "mask_names_missing_lanes")
    return launch<mask_names_missing_lanes>("probe", 1, 48, 0, s, o);
  if (name == "bulk_ring") {
    for (int i = 0; i < 256; ++i) o[i] = i;
    return launch<bulk_ring>("probe", 1, 32, 0, s, a, o);
  }
  if (name == "tensor_boxes") {
    std::vector<int> tensor(240);
    for (int i = 0; i < 240; ++i) tensor[size_t(i)] = i + 1;
    TensorMap map{};
    if (a != kUnencoded && !encode_tensor_map_3d(map, tensor.data(), 4, 24, 5, 2, 8, 4))
      throw std::logic_error("the probe's tensor map did not encode");
    return launch<tensor_boxes>("probe", 1, 32, 0, s, a, o, map);
  }
  if (name == "tensor_map_refusal") {
    const std::vector<int> tensor(256);
    const std::string refused = tensor_map_refusal(a, tensor.data());
    if (!refused.empty()) throw std::runtime_error(refused);
    return ffi::Error::Success();
  }
  if (name == "access_pattern") {  // into a 128-byte aligned buffer: sectors counted from its start
    struct alignas(128) Line {
      int v[32];
    };
    std::vector<Line> lines((out.size() + 31) / 32);
    int* aligned = lines[0].v;
    std::copy(out.begin(), out.end(), aligned);
    ffi::Error e = launch<access_pattern>("probe", 1, 32, 0, s, a, b, mask, aligned);
    std::copy(aligned, aligned + out.size(), out.begin());
    return e;
  }
  throw std::invalid_argument("no probe " + name);
}

}  // namespace

std::vector<int> probe(const std::string& name, int size, int a, int b, int c, unsigned mask) {
  std::vector<int> out(size_t(size), -1);
  if (name == "atomics") std::memset(out.data(), 0, out.size() * sizeof(int));
  ffi::Error e = run(name, out, a, b, c, mask);
  if (e.failure()) throw std::runtime_error(e.message());
  return out;
}

}  // namespace nvfp4::cuda::probes
