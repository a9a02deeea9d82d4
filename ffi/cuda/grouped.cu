// The grouped ops of a mixture of experts on the GPU (jax_nvfp4/reference/grouped.py is the
// spec), bit-identical to it: x [B, M, N] holds token rows sorted by group, group_sizes [B, G] how
// many each group takes. Global block j (rows 16j..16j+15) of group g (its rows only, the others
// zero) is block p = j + g of the grouped columnwise copy, which has P = ceil(M/16) + G - 1
// blocks; the blocks no group owns are zero codes with zero scales.
//
// Layout: the grouped amax's CUDA block of 128 threads takes one block p of one batch entry, a
// thread one column of it (the columnwise 1x16 block: 16 rows in registers), and loops over column
// tiles; it folds its maxima atomically. The grouped quantize's tile kernel takes 8 consecutive
// blocks p the same way, and makes both copies from that one read of the input (see
// grouped_tiles_kernel); a second kernel writes the rowwise copy of the rows in no group, which are
// zeros. Warp 0 finds a block p's owner first, walking the groups' prefix sums 32 at a time, so
// that no host pass over group_sizes is needed.
//
// Group bounds follow the reference for any int32 sizes: each clamped to [0, M], their running
// sum saturating at M, so that every token row before the last group's end is in exactly one group.
#include "cuda/async_copy.cuh"
#include "cuda/common.cuh"
#include "cuda/four_over_six.cuh"
#include "cuda/handlers.h"
#include "cuda/memory.cuh"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 128;  // columns of a tile (one per thread), or 1x16 rowwise blocks
constexpr int kWarps = kThreads / 32;

// ---- the groups of a batch entry ----

// floor(a / 16) and ceil(a / 16) of the (non-negative) row bounds.
NVFP4_HD int64_t floor16(int64_t a) { return a / kBlock; }
NVFP4_HD int64_t ceil16(int64_t a) { return (a + kBlock - 1) / kBlock; }

// The lowest lane of a nonzero lane mask.
__device__ __forceinline__ int lowest_lane(unsigned mask) {
#if defined(__CUDACC__)
  return __ffs(int(mask)) - 1;
#else
  return __builtin_ctz(mask);
#endif
}

// Walks the G groups of `sizes` 32 at a time as the reference bounds them: group g's rows are
// [start_g, end_g), end_g = min(sizes_0 + ... + sizes_g, M) with each size clamped to [0, M] and
// the running sum saturating at M, start_g = end_(g-1), start_0 = 0. Lane l calls visit(base,
// real, start, end) for group base + l (not `real` past the last one). Returns end_(G-1): the
// rows before it are the rows in groups. Every lane of the warp calls.
template <typename Visit>
__device__ __forceinline__ int32_t scan_groups(const int32_t* sizes, int32_t groups, int32_t rows,
                                               Visit visit) {
  const int lane = int(threadIdx.x % 32);
  int32_t last = 0;  // the end of the previous chunk's last group
  for (int32_t base = 0; base < groups; base += 32) {
    const bool real = base + lane < groups;
    // Sums of values in [0, M] saturated at M stay below 2M: no int32 overflow.
    int32_t end = real ? min(max(sizes[base + lane], 0), rows) : 0;
    for (int d = 1; d < 32; d *= 2) {
      const int32_t t = __shfl_up_sync(~0u, end, d);
      if (lane >= d) end = min(end + t, rows);
    }
    end = min(end + last, rows);
    const int32_t before = __shfl_up_sync(~0u, end, 1);
    visit(base, real, lane == 0 ? last : before, end);
    last = __shfl_sync(~0u, end, 31);  // lanes past the last group add nothing
  }
  return last;
}

// The owner of block p of the grouped layout (an aggregate: it lives in shared memory).
struct Owner {
  int32_t g;       // the group that owns p (G where none does)
  int32_t lo, hi;  // its rows [start_g, end_g)
};

// Group g owns global blocks [start_g // 16, ceil(end_g / 16)) where it has rows; block p of the
// layout is its global block p - g. Every lane of the warp calls.
__device__ __forceinline__ Owner find_owner(const int32_t* sizes, int32_t groups, int32_t rows,
                                            int64_t p) {
  Owner o{groups, 0, 0};
  const int lane = int(threadIdx.x % 32);
  scan_groups(sizes, groups, rows, [&](int32_t base, bool real, int32_t start, int32_t end) {
    const int64_t j = p - (base + lane);
    const bool owns = real && end > start && j >= floor16(start) && j < ceil16(end);
    const unsigned owners = __ballot_sync(~0u, owns);
    if (o.g == groups && owners != 0) {  // the same in every lane
      const int w = lowest_lane(owners);
      o.g = base + w;
      o.lo = __shfl_sync(~0u, start, w);
      o.hi = __shfl_sync(~0u, end, w);
    }
  });
  return o;
}

// The owner of block p of batch entry `sizes`, found by warp 0 for the CUDA block (every thread
// of the block calls).
__device__ __forceinline__ Owner block_owner(const int32_t* sizes, int32_t groups, int32_t rows,
                                             int64_t p) {
  __shared__ Owner shared;
  if (threadIdx.x < 32) {
    const Owner o = find_owner(sizes, groups, rows, p);
    if (threadIdx.x == 0) shared = o;
  }
  __syncthreads();
  return shared;
}

// The values of column n, rows m0..m0+15 of a batch entry xb [M, N] as the grouped copy holds
// them: those of the owner's rows [lo, hi) (within [0, M)); the others (and every value of a
// column past N) 0.
template <typename L>
__device__ __forceinline__ void load_column(const typename L::T* xb, int64_t cols, int64_t n,
                                            int64_t m0, int64_t lo, int64_t hi,
                                            float (&v)[kBlock]) {
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    const int64_t m = m0 + r;
    // (A predicated load: lanes out of range read nothing and take 0, the zero bits' value.)
    v[r] = L::load(NVFP4_LDG_IF(n < cols && m >= lo && m < hi, xb + m * cols + n, typename L::T{}));
  }
}

// The largest magnitude of 16 values, as bits.
__device__ __forceinline__ uint32_t max_bits(const float (&v)[kBlock]) {
  uint32_t m = 0;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) m = max(m, magnitude_bits(v[r]));
  return m;
}

// ---- grouped amax ----

struct AmaxParams {
  const int32_t* sizes;  // [B, G]
  int64_t rows, cols, groups, blocks;
  bool rht_amax, per_row;
  uint32_t* row_bits;    // amax [B] (per row: [B, M]) as magnitude bits
  uint32_t* group_bits;  // amax_t [B, G] (per row: [B, G, N])
};

// Block max of m over the CUDA block's threads, atomically folded into *out (every thread calls).
__device__ __forceinline__ void block_max_into(uint32_t m, uint32_t* out) {
  for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(~0u, m, offset));
  __shared__ uint32_t warp_max[kWarps];
  __syncthreads();  // warp_max may be read by a previous call
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m = max(m, warp_max[w]);
    atomicMax(out, m);
  }
}

// Folds the warp's maxima of rows m0..m0+15 (a value a lane) into row_bits [M], the owner's rows
// [lo, hi) only (every lane of the warp calls).
__device__ __forceinline__ void rows_into(const float (&v)[kBlock], int64_t m0, int64_t lo,
                                          int64_t hi, uint32_t* row_bits) {
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    uint32_t m = magnitude_bits(v[r]);
    for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(~0u, m, offset));
    const int64_t row = m0 + r;
    if (threadIdx.x % 32 == 0 && row >= lo && row < hi) atomicMax(row_bits + row, m);
  }
}

// CUDA block (b, p) x (column chunk): block p of entry b's grouped layout, over the column tiles
// of its chunk. Its owner's maxima go to amax_t (of the RHT with rht_amax), and the token rows'
// to amax from the same values (each row in groups lies in exactly one owned block).
template <typename L>
__global__ void __launch_bounds__(kThreads)
    grouped_amax_kernel(const typename L::T* x, AmaxParams a) {
  const int64_t b = blockIdx.x / a.blocks, p = blockIdx.x % a.blocks;
  const Owner o = block_owner(a.sizes + b * a.groups, int32_t(a.groups), int32_t(a.rows), p);
  const typename L::T* xb = x + b * a.rows * a.cols;
  uint32_t* row_bits = a.per_row ? a.row_bits + b * a.rows : nullptr;
  const bool owned = o.g < a.groups;
  uint32_t row_max = 0, group_max = 0;  // the thread's (not per row)
  for (int64_t tile = blockIdx.y; tile * kThreads < a.cols; tile += gridDim.y) {
    const int64_t n = tile * kThreads + threadIdx.x;
    float v[kBlock];
    if (owned) {
      const int64_t m0 = (p - o.g) * kBlock;
      load_column<L>(xb, a.cols, n, m0, o.lo, o.hi, v);
      uint32_t col = max_bits(v);
      if (a.per_row)
        rows_into(v, m0, o.lo, o.hi, row_bits);
      else
        row_max = max(row_max, col);
      if (a.rht_amax) {
        rht16_narrow<L>(v);
        col = max_bits(v);
      }
      if (!a.per_row)
        group_max = max(group_max, col);
      else if (n < a.cols)
        atomicMax(a.group_bits + (b * a.groups + o.g) * a.cols + n, col);
    }
  }
  if (!a.per_row) {
    block_max_into(row_max, a.row_bits + b);
    if (owned) block_max_into(group_max, a.group_bits + b * a.groups + o.g);
  }
}

// The column chunks of a grid over `blocks` layout blocks of `tiles` column tiles each: enough
// CUDA blocks to fill the GPU, a chunk at least a tile.
template <typename Kernel>
unsigned column_chunks(Kernel* kernel, int64_t blocks, int64_t tiles) {
  const int64_t want = (resident_blocks(kernel, kThreads, 0) + blocks - 1) / blocks;
  return unsigned(std::clamp<int64_t>(want, 1, std::min<int64_t>(tiles, 65535)));
}

// The sizes the kernels index with 32-bit grids.
ffi::Error check_launch_size(const GroupedShape& s) {
  if (s.rows > INT32_MAX - kBlock || s.cols > INT32_MAX || s.groups > INT32_MAX / 2 ||
      s.batch * s.blocks > INT32_MAX)
    return invalid("grouped input is too large for one launch");
  return ffi::Error::Success();
}

ffi::Error grouped_amax_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sizes,
                             ffi::RemainingRets outs, bool rht_amax, bool per_row) {
  GroupedShape s;
  float* results[2] = {nullptr, nullptr};
  if (auto e = check_grouped_amax(x, sizes, outs, rht_amax, per_row, s, results); e.failure())
    return e;
  if (auto e = check_launch_size(s); e.failure()) return e;
  const int64_t batch = s.batch, rows = s.rows, cols = s.cols, groups = s.groups, blocks = s.blocks;
  const int64_t counts[2] = {s.amax_count(per_row), s.group_amax_count(per_row)};
  uint32_t* bits[2] = {reinterpret_cast<uint32_t*>(results[0]),
                       reinterpret_cast<uint32_t*>(results[1])};
  for (int i = 0; i < 2; ++i)
    if (auto e = zero(bits[i], counts[i] * int64_t(sizeof(uint32_t)), stream); e.failure())
      return e;
  const AmaxParams a{sizes.typed_data(), rows,    cols,    groups, blocks,
                     rht_amax,           per_row, bits[0], bits[1]};
  const int64_t tiles = (cols + kThreads - 1) / kThreads;
  ffi::Error launched = ffi::Error::Success();
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    if (batch * blocks * tiles == 0) return;
    constexpr auto kernel = grouped_amax_kernel<L>;
    const dim3 grid(unsigned(batch * blocks), column_chunks(kernel, batch * blocks, tiles));
    launched = launch<kernel>("grouped amax", grid, kThreads, 0, stream,
                              static_cast<const typename L::T*>(x.untyped_data()), a);
  });
  if (!ok) return invalid("grouped amax input must be bfloat16, float16 or float32");
  if (launched.failure()) return launched;
  if (auto e = finish_amax("grouped amax", stream, bits[0], counts[0]); e.failure()) return e;
  return finish_amax("grouped amax", stream, bits[1], counts[1]);
}

// ---- grouped quantize ----

// How the codes round (a kernel each, so that each keeps its registers).
enum class Mode { kNearest, kStochastic, kFourOverSix };

struct Params {
  const int32_t* sizes;         // [B, G]
  const float* amax;            // [B] (row-scaled: [B, M]): the rowwise copy
  const float* amax_t;          // [B, G] (row-scaled: [B, G, N]): the grouped copy
  const uint32_t* seed;         // [2] or [4 + M] (placed): the rowwise copy's Stream
  const uint32_t* group_seeds;  // [G, 2]: each group's key for its blocks
  int64_t rows, cols, groups, blocks;
  bool placed;
  QuantizeSpec spec;
  QuantizeOutputs o;  // data, scale as quantize's; data_t [B, N, 8P], scale_t [B, N, P]
};

// The scale code and codes of one 1x16 block v with global scales g, rounding stochastically by
// the random words w (a Stream's); code k in nibble k % 8 of word k / 8 (a column's bytes:
// element 2i in the low nibble of byte i).
template <Mode kMode>
__device__ __forceinline__ uint8_t encode_block(const QuantizeSpec& spec, const float (&v)[kBlock],
                                                const GlobalScales& g, const uint32_t (&w)[4],
                                                uint32_t (&words)[2]) {
  const float bamax = amax_from_bits(max_bits(v));
  uint8_t scale;
  float enc;
  if constexpr (kMode == Mode::kFourOverSix) {
    const Candidate chosen = column_chunk(v, bamax, g, spec.four_over_six());
    scale = chosen.scale;
    enc = chosen.enc;
  } else {
    scale = block_scale(bamax, g);
    enc = block_encode_scale(scale, g);
  }
  words[0] = words[1] = 0;
#pragma unroll
  for (int k = 0; k < kBlock; ++k) {
    const uint32_t code = kMode == Mode::kStochastic
                              ? quantize_value_stochastic(v[k], enc, random_byte(w, k))
                              : quantize_value(v[k], enc);
    words[k / 8] |= code << (4 * (k % 8));
  }
  return scale;
}

// ---- one read of the input: the grouped copy and the group rows' rowwise copy ----
//
// A CUDA block takes kTileBlocks consecutive layout blocks p0.. of one batch entry over a share of
// its 128-column tiles: a step is one layout block of one tile. In a step, a thread takes its
// column's 16 rows of the block (the owner's rows; the others 0) and encodes that 1x16 block of the
// grouped copy; with the rowwise copy asked, a thread also takes one rowwise 1x16 block of the
// owner's rows in the tile (16 rows of 8 blocks: one a thread), from the values in shared memory:
// every row in a group lies in exactly one owned layout block, so the input is read once. The
// grouped copy's codes and scales are staged in shared memory and stored kTileBlocks blocks of a
// line together (64 contiguous code bytes and 8 scale bytes), not 8 bytes and a byte a lane P
// blocks apart. The rows in no group (from the last group's end) are the rowwise kernel's; it
// reads nothing of them.
//
// Two kernels load the steps' values: grouped_tiles_kernel by element loads, a thread its
// column's 16 (then shared memory holds them for the rowwise blocks), and grouped_ring_kernel
// (NVFP4_QUANTIZE_LOAD=ring, where rows are whole 16-byte chunks) by bulk copies of the owner's
// rows into a ring of kRingStages stages completing on mbarriers, kRingStages - 1 steps ahead.

constexpr int kTileBlocks = 8;                   // layout blocks a CUDA block takes
constexpr int kRowBlocks = kThreads / kBlock;    // rowwise blocks a row of a tile holds (8)
static_assert(kBlock * kRowBlocks == kThreads);  // a thread a rowwise block of the tile
constexpr int kRingStages = 3;

// The grouped copy's staging. Each array is swizzled (the *_slot functions) so that its writes and
// reads take one wavefront a phase.
struct Staged {
  uint2 codes[kThreads][kTileBlocks];     // line c's block kb at [c][code_slot(c, kb)]
  uint8_t scales[kThreads][kTileBlocks];  // line c's block kb at [c][scale_slot(c, kb)]
  Owner owners[kTileBlocks];
};

// Line c's place for block kb in Staged::codes (a line is 64 bytes: 16 banks): a phase of 16
// lines writing one block, and one of 2 lines reading their 8 blocks, fall on different banks.
__device__ __forceinline__ int code_slot(int c, int kb) { return kb ^ ((c >> 1) & 7); }

// Line c's place for block kb in Staged::scales (a line is 2 words): a warp's 32 lines writing
// one block's bytes fall on different banks (lines 16 apart would share one).
__device__ __forceinline__ int scale_slot(int c, int kb) { return kb ^ (((c >> 4) & 1) << 2); }

// grouped_tiles_kernel's values of a step for the rowwise blocks: row r, column c at
// [r][value_slot(c)] (16-byte aligned: a rowwise block reads 4 floats a load).
struct alignas(16) TileValues {
  float v[kBlock][kThreads];
};

// Column c's place in a row of TileValues: its float4 group f = c / 4 XOR-ed
// with (f / 8) % 4. A warp's 32 columns stay in one row's 32 banks, and a phase of rowwise loads
// (8 threads, the 8 blocks of a row: groups 4k + q) falls on 8 different groups of 4 banks.
__device__ __forceinline__ int value_slot(int c) {
  const int f = c >> 2;
  return 4 * (f ^ ((f >> 3) & 3)) + (c & 3);
}

// The 1x16 block of the grouped copy at column n of a layout block of entry b: its code words and
// scale byte from its values v (global rows m0.., the owner's only; o owns a group).
template <typename L, Mode kMode>
__device__ __forceinline__ uint8_t encode_column(const Params& p, const Owner& o, int64_t b,
                                                 int64_t m0, int64_t n, float (&v)[kBlock],
                                                 uint32_t (&words)[2]) {
  const QuantizeSpec& spec = p.spec;
  if (spec.columnwise_rht()) rht16_narrow<L>(v);
  const float amax_t =
      spec.row_scaled ? p.amax_t[(b * p.groups + o.g) * p.cols + n] : p.amax_t[b * p.groups + o.g];
  // The block draws as block m0 / 16 of row n of the [B, N, M] copy, stream 1, with the group's
  // key.
  uint32_t w[4] = {0, 0, 0, 0};
  if constexpr (kMode == Mode::kStochastic) {
    Stream s = stream_of(p.seed, p.placed, p.rows);
    s.key = Seed{p.group_seeds[2 * o.g], p.group_seeds[2 * o.g + 1]};
    s.column_block(s.column_index(m0), uint32_t(n), uint32_t(b), w);
  }
  return encode_block<kMode>(spec, v, spec.global_scales(amax_t), w, words);
}

// Stores (where `ok`) block k of row `row` (counting every entry's rows) of the rowwise copy.
__device__ __forceinline__ void store_row_block(const Params& p, bool ok, int64_t row, int64_t k,
                                                uint8_t scale, const uint32_t (&words)[2]) {
  NVFP4_STG_IF(ok, p.o.scale + row * num_blocks(p.cols) + k, scale);
  const int64_t data_cols = packed_size(p.cols);
  uint8_t* dst = p.o.data + row * data_cols + k * (kBlock / 2);
  if (data_cols % 8 == 0) {  // whole, aligned 8-byte blocks
    NVFP4_STG_IF(ok, reinterpret_cast<uint2*>(dst), (uint2{words[0], words[1]}));
  } else {
    const uint64_t bytes = words[0] | uint64_t(words[1]) << 32;
#pragma unroll
    for (int i = 0; i < kBlock / 2; ++i)
      NVFP4_STG_IF(ok && k * (kBlock / 2) + i < data_cols, dst + i, uint8_t(bytes >> (8 * i)));
  }
}

// The rowwise 1x16 block k of row m of entry b from its values u, where `ok` (every thread of the
// CUDA block calls).
template <Mode kMode>
__device__ __forceinline__ void quantize_row_values(const Params& p, bool ok, int64_t b, int64_t m,
                                                    int64_t k, const float (&u)[kBlock]) {
  const int64_t row = b * p.rows + m;
  uint32_t words[2] = {0, 0};
  uint8_t scale = 0;
  if (ok) {
    const float amax = p.spec.row_scaled ? p.amax[row] : p.amax[b];
    // Block k of row m draws Stream::row_block(k, m, b).
    uint32_t w[4] = {0, 0, 0, 0};
    if constexpr (kMode == Mode::kStochastic)
      stream_of(p.seed, p.placed, p.rows).row_block(uint32_t(k), m, uint32_t(b), w);
    scale = encode_block<kMode>(p.spec, u, p.spec.global_scales(amax), w, words);
  }
  store_row_block(p, ok, row, k, scale, words);
}

// The rowwise copy of the owner's rows among global rows m0.. of column tile `tile` of entry b,
// from the values the block's threads hold (a column's 16 rows each), through `values`: thread t
// takes block t % 8 of the tile's row t / 8, so that a warp stores 4 rows' 64 consecutive code
// bytes. Every thread of the CUDA block calls.
template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_tile_rows(const Params& p, float (*values)[kThreads],
                                                   const Owner& o, int64_t b, int64_t m0,
                                                   int64_t tile, const float (&v)[kBlock]) {
  const int t = int(threadIdx.x);
#pragma unroll
  for (int r = 0; r < kBlock; ++r) NVFP4_STS(&values[r][value_slot(t)], v[r]);
  __syncthreads();
  const int r = t / kRowBlocks, kk = t % kRowBlocks;
  const int64_t m = m0 + r, k = tile * kRowBlocks + kk;
  const bool ok = m >= o.lo && m < o.hi && k < num_blocks(p.cols);
  float u[kBlock];
#pragma unroll
  for (int q = 0; q < kBlock / 4; ++q) {
    const auto* at = reinterpret_cast<const uint4*>(&values[r][value_slot(kBlock * kk + 4 * q)]);
    const uint4 w = NVFP4_LDS_IF(ok, at, (uint4{0, 0, 0, 0}));
    __builtin_memcpy(u + 4 * q, &w, sizeof(w));
  }
  quantize_row_values<kMode>(p, ok, b, m, k, u);
  __syncthreads();  // the values' next writes wait for these reads
}

// The staged grouped-copy blocks p0.. (count of them) of the tile's 128 lines to global memory:
// a warp stores 4 lines' 64 consecutive code bytes (8 a lane) and their 8 scale bytes each.
__device__ __forceinline__ void store_staged(const Params& p, const Staged& st, int64_t b,
                                             int64_t p0, int count, int64_t tile) {
  for (int i = int(threadIdx.x); i < kThreads * kTileBlocks; i += kThreads) {
    const int c = i / kTileBlocks, kb = i % kTileBlocks;
    const int64_t n = tile * kThreads + c;
    const bool ok = kb < count && n < p.cols;
    const int64_t at = (b * p.cols + n) * p.blocks + p0 + kb;  // block p0 + kb of line n
    NVFP4_STG_IF(ok, reinterpret_cast<uint2*>(p.o.data_t) + at,
                 NVFP4_LDS_IF(ok, &st.codes[c][code_slot(c, kb)], (uint2{0, 0})));
    NVFP4_STG_IF(ok, p.o.scale_t + at,
                 NVFP4_LDS_IF(ok, &st.scales[c][scale_slot(c, kb)], uint8_t(0)));
  }
}

// The CUDA block's layout blocks: p0, their count, and their owners in st (every thread calls).
__device__ __forceinline__ int find_owners(const Params& p, int64_t b, int64_t p0, Staged& st) {
  const int count = int(p.blocks - p0 < kTileBlocks ? p.blocks - p0 : kTileBlocks);
  if (threadIdx.x < 32)
    for (int kb = 0; kb < count; ++kb) {
      const Owner o =
          find_owner(p.sizes + b * p.groups, int32_t(p.groups), int32_t(p.rows), p0 + kb);
      if (threadIdx.x == 0) st.owners[kb] = o;
    }
  return count;
}

// Stages the grouped copy's block kb of this thread's line (zeros for a block no group owns).
__device__ __forceinline__ void stage_column(Staged& st, int kb, uint8_t scale,
                                             const uint32_t (&words)[2]) {
  const int t = int(threadIdx.x);
  NVFP4_STS(&st.codes[t][code_slot(t, kb)], (uint2{words[0], words[1]}));
  NVFP4_STS(&st.scales[t][scale_slot(t, kb)], scale);
}

// CUDA block (b, chunk) x (column chunk): layout blocks chunk * kTileBlocks.. of entry b's grouped
// copy over its column chunk's tiles, and the rowwise copy of their owners' rows; element loads.
template <typename L, Mode kMode>
__global__ void __launch_bounds__(kThreads)
    grouped_tiles_kernel(const typename L::T* x, Params p, int64_t chunks) {
  __shared__ Staged st;
  __shared__ TileValues values;
  const int64_t b = blockIdx.x / chunks, p0 = blockIdx.x % chunks * kTileBlocks;
  const int count = find_owners(p, b, p0, st);
  __syncthreads();
  const typename L::T* xb = x + b * p.rows * p.cols;
  const bool rowwise = p.o.data != nullptr;
  for (int64_t tile = blockIdx.y; tile * kThreads < p.cols; tile += gridDim.y) {
    const int64_t n = tile * kThreads + threadIdx.x;
    for (int kb = 0; kb < count; ++kb) {
      const Owner o = st.owners[kb];
      uint32_t words[2] = {0, 0};  // a block no group owns: zero codes, zero scale
      uint8_t scale = 0;
      if (o.g < p.groups) {  // the same in every thread
        const int64_t m0 = (p0 + kb - o.g) * kBlock;
        float v[kBlock];
        load_column<L>(xb, p.cols, n, m0, o.lo, o.hi, v);
        if (rowwise) quantize_tile_rows<L, kMode>(p, values.v, o, b, m0, tile, v);
        if (n < p.cols) scale = encode_column<L, kMode>(p, o, b, m0, n, v, words);
      }
      stage_column(st, kb, scale, words);
    }
    __syncthreads();
    store_staged(p, st, b, p0, count, tile);
    __syncthreads();  // the staging's next writes wait for these reads
  }
}

// grouped_ring_kernel's input ring: a step's 16 rows x 128 columns a stage.
template <typename L>
struct Ring {
  alignas(128) typename L::T stage[kRingStages][kBlock][kThreads];
  Mbarrier full[kRingStages];
};

// Step k's column tile of the CUDA block (its layout block is kb = k % count).
__device__ __forceinline__ int64_t step_tile(int64_t k, int count) {
  return blockIdx.y + k / count * gridDim.y;
}

// Issues step k's copies: the owner's rows of its layout block, a bulk copy each (of the tile's
// columns within N), into stage k % kRingStages, completing on its mbarrier; a block no group owns
// copies nothing and its phase completes on the arrival alone. Warp 0 calls, after a block barrier
// that follows every read of the stage's last step.
template <typename L>
__device__ __forceinline__ void load_step(const typename L::T* xb, const Params& p, Staged& st,
                                          Ring<L>& ring, int64_t p0, int count, int64_t k) {
  const int s = int(k % kRingStages), kb = int(k % count);
  const Owner o = st.owners[kb];
  const int64_t n0 = step_tile(k, count) * kThreads;
  int64_t m0 = 0, first = 0, rows = 0, bytes = 0;
  if (o.g < p.groups) {
    m0 = (p0 + kb - o.g) * kBlock;
    first = o.lo > m0 ? o.lo - m0 : 0;
    rows = (o.hi < m0 + kBlock ? o.hi - m0 : kBlock) - first;
    bytes = (p.cols - n0 < kThreads ? p.cols - n0 : kThreads) * int64_t(sizeof(typename L::T));
  }
  // The block read this stage last, before the barrier that led here.
  warp_bulk_load_rows(&ring.stage[s][first][0], kThreads, xb + (m0 + first) * p.cols + n0, p.cols,
                      uint32_t(rows), uint32_t(bytes), &ring.full[s]);
}

// The rowwise values of block kk of row r of a stage: a block's 16-byte chunks, each read where
// `ok` and inside N (rows of whole chunks), in an order rotated by kk * C / 8 (C chunks a block) so
// that a phase of 8 threads (the 8 blocks of a row) falls on 8 different groups of 4 banks.
template <typename L>
__device__ __forceinline__ void stage_row_values(const typename L::T (*rows)[kThreads], int r,
                                                 int kk, bool ok, int64_t n0, int64_t cols,
                                                 float (&u)[kBlock]) {
  using T = typename L::T;
  constexpr int kChunkValues = 16 / int(sizeof(T)), kChunks = kBlock / kChunkValues;
  const int rot = kk * kChunks / kRowBlocks;
  uint4 w[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int q = (i + rot) % kChunks, c = kBlock * kk + q * kChunkValues;
    w[i] = NVFP4_LDS_IF(ok && n0 + c < cols, reinterpret_cast<const uint4*>(&rows[r][c]),
                        (uint4{0, 0, 0, 0}));
  }
#pragma unroll
  for (int q = 0; q < kChunks; ++q) {
    uint4 chunk = w[q];  // w[i] holds chunk (i + rot) % kChunks: chunk q is w[(q - rot) mod C]
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if ((i + rot) % kChunks == q) chunk = w[i];
    T t[kChunkValues];
    __builtin_memcpy(t, &chunk, sizeof(chunk));
#pragma unroll
    for (int i = 0; i < kChunkValues; ++i) u[q * kChunkValues + i] = L::load(t[i]);
  }
}

// grouped_tiles_kernel with the steps' values in a ring of bulk copies (rows of whole 16-byte
// chunks, a 16-byte-aligned x): a thread reads its column from the stage, and the rowwise blocks
// read theirs there too.
template <typename L, Mode kMode>
__global__ void __launch_bounds__(kThreads)
    grouped_ring_kernel(const typename L::T* x, Params p, int64_t chunks) {
  __shared__ Staged st;
  __shared__ Ring<L> ring;
  const int64_t b = blockIdx.x / chunks, p0 = blockIdx.x % chunks * kTileBlocks;
  const int count = find_owners(p, b, p0, st);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRingStages; ++s) mbarrier_init(&ring.full[s], 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  const typename L::T* xb = x + b * p.rows * p.cols;
  const bool rowwise = p.o.data != nullptr;
  const int64_t tiles = (p.cols + kThreads - 1) / kThreads;
  const int64_t steps = blockIdx.y < tiles ? ((tiles - 1 - blockIdx.y) / gridDim.y + 1) * count : 0;
  if (threadIdx.x < 32)
    for (int64_t k = 0; k < kRingStages - 1 && k < steps; ++k)
      load_step<L>(xb, p, st, ring, p0, count, k);
  const int t = int(threadIdx.x);
  for (int64_t k = 0; k < steps; ++k) {
    // Step k + kRingStages - 1's copies into the stage step k - 1 read (every thread has passed
    // the barrier after those reads); then step k's stage, filled for the (k / stages)-th time.
    if (threadIdx.x < 32 && k + kRingStages - 1 < steps)
      load_step<L>(xb, p, st, ring, p0, count, k + kRingStages - 1);
    const int s = int(k % kRingStages), kb = int(k % count);
    const int64_t tile = step_tile(k, count), n0 = tile * kThreads, n = n0 + t;
    mbarrier_wait(&ring.full[s], uint32_t(k / kRingStages) & 1u);
    const Owner o = st.owners[kb];
    uint32_t words[2] = {0, 0};  // a block no group owns: zero codes, zero scale
    uint8_t scale = 0;
    if (o.g < p.groups) {  // the same in every thread
      const int64_t m0 = (p0 + kb - o.g) * kBlock;
      const typename L::T(*rows)[kThreads] = ring.stage[s];
      float v[kBlock];
#pragma unroll
      for (int r = 0; r < kBlock; ++r)
        v[r] = L::load(NVFP4_LDS_IF(n < p.cols && m0 + r >= o.lo && m0 + r < o.hi, &rows[r][t],
                                    typename L::T{}));
      if (rowwise) {
        const int r = t / kRowBlocks, kk = t % kRowBlocks;
        const int64_t m = m0 + r, k_row = tile * kRowBlocks + kk;
        const bool ok = m >= o.lo && m < o.hi && k_row < num_blocks(p.cols);
        float u[kBlock];
        stage_row_values<L>(rows, r, kk, ok, n0, p.cols, u);
        quantize_row_values<kMode>(p, ok, b, m, k_row, u);
      }
      if (n < p.cols) scale = encode_column<L, kMode>(p, o, b, m0, n, v, words);
    }
    stage_column(st, kb, scale, words);
    __syncthreads();  // the stage's reads are done; the staging's writes are seen
    if (kb == count - 1) {
      store_staged(p, st, b, p0, count, tile);
      __syncthreads();  // the staging's next writes wait for these reads
    }
  }
}

// CUDA block (b, chunk): a strided share of entry b's rowwise 1x16 blocks of the rows past the last
// group's end (the tile kernels take the groups' rows). Their values are zeros: nothing is read,
// and the loader's dtype does not matter.
template <Mode kMode>
__global__ void __launch_bounds__(kThreads) grouped_rows_kernel(Params p, int64_t chunks) {
  const int64_t b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  __shared__ int32_t in_groups;
  if (threadIdx.x < 32) {
    const int32_t end = scan_groups(p.sizes + b * p.groups, int32_t(p.groups), int32_t(p.rows),
                                    [](int32_t, bool, int32_t, int32_t) {});
    if (threadIdx.x == 0) in_groups = end;
  }
  __syncthreads();
  const int64_t per_row = num_blocks(p.cols), items = p.rows * per_row;
  const float zeros[kBlock] = {};
  for (int64_t i = in_groups * per_row + chunk * kThreads + threadIdx.x; i < items;
       i += chunks * kThreads)
    quantize_row_values<kMode>(p, true, b, i / per_row, i % per_row, zeros);
}

// The grouped copy and the rowwise copy of the rows in groups by kernel K (one read of the input).
template <auto K, typename L>
ffi::Error launch_tiles(cudaStream_t stream, const typename L::T* x, const Params& p,
                        int64_t batch) {
  const int64_t tiles = (p.cols + kThreads - 1) / kThreads;
  const int64_t chunks = (p.blocks + kTileBlocks - 1) / kTileBlocks;
  if (batch * chunks * tiles == 0) return ffi::Error::Success();
  const dim3 grid(unsigned(batch * chunks), column_chunks(K, batch * chunks, tiles));
  return launch<K>("grouped quantize", grid, kThreads, 0, stream, x, p, chunks);
}

template <typename L, Mode kMode>
ffi::Error launch_quantize(cudaStream_t stream, const typename L::T* x, const Params& p,
                           int64_t batch) {
  // The ring's bulk copies need rows of whole 16-byte chunks and a 16-byte-aligned x.
  const bool ring = ring_asked() && (p.cols * int64_t(sizeof(*x))) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (auto e = ring ? launch_tiles<grouped_ring_kernel<L, kMode>, L>(stream, x, p, batch)
                    : launch_tiles<grouped_tiles_kernel<L, kMode>, L>(stream, x, p, batch);
      e.failure())
    return e;
  // The rowwise copy of the rows in no group.
  const int64_t items = p.rows * num_blocks(p.cols);  // rowwise blocks of an entry
  if (!p.o.data || batch * items == 0) return ffi::Error::Success();
  constexpr auto kernel = grouped_rows_kernel<kMode>;
  const int64_t fill = (resident_blocks(kernel, kThreads, 0) + batch - 1) / batch;
  const int64_t chunk_count =
      std::clamp<int64_t>((items + kThreads - 1) / kThreads, 1,
                          std::max<int64_t>(1, std::min(fill, INT32_MAX / batch)));
  return launch<kernel>("grouped quantize", unsigned(batch * chunk_count), kThreads, 0, stream, p,
                        chunk_count);
}

ffi::Error grouped_quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sizes,
                                 ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::F32> amax_t,
                                 ffi::Buffer<ffi::U32> seed, ffi::Buffer<ffi::U32> group_seeds,
                                 ffi::RemainingRets outs, QuantizeSpec spec) {
  GroupedShape s;
  QuantizeOutputs o;
  bool placed = false;
  if (auto e = check_grouped_quantize(x, sizes, amax, amax_t, seed, group_seeds, outs, spec, s, o,
                                      placed);
      e.failure())
    return e;
  if (auto e = check_launch_size(s); e.failure()) return e;
  const int64_t batch = s.batch, rows = s.rows, cols = s.cols, groups = s.groups, blocks = s.blocks;
  const Params p{sizes.typed_data(),
                 amax.typed_data(),
                 amax_t.typed_data(),
                 seed.typed_data(),
                 group_seeds.typed_data(),
                 rows,
                 cols,
                 groups,
                 blocks,
                 placed,
                 spec,
                 o};
  ffi::Error launched = ffi::Error::Success();
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    if (spec.stochastic_rounding)
      launched = launch_quantize<L, Mode::kStochastic>(stream, data, p, batch);
    else if (spec.four_over_six().on())
      launched = launch_quantize<L, Mode::kFourOverSix>(stream, data, p, batch);
    else
      launched = launch_quantize<L, Mode::kNearest>(stream, data, p, batch);
  });
  if (!ok) return invalid("grouped quantize input must be bfloat16, float16 or float32");
  return launched;
}

}  // namespace
}  // namespace nvfp4::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4GroupedAmaxCuda, nvfp4::cuda::grouped_amax_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<nvfp4::cuda::StreamContext>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<bool>("rht_amax")
                                  .Attr<bool>("per_row"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4GroupedQuantizeCuda, nvfp4::cuda::grouped_quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<nvfp4::cuda::StreamContext>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingRets()
                                  .Attrs<nvfp4::QuantizeSpec>());
