// Global amax on the GPU: max |x| per batch entry, as an integer max over
// magnitude bits (exact, and any NaN wins and comes out canonical), like the
// CPU kernel; entries of whole 16-byte vectors are read a vector a load, bfloat16 and float16
// reduced two values an instruction. With `rht_amax` the same pass also gives the amax of the
// Random Hadamard Transform of x^T: each thread reads 16 rows of one column (a chunk), keeps them
// in registers and transforms them. Per row (per_row), the amax of each row of x and of each row of
// x^T (or of its transform).
#include "cuda/common.cuh"
#include "cuda/handlers.h"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kValuesPerBlock = int64_t(kThreads) * 16;
constexpr int kUnroll = 4;  // 16-byte vectors a thread loads before it reduces them

// Block max of m over the block's threads, atomically folded into *out.
__device__ __forceinline__ void block_max_into(uint32_t m, uint32_t* out) {
  for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(~0u, m, offset));
  __shared__ uint32_t warp_max[kThreads / 32];
  __syncthreads();  // warp_max may be reused by a previous call
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    atomicMax(out, m);
  }
}

// Block (b, chunk) reduces a strided share of batch entry b into bits[b].
// (Each kernel's body is a device function that benchmarks/sass_budget.py also builds.)
template <typename L>
__device__ __forceinline__ void amax_elements(const typename L::T* x, int64_t per_batch,
                                              int64_t chunks, uint32_t* bits) {
  const int64_t b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const typename L::T* xb = x + b * per_batch;
  uint32_t m = 0;
#pragma unroll 1  // one element an iteration (as the budget counts it)
  for (int64_t i = chunk * kThreads + threadIdx.x; i < per_batch; i += chunks * kThreads)
    m = max(m, magnitude_bits(L::load(xb[i])));
  block_max_into(m, bits + b);
}

// Batch entries of whole 16-byte vectors (per_batch vectors each): block (b, chunk) reduces
// vectors chunk kThreads + t + k chunks kThreads of entry b, kUnroll at a time, with maxima of
// packed magnitudes (max_magnitude: one instruction a word).
template <typename L>
__device__ __forceinline__ void amax_vectors(const uint4* __restrict__ x, int64_t per_batch,
                                             int64_t chunks, uint32_t* bits) {
  const int64_t b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const uint32_t stride = uint32_t(chunks) * kThreads;  // chunks <= 1024
  const uint4* end = x + (b + 1) * per_batch;
  uint32_t m = 0;  // the dtype's magnitude bits (packed: two)
  // Rolled: each iteration already has kUnroll loads in flight (and the budget counts one).
#pragma unroll 1
  for (const uint4* p = x + b * per_batch + chunk * kThreads + threadIdx.x; p < end;
       p += kUnroll * stride) {
    uint4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      q[u] = p + u * stride < end ? p[u * stride] : uint4{0, 0, 0, 0};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      m = max_magnitude<L>(
          m, max_magnitude<L>(max_magnitude<L>(q[u].x, q[u].y), max_magnitude<L>(q[u].z, q[u].w)));
  }
  uint32_t mb = magnitude_bits(magnitude_value<L>(m));
  if constexpr (kPacked<L>) mb = max(mb, magnitude_bits(magnitude_value<L>(m >> 16)));
  block_max_into(mb, bits + b);
}

template <typename L>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const typename L::T* x, int64_t per_batch, int64_t chunks, uint32_t* bits) {
  amax_elements<L>(x, per_batch, chunks, bits);
}
template <typename L>
__global__ void __launch_bounds__(kThreads)
    amax_vector_kernel(const uint4* x, int64_t per_batch, int64_t chunks, uint32_t* bits) {
  amax_vectors<L>(x, per_batch, chunks, bits);
}

// Block (b, chunk) reduces a strided share of the 16-row chunks of batch entry
// b's columns: chunk j is column j % cols of rows 16 (j / cols) ...; the
// threads of a warp read consecutive columns (coalesced).
template <typename L>
__global__ void __launch_bounds__(kThreads)
    amax_rht_kernel(const typename L::T* x, int64_t rows, int64_t cols, int64_t chunks,
                    uint32_t* bits, uint32_t* bits_rht) {
  const int64_t b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const typename L::T* xb = x + b * rows * cols;
  const int64_t items = (rows / kBlock) * cols;
  uint32_t m = 0, m_rht = 0;
  for (int64_t j = chunk * kThreads + threadIdx.x; j < items; j += chunks * kThreads) {
    const int64_t stripe = j / cols, c = j % cols;
    const typename L::T* xc = xb + stripe * kBlock * cols + c;
    float v[kBlock];
#pragma unroll
    for (int r = 0; r < kBlock; ++r) {
      v[r] = L::load(xc[r * cols]);
      m = max(m, magnitude_bits(v[r]));
    }
    rht16_narrow<L>(v);
#pragma unroll
    for (int r = 0; r < kBlock; ++r) m_rht = max(m_rht, magnitude_bits(v[r]));
  }
  block_max_into(m, bits + b);
  block_max_into(m_rht, bits_rht + b);
}

// Per row: block (b, stripe, tile) owns 16 rows x kThreads columns, a
// thread one column. Each row's max is a warp max folded atomically into
// row_bits; each column's max (of its transformed chunk with rht_amax) into col_bits.
template <typename L>
__global__ void __launch_bounds__(kThreads)
    per_row_amax_kernel(const typename L::T* x, int64_t rows, int64_t cols, int64_t stripes,
                        int64_t tiles, bool rht_amax, uint32_t* row_bits, uint32_t* col_bits) {
  const int64_t tile = blockIdx.x % tiles, stripe = (blockIdx.x / tiles) % stripes;
  const int64_t b = blockIdx.x / (tiles * stripes);
  const int64_t c = tile * kThreads + threadIdx.x, m0 = stripe * kBlock;
  const int64_t nrows = min(int64_t(kBlock), rows - m0);
  const typename L::T* xc = x + (b * rows + m0) * cols + c;
  float v[kBlock];
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    v[r] = (r < nrows && c < cols) ? L::load(xc[r * cols]) : 0.0f;
    uint32_t m = magnitude_bits(v[r]);
    for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(~0u, m, offset));
    if (threadIdx.x % 32 == 0 && r < nrows) atomicMax(row_bits + b * rows + m0 + r, m);
  }
  if (c >= cols) return;
  if (rht_amax) rht16_narrow<L>(v);  // M % 16 == 0: all 16 rows are real
  uint32_t m = 0;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) m = max(m, magnitude_bits(v[r]));
  atomicMax(col_bits + b * cols + c, m);
}

ffi::Error per_row_amax(cudaStream_t stream, const ffi::AnyBuffer& x, bool rht_amax, int64_t batch,
                        int64_t rows, int64_t cols, float* amax, float* amax_t) {
  auto* row_bits = reinterpret_cast<uint32_t*>(amax);
  auto* col_bits = reinterpret_cast<uint32_t*>(amax_t);
  if (auto e = zero(row_bits, batch * rows * int64_t(sizeof(uint32_t)), stream); e.failure())
    return e;
  if (auto e = zero(col_bits, batch * cols * int64_t(sizeof(uint32_t)), stream); e.failure())
    return e;
  const int64_t stripes = num_blocks(rows), tiles = (cols + kThreads - 1) / kThreads;
  const int64_t blocks = batch * stripes * tiles;
  if (blocks > INT32_MAX) return invalid("amax input is too large for one launch");
  ffi::Error launched = ffi::Error::Success();
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    if (blocks <= 0) return;
    launched =
        launch<per_row_amax_kernel<L>>("amax", unsigned(blocks), kThreads, 0, stream,
                                       static_cast<const typename L::T*>(x.untyped_data()), rows,
                                       cols, stripes, tiles, rht_amax, row_bits, col_bits);
  });
  if (!ok) return invalid("amax input must be bfloat16, float16 or float32");
  if (launched.failure()) return launched;
  if (auto e = finish_amax("amax", stream, row_bits, batch * rows); e.failure()) return e;
  return finish_amax("amax", stream, col_bits, batch * cols);
}

ffi::Error amax_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets outs, bool rht_amax,
                     bool per_row) {
  int64_t batch = 0, rows = 0, cols = 0;
  float *amax, *amax_t;
  if (auto e = check_amax(x, outs, rht_amax, per_row, batch, rows, cols, amax, amax_t); e.failure())
    return e;
  if (per_row) return per_row_amax(stream, x, rht_amax, batch, rows, cols, amax, amax_t);
  if (batch == 0) return ffi::Error::Success();
  if (batch > INT32_MAX) return invalid("amax input is too large for one launch");
  auto* bits = reinterpret_cast<uint32_t*>(amax);
  auto* bits_rht = reinterpret_cast<uint32_t*>(amax_t);
  if (auto e = zero(bits, batch * int64_t(sizeof(uint32_t)), stream); e.failure()) return e;
  if (rht_amax)
    if (auto e = zero(bits_rht, batch * int64_t(sizeof(uint32_t)), stream); e.failure()) return e;
  const int64_t per_batch = rows * cols;
  // Blocks per entry for `items` items: enough to fill the GPU, each taking at least `per_block`.
  const int64_t max_chunks = std::max<int64_t>(1, std::min<int64_t>(1024, INT32_MAX / batch));
  const auto chunks_for = [&](int64_t items, int64_t per_block) {
    return std::clamp<int64_t>((items + per_block - 1) / per_block, 1, max_chunks);
  };
  const int64_t chunks = chunks_for(per_batch, kValuesPerBlock);
  ffi::Error launched = ffi::Error::Success();
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    if (per_batch <= 0) return;
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    const unsigned blocks = unsigned(batch * chunks);
    constexpr int64_t kPerVector = 16 / sizeof(typename L::T);
    if (rht_amax) {  // kThreads chunks of 16 values per block and iteration
      launched = launch<amax_rht_kernel<L>>("amax", blocks, kThreads, 0, stream, data, rows, cols,
                                            chunks, bits, bits_rht);
    } else if (per_batch % kPerVector == 0) {
      // Each thread kUnroll vectors at least.
      const int64_t vectors = per_batch / kPerVector;
      const int64_t vector_chunks = chunks_for(vectors, kThreads * kUnroll);
      launched = launch<amax_vector_kernel<L>>("amax", unsigned(batch * vector_chunks), kThreads, 0,
                                               stream, reinterpret_cast<const uint4*>(data),
                                               vectors, vector_chunks, bits);
    } else {
      launched = launch<amax_kernel<L>>("amax", blocks, kThreads, 0, stream, data, per_batch,
                                        chunks, bits);
    }
  });
  if (!ok) return invalid("amax input must be bfloat16, float16 or float32");
  if (launched.failure()) return launched;
  if (auto e = finish_amax("amax", stream, bits, batch); e.failure()) return e;
  return rht_amax ? finish_amax("amax", stream, bits_rht, batch) : ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4AmaxCuda, nvfp4::cuda::amax_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<nvfp4::cuda::StreamContext>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<bool>("rht_amax")
                                  .Attr<bool>("per_row"));
