// NVFP4 quantization on the GPU, bit-identical to the CPU kernel: one pass over the input
// gives the rowwise and/or columnwise copy with 1x16 or 16x16 blocks.
//
// Layout, for memory speed (benchmarks/sass_budget.py counts the instructions):
//   - A CUDA block of 128 threads loops over tiles of 64 rows x 256 columns (a persistent grid,
//     so the per-entry tables below are built once per batch entry, not per tile). Warp w owns
//     rows 16w..16w+15 of the tile, lane l columns 8l..8l+7: 16 rows x 8 columns per thread,
//     read with 16-byte loads, kept in registers (float32: in dynamic shared memory, Values).
//   - Columnwise 1x16 blocks are a thread's own 16 values; rowwise blocks are a lane pair's
//     (xor 1). Maxima are taken on packed 16-bit pairs (max.NaN.xorsign.abs).
//   - A block's scale is computed once, two at a time by cvt.rn.satfinite.e4m3x2; its encode
//     scale 1 / (s * gds) comes from a per-entry table of the 256 E4M3 codes.
//   - Codes of nearest rounding come two at a time: on sm_90 from a 32 KB table of codes by the
//     products' float16 classes (one convert truncates two), a copy per lane so that a warp's
//     lookups take one wavefront (e2m1_lut.cuh; where a block scale code of the copy makes a
//     round-down tie possible, as in every row-scaled copy, by their tie-safe bits), from the E2M1
//     convert on sm_100a/sm_120a. One
//     pass over the rows unpacks each value once and gives both copies' codes: a row's 4 code bytes
//     pack into a word, a column's into its two words.
//   - The columnwise copy goes through a shared-memory tile (double-buffered, one barrier a
//     tile) and is written 16 bytes a store.
//   - The input comes from global memory when a tile's turn comes (Load::kDirect), or (kRing,
//     NVFP4_QUANTIZE_LOAD=ring) from a ring of three shared-memory stages (two where three do not
//     fit) that bulk copies fill two tiles (one) ahead. Global and shared accesses go through
//     cuda/memory.cuh, which the host model's profiler counts (docs/kernels.md).
// Stochastic rounding draws one Philox hash per 1x16 block (a lane pair splits its rows' hashes)
// and finds each value's position by float16 arithmetic on the products' truncations, two values a
// word (e2m1_lut.cuh), adding random byte and sign two a word: no table;
// 4over6 decides each chunk in registers (four_over_six.cuh), its 1x16 candidates' rounded values
// from the float16 classes of their products; row-scaled copies take per-row global scales.
#include "cuda/async_copy.cuh"
#include "cuda/common.cuh"
#include "cuda/e2m1_lut.cuh"
#include "cuda/four_over_six.cuh"
#include "cuda/handlers.h"
#include "cuda/memory.cuh"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 8;                             // columns per thread
constexpr int kTileRows = (kThreads / 32) * kBlock;  // 64
constexpr int kTileCols = 32 * kCols;                // 256
constexpr int kCodes = 256;                          // E4M3 scale codes (0x7F: NaN)
constexpr int kChunks = 2 * kTileCols;               // 16-byte chunks of a staged columnwise tile

// Tiles in batch entries, row tiles and column tiles (a mixed-radix count).
struct TilePos {
  uint32_t b, tr, tc;
};

// The kernel's operands and options (by value).
struct Params {
  const float* amax;     // [B] (row-scaled: [B, M]): the rowwise copy and 16x16 blocks
  const float* amax_t;   // [B] (row-scaled: [B, N]): the columnwise 1x16 copy
  const uint32_t* seed;  // [2] or [4 + M] (placed): stochastic rounding's Stream (device memory)
  int64_t rows, cols;
  uint32_t batch, row_tiles, col_tiles;
  struct {
    uint32_t data_cols, scale_cols;      // bytes of a rowwise data and scale row
    uint32_t data_cols_t, scale_cols_t;  // of a columnwise one
  } out;
  TilePos step;       // the grid's size in tiles: a block's next tile is this far on
  uint32_t staged;    // staged tiles in the dynamic shared memory (Shared): 2, or 1
  uint32_t stages;    // kRing: the input ring's stages, 3 or 2 (kDirect: 0)
  bool placed;        // the seed holds the copy's place in a whole tensor (Stream)
  bool vec_in;        // N % 8 == 0: a thread's 8 columns are one 16-byte load
  bool vec_rows;      // the rowwise data and scale rows of a tile are whole 16-byte chunks
  bool vec_cols;      // the columnwise data rows are whole 16-byte chunks, scales 4-byte
  bool mapped;        // kRing: the kernel's tensor map of x is encoded (tensor copies)
  QuantizeSpec spec;  // its rht applies as columnwise_rht(): a columnwise 1x16 copy
  QuantizeOutputs o;
};

// The n-th tile of the count (a grid's first tiles, and its size in tiles).
NVFP4_HD TilePos tile_pos(uint32_t n, uint32_t row_tiles, uint32_t col_tiles) {
  return TilePos{n / (row_tiles * col_tiles), (n / col_tiles) % row_tiles, n % col_tiles};
}

// The next tile of a block: `step` further on in the count (no division).
__device__ __forceinline__ void advance(TilePos& t, const Params& p) {
  t.tc += p.step.tc;
  t.tr += p.step.tr;
  t.b += p.step.b;
  if (t.tc >= p.col_tiles) {
    t.tc -= p.col_tiles;
    ++t.tr;
  }
  if (t.tr >= p.row_tiles) {
    t.tr -= p.row_tiles;
    ++t.b;
  }
}

// How the codes round: to nearest, stochastically, or to nearest with the 4over6 choice of
// the block scale (a kernel each, so that each keeps its registers).
enum class Mode { kNearest, kStochastic, kFourOverSix };

// How a tile's input reaches the registers: each thread loads its values from global memory when
// the tile's turn comes (kDirect), or bulk copies (cp.async.bulk, a row each) put the block's next
// tiles into a ring of Params::stages shared-memory stages (kMaxStages, or 2 where three do not
// fit) while it quantizes the current one, the copies running stages - 1 tiles ahead and completing
// on an mbarrier per stage (kRing: inputs of whole 16-byte rows, every rounding mode; float32's
// 64 KB stages are its values, which the direct kernel copies to shared memory itself).
// Both give the same bytes: only where the values come from differs.
enum class Load { kDirect, kRing };
constexpr uint32_t kMaxStages = 3;
// The most ring-kernel blocks a multiprocessor holds by registers: __launch_bounds__(kThreads, 1)
// lets ptxas use up to 255 a thread, 32 K of the 64 K for a block of kThreads.
constexpr size_t kRingBlocks = 2;

// Bytes of a stage: one tile of dtype L's values, rows kTileCols values apart.
template <typename L>
constexpr uint32_t kStageBytes = kTileRows * kTileCols * sizeof(typename L::T);

// A tile's outputs staged for 16-byte stores. Rowwise: a row's words (8 codes each) and block
// scales. Columnwise: column col's codes of tile rows 32h..32h+31 in 16-byte chunk
// staged_chunk(col, h), warp w's 8 bytes at 8 (w % 2); the column scales by column
// (staged_scale_row) and warp.
struct Staging {
  alignas(16) uint32_t row_data[kTileRows][kTileCols / kCols];
  alignas(16) uint8_t row_scale[kTileRows][kTileCols / kBlock];
  alignas(16) uint8_t col_data[kChunks][16];
  alignas(16) uint8_t col_scale[kTileCols][kTileRows / kBlock];
};

// The row of column col's scales in Staging::col_scale, XOR-swizzled: a warp's byte stores (lanes
// 8 columns, 32 bytes apart) spread over 32 banks instead of 4 (8-way conflicts); the readers'
// 4-byte loads of consecutive columns stay conflict-free.
__device__ __forceinline__ int staged_scale_row(int col) { return col ^ ((col >> 5) & 7); }

// The chunk of (col, half), XOR-swizzled: a warp's 8-byte stores (lanes 8 columns apart) spread
// over 8 bank groups instead of 1; the 16-byte reads of consecutive chunks stay conflict-free.
__device__ __forceinline__ int staged_chunk(int col, int half) {
  return (2 * col + half) ^ ((col >> 3) & 7);
}

// Per CUDA block, static: the code tables and the current batch entry's encode scales. Dynamic
// (sized by dynamic_shared_of): first nearest rounding's and 4over6's 32 KB class table
// (e2m1_lut.cuh, built from f16_codes) without the E2M1 convert for a 16-bit dtype, or float32's
// values (Values); then Params::staged
// staged tiles (two: a tile stages into one while the last one's stores may still read the other,
// so one barrier a tile suffices; one where two do not fit, as on sm_120); then the input ring
// (kRing).
struct Shared {
  uint8_t lut[kLutSize];
  alignas(16) uint8_t f16_codes[256];  // f16_class_code
  float enc[2][kCodes];                // [rowwise, columnwise][scale code]: block_encode_scale
  int safe[2];                         // whether that copy needs the tie-safe code index
  Mbarrier full[kMaxStages];           // kRing: stage s holds its tile (its bulk copies landed)
};

// 4over6's kernels hold two more tables. Only theirs: with these 2 KB, the direct sm_90 kernel's
// block (static, class table, two staged tiles, 1 KB reserved) took 76.3 KB, so 2 blocks fit a
// multiprocessor's 228 KB instead of 3.
struct FourOverSixShared : Shared {
  float class_value[256];  // f16_class_value
  float scale_value[256];  // e4m3_to_float
};

// The static shared memory of the kernels of rounding mode kMode.
template <Mode kMode>
using SharedOf = std::conditional_t<kMode == Mode::kFourOverSix, FourOverSixShared, Shared>;

// Three blocks of the direct nearest-rounding kernel fit an sm_90 multiprocessor's 228 KB (static
// shared memory, the class table, two staged tiles and the 1 KB a block reserves; its 168
// registers allow three too): with 1 KB more static shared memory two would.
static_assert(3 * (sizeof(Shared) + kLaneTableBytes + 2 * sizeof(Staging) + 1024) <= 228 * 1024,
              "the direct sm_90 quantize kernel would lose a block a multiprocessor");

// What quantizing one copy needs of its batch entry.
struct Copy {
  const float* enc;  // Shared::enc of the copy (unused when row-scaled: per-row scales)
  Index index;
  GlobalScales g;  // the entry's global scales (unused when row-scaled)
  bool exact;      // 4over6: units_always_exact(g.amax) (false when row-scaled)
};

// ---- loading: 16 rows x 8 columns, their column and row maxima ----

template <typename L>
constexpr int kWords = kPacked<L> ? kCols / 2 : kCols;  // 32-bit words of a thread's row

// A thread's 16 x 8 values of a tile as 32-bit words, row r in words (r, 0), (r, 1), ...
// 16-bit dtypes: two a word, in registers. float32: one a word, in the block's dynamic shared
// memory (128 registers of values left ptxas too few for the rest: it spilled), laid out as the
// tile is (rows of kRowQuads 16-byte quads: thread (w, l)'s row r is quads 2l and 2l + 1 of tile
// row 16w + r), so that a ring stage (kRing) holds them as its copies land them. A phase of 8
// lanes' 16-byte accesses (lanes 32 bytes apart) spans only 16 banks if every lane takes the same
// quad of its row (2-way conflicts), all 32 if lanes with bit 2 set take the other one. So where
// the thread writes its values itself (kDirect) its two quads trade places on those lanes, and
// quad() reads them in order conflict-free. A stage holds them in order: there quad() is 2-way,
// and turned_quad(r, q) reads quad q ^ `turned` of the row (turned: 1 on those lanes)
// conflict-free; its callers put the columns back (in_order, turned_column). Only its own thread
// reads them (no barrier).
template <typename L>
constexpr int kQuads = kWords<L> / 4;                           // 16-byte quads of a thread's row
constexpr int kRowQuads = kTileCols * int(sizeof(float)) / 16;  // of a float32 tile row

template <typename L, bool kInRegisters = kPacked<L>>
struct Values {
  uint32_t w[kBlock][kWords<L>];
  static constexpr uint32_t turned = 0;  // reads in order
  // The words live in registers: the tile's shared memory is not theirs.
  __device__ __forceinline__ explicit Values(uint4* /*tile*/, bool /*in_stage*/) {}
  __device__ __forceinline__ uint32_t word(int r, int i) const { return w[r][i]; }
  __device__ __forceinline__ void set_quad(int r, int q, uint4 v) {
    w[r][4 * q] = v.x;
    w[r][4 * q + 1] = v.y;
    w[r][4 * q + 2] = v.z;
    w[r][4 * q + 3] = v.w;
  }
};
template <typename L>
struct Values<L, false> {
  static_assert(kQuads<L> == 2, "a float32 row of a thread is two quads");
  uint4* q0;  // the thread's row 0, the quad this lane's phase reads first (row r: kRowQuads r on)
  uint4* q1;  // and the other one
  uint32_t turned;  // 1 where q0 is the row's second quad: lanes with bit 2 set of a stage
  // `tile`: the block's values (a float32 tile); `in_stage`: a ring stage's, in the tile's order.
  __device__ __forceinline__ Values(uint4* tile, bool in_stage) {
    const uint32_t lane = threadIdx.x % 32;
    uint4* row0 = tile + kBlock * kRowQuads * (threadIdx.x / 32) + 2 * lane;
    const uint32_t s = (lane >> 2) & 1u;
    q0 = row0 + s;
    q1 = row0 + (s ^ 1u);
    turned = in_stage ? s : 0u;
  }
  // Row r's quad q (columns 4q..4q + 3).
  __device__ __forceinline__ uint4 quad(int r, int q) const {
    return NVFP4_LDS(((uint32_t(q) ^ turned) ? q1 : q0) + r * kRowQuads);
  }
  // Row r's quad q ^ turned: conflict-free.
  __device__ __forceinline__ uint4 turned_quad(int r, int q) const {
    return NVFP4_LDS((q ? q1 : q0) + r * kRowQuads);
  }
  __device__ __forceinline__ uint32_t word(int r, int i) const {
    const uint4 q = quad(r, i / 4);
    return i % 4 == 0 ? q.x : i % 4 == 1 ? q.y : i % 4 == 2 ? q.z : q.w;
  }
  __device__ __forceinline__ void set_quad(int r, int q, uint4 v) {
    NVFP4_STS(((uint32_t(q) ^ turned) ? q1 : q0) + r * kRowQuads, v);
  }
};

// The dynamic shared memory of a block's float32 values (Values) when it loads them itself.
constexpr uint32_t kValuesBytes = kThreads * kBlock * kCols * sizeof(float);
static_assert(kValuesBytes == kTileRows * kRowQuads * 16, "the values are one float32 tile");

// The value of row r, column c of a thread's words.
template <typename L>
__device__ __forceinline__ float value(const Values<L>& w, int r, int c) {
  if constexpr (kPacked<L>)
    return L::load(uint16_t(c % 2 ? w.word(r, c / 2) >> 16 : w.word(r, c / 2)));
  else
    return bits_float(w.word(r, c));
}

// Row r's 8 values of a thread's words: float32's two quads read once each. kTurned: read as
// turned_quad reads them, v[c] is column c ^ 4 w.turned (in_order puts their codes in order).
template <typename L, bool kTurned = false>
__device__ __forceinline__ void row_values(const Values<L>& w, int r, float (&v)[kCols]) {
  if constexpr (kPacked<L>) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) v[c] = value<L>(w, r, c);
  } else {
    const uint4 q[2] = {kTurned ? w.turned_quad(r, 0) : w.quad(r, 0),
                        kTurned ? w.turned_quad(r, 1) : w.quad(r, 1)};
    const uint32_t* words = reinterpret_cast<const uint32_t*>(q);
#pragma unroll
    for (int c = 0; c < kCols; ++c) v[c] = bits_float(words[c]);
  }
}

// The codes of a row read by row_values<L, true> (code k in nibble k) in column order: the halves
// trade places where the row was read turned.
template <typename L>
__device__ __forceinline__ uint32_t in_order(const Values<L>& w, uint32_t word) {
  if constexpr (kPacked<L>)
    return word;
  else
    return byte_perm(word, 0u, w.turned ? 0x1032u : 0x3210u);
}

// The column that a turned read's column c is (c ^ 4 where the row is read turned).
template <typename L>
__device__ __forceinline__ int turned_column(const Values<L>& w, int c) {
  return c ^ int(4 * w.turned);
}

// Columns turned_column(w, c) and the one after it (c even), 16 rows each: float32's quads read
// once a row, conflict-free.
template <typename L>
__device__ __forceinline__ void column_pair(const Values<L>& w, int c, float (&t)[2][kBlock]) {
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    if constexpr (kPacked<L>) {
      t[0][r] = value<L>(w, r, c);
      t[1][r] = value<L>(w, r, c + 1);
    } else {
      const uint4 q = w.turned_quad(r, c / 4);
      t[0][r] = bits_float(c % 4 ? q.z : q.x);
      t[1][r] = bits_float(c % 4 ? q.w : q.y);
    }
  }
}

// The thread's values as words (zero outside the input, as the reference pads), the magnitude
// maxima of its 8 columns (16 rows each; col_mag[c] is column turned_column(w, c)'s, as the later
// reads take them) and of its 16 rows (16 columns each, with the pair's lane). `vec`: 16-byte loads
// (rows of a multiple of 8 values). `whole`: the tile lies inside the input (the steady state), so
// every value loads without a test. It comes from the tile's place, not from nrows == kBlock &&
// ncols == kCols: with that test, on an H200 (2026-11-27), the lane with exactly 8 columns left in
// a warp of fewer than 16 rows loaded the rows past the input's end (tests/cuda/test_cuda.py). The
// sm_90 SASS took the test from the predicate outputs of the VIMNMX.RELU instructions that clamp
// nrows and ncols (the suspected cause; not proven). kShared: x is a ring stage in shared memory
// (kRing), rows `cols` values apart; float32's w is that stage (Values).
template <typename L, bool kShared = false>
__device__ __forceinline__ void load_tile(const typename L::T* x, uint32_t cols, int nrows,
                                          int ncols, bool vec, bool whole, Values<L>& w,
                                          uint32_t (&col_mag)[kCols], uint32_t (&row_mag)[kBlock]) {
  using T = typename L::T;
  constexpr int kW = kWords<L>;
  // float32 from a stage: w reads the stage itself (Values), so nothing is copied. Its turned lanes
  // read a row's two quads the other way round (`rot`: w.turned), so that a phase of 8 lanes (32
  // bytes apart) spans the 32 banks; their column maxima stay in that order (turned_column).
  constexpr bool kInStage = kShared && !kPacked<L>;
  const uint32_t rot = kInStage ? w.turned : 0u;
  uint32_t cm[kW];      // column maxima (packed: columns 2i and 2i + 1 in word i)
  uint32_t rm[kBlock];  // row maxima over the thread's 8 columns
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    const T* src = x + uint32_t(r) * uint64_t(cols);
    uint4 q[kQuads<L>];
    if (vec) {
#pragma unroll
      for (int i = 0; i < kQuads<L>; ++i)
        q[i] = kShared ? NVFP4_LDS_IF(whole || (r < nrows && ncols > 0),
                                      reinterpret_cast<const uint4*>(src) + (i ^ rot),
                                      (uint4{0, 0, 0, 0}))
                       : NVFP4_LDG_IF(whole || (r < nrows && ncols > 0),
                                      reinterpret_cast<const uint4*>(src) + i, (uint4{0, 0, 0, 0}));
    } else {
      uint32_t e[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const T t = NVFP4_LDG_IF(r < nrows && c < ncols, src + c, T{});
        if constexpr (kPacked<L>)
          e[c] = t;
        else
          e[c] = float_bits(t);
      }
      uint32_t row[kW];
#pragma unroll
      for (int i = 0; i < kW; ++i) row[i] = kPacked<L> ? e[2 * i] | (e[2 * i + 1] << 16) : e[i];
#pragma unroll
      for (int i = 0; i < kQuads<L>; ++i)
        q[i] = uint4{row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]};
    }
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q);
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      cm[i] = r == 0 ? row[i] : max_magnitude<L>(cm[i], row[i]);
      rm[r] = i == 0 ? row[i] : max_magnitude<L>(rm[r], row[i]);
    }
    if constexpr (kInStage) {
      // The values stay in the stage, where a row the fill did not copy (past the input) reads
      // as zeros from here on, as the reference pads.
      if (!(whole || (r < nrows && ncols > 0))) {
#pragma unroll
        for (int i = 0; i < kQuads<L>; ++i) w.set_quad(r, i, uint4{0, 0, 0, 0});
      }
    } else {
#pragma unroll
      for (int i = 0; i < kQuads<L>; ++i) w.set_quad(r, i, q[i]);
    }
  }
  // Those zeros are stores of this thread's into the stage, which a later copy refills.
  if (kInStage && !whole) fence_proxy_async();
  // Row maxima over the pair's 16 columns.
  if constexpr (kPacked<L>) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) col_mag[c] = c % 2 ? cm[c / 2] >> 16 : cm[c / 2];
    // Rows r and r + 8 share a word: the low halves' max with the high halves'.
#pragma unroll
    for (int r = 0; r < kBlock / 2; ++r) {
      uint32_t z = max_magnitude<L>(byte_perm(rm[r], rm[r + 8], 0x5410),
                                    byte_perm(rm[r], rm[r + 8], 0x7632));
      z = max_magnitude<L>(z, __shfl_xor_sync(~0u, z, 1));
      row_mag[r] = z;
      row_mag[r + 8] = z >> 16;
    }
  } else {
#pragma unroll
    for (int c = 0; c < kCols; ++c) col_mag[c] = cm[c];
#pragma unroll
    for (int r = 0; r < kBlock; ++r)
      row_mag[r] = max_magnitude<L>(rm[r], __shfl_xor_sync(~0u, rm[r], 1));
  }
}

// ---- scales and codes ----

// The scale codes of two blocks (pre-fix: a NaN is 0x7F) packed as (hi << 8) | lo. The convert's
// saturation is block_scale's clamp to +-448 (inf too).
__device__ __forceinline__ uint32_t scale_pair(float bamax_hi, float bamax_lo,
                                               const GlobalScales& g_hi, const GlobalScales& g_lo) {
  return e4m3x2_satfinite(bamax_hi * g_hi.encode_div6, bamax_lo * g_lo.encode_div6);
}

// The element encode scale of scale code s (pre-fix): the entry's table, or a division when the
// copy is row-scaled.
__device__ __forceinline__ float encode_scale(const QuantizeSpec& spec, uint32_t s, const Copy& k,
                                              const GlobalScales& g) {
  return spec.row_scaled ? block_encode_scale(uint8_t(s), g) : NVFP4_LDS(k.enc + s);
}

// Two blocks' scales: their encode scales, and their stored scale codes (bytes 0 and 1, NaN
// fixed).
__device__ __forceinline__ uint32_t block_pair(const QuantizeSpec& spec, const Copy& k,
                                               float bamax_hi, float bamax_lo,
                                               const GlobalScales& g_hi, const GlobalScales& g_lo,
                                               float& enc_hi, float& enc_lo) {
  const uint32_t s = scale_pair(bamax_hi, bamax_lo, g_hi, g_lo);
  enc_lo = encode_scale(spec, s & 0xFFu, k, g_lo);
  enc_hi = encode_scale(spec, (s >> 8) & 0xFFu, k, g_hi);
  return fix_nan_scales(s);
}

// The global scales of row-scaled row (or column) i of those from `amax`, of `n` inside the
// input; a padding row's amax is 0.
__device__ __forceinline__ GlobalScales row_scales(const QuantizeSpec& spec, const float* amax,
                                                   int i, int n) {
  return spec.global_scales(NVFP4_LDG_IF(i < n, amax + i, 0.0f));
}

// Row-scaled rowwise copies: lane l's global scales are those of the warp's row l % 16 (each lane
// divides for one row); row_scales_of hands them to the lanes that quantize that row (every lane
// of the warp calls both), rather than each lane dividing for all 16 or its own 8.
__device__ __forceinline__ GlobalScales lane_row_scales(const QuantizeSpec& spec, const float* amax,
                                                        int nrows) {
  return row_scales(spec, amax, int(threadIdx.x % kBlock), nrows);
}

__device__ __forceinline__ GlobalScales row_scales_of(const GlobalScales& lane, int r) {
  return GlobalScales{__shfl_sync(~0u, lane.encode, r), __shfl_sync(~0u, lane.encode_div6, r),
                      __shfl_sync(~0u, lane.decode, r), __shfl_sync(~0u, lane.amax, r),
                      lane.divisor};
}

// The codes code(0), ..., code(7) packed into a word, code k in nibble k. (Nibbles do not
// overlap: + is |, and (word << 4) + code is one LEA.)
template <typename Code>
__device__ __forceinline__ uint32_t pack8(Code code) {
  uint32_t word = 0;
#pragma unroll
  for (int k = 7; k >= 0; --k) word = (word << 4) + code(k);
  return word;
}

// The block's class table (e2m1_lut.cuh), in its dynamic shared memory, and the byte offset of
// this lane's copy in it.
__device__ __forceinline__ const uint8_t* class_table() { return dynamic_shared(); }
__device__ __forceinline__ uint32_t lane4() { return 4u * (threadIdx.x & 31u); }

// The product fp32(x * enc) that the E2M1 convert rounds, with -0.0 as +0.0 (the convert keeps
// the sign; the reference's code is 0): one FFMA x * enc + 0 under the fast index, where no
// product underflows to -0.0; else x * enc, then + 0 (two instructions). The convert rounds to
// nearest even as the reference does, ties included: it needs no tie-safe index.
template <Index kIndex>
__device__ __forceinline__ float convert_product(float x, float enc) {
  return kIndex == Index::kFast ? fma_rn(x, enc, 0.0f) : x * enc + 0.0f;
}

// Codes of 8 values rounded to nearest, value k in nibble k, found as kIndex says.
template <Index kIndex, typename Get>
__device__ __forceinline__ uint32_t nearest8(const uint8_t* lut, float enc, Get get) {
  if (NVFP4_HAS_FP4_CVT()) {
    NVFP4_PATH(kIndex == Index::kFast ? "nearest8: E2M1 convert"
                                      : "nearest8: E2M1 convert, tie-safe");
    // A NaN product comes only from a NaN encode scale (a block with a NaN), whose codes are 0.
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 8; k += 2)
      word |= uint32_t(cvt_rn_satfinite_e2m1x2(convert_product<kIndex>(get(k + 1), enc),
                                               convert_product<kIndex>(get(k), enc)))
              << (4 * k);
    return enc == enc ? word : 0u;
  }
  if (kIndex != Index::kLutSafe) {  // by pairs: 4 code bytes
    NVFP4_PATH(kIndex == Index::kFast ? "nearest8: class table"
                                      : "nearest8: class table, tie-safe");
    uint32_t word = 0;
#pragma unroll
    for (int k = 6; k >= 0; k -= 2)
      word = (word << 8) + pair_code<kIndex == Index::kClassSafe>(class_table(), lane4(), get(k),
                                                                  get(k + 1), enc);
    return word;
  }
  NVFP4_PATH("nearest8: code table, tie-safe");
  return pack8([&](int k) { return lut_code<true>(lut, get(k), enc); });
}

// nearest8 with the index chosen at run time.
template <typename Get>
__device__ __forceinline__ uint32_t nearest8(const uint8_t* lut, Index index, float enc, Get get) {
  switch (index) {
    case Index::kFast:
      return nearest8<Index::kFast>(lut, enc, get);
    case Index::kClassSafe:
      return nearest8<Index::kClassSafe>(lut, enc, get);
    default:
      return nearest8<Index::kLutSafe>(lut, enc, get);
  }
}

// The codes of two values rounded to nearest as the byte (code(v1) << 4) | code(v0), as nearest8
// takes them; with the convert, a NaN encode scale's byte is garbage (the caller zeroes its
// block).
template <Index kIndex>
__device__ __forceinline__ uint32_t nearest2(const uint8_t* lut, float enc, float v0, float v1) {
  NVFP4_PATH(NVFP4_HAS_FP4_CVT() && kIndex == Index::kFast ? "nearest2: E2M1 convert"
             : NVFP4_HAS_FP4_CVT()                         ? "nearest2: E2M1 convert, tie-safe"
             : kIndex == Index::kFast                      ? "nearest2: class table"
             : kIndex == Index::kClassSafe                 ? "nearest2: class table, tie-safe"
                                                           : "nearest2: code table, tie-safe");
  if (NVFP4_HAS_FP4_CVT())
    return cvt_rn_satfinite_e2m1x2(convert_product<kIndex>(v1, enc),
                                   convert_product<kIndex>(v0, enc));
  if (kIndex != Index::kLutSafe)
    return pair_code<kIndex == Index::kClassSafe>(class_table(), lane4(), v0, v1, enc);
  return lut_code<true>(lut, v0, enc) + (lut_code<true>(lut, v1, enc) << 4);
}

// sr_pair_sums of values v0 and v1 (the high half) under encode scale enc, their random bytes
// bytes 2 half and 2 half + 1 of `random`. kFast: the products x * enc + 0 in one FFMA each, for
// an encode scale where no product underflows to -0.0 (underflow_possible).
template <bool kFast>
__device__ __forceinline__ uint32_t stochastic2(float enc, float v0, float v1, uint32_t random,
                                                int half) {
  const auto product = [&](float v) { return kFast ? fma_rn(v, enc, 0.0f) : v * enc + 0.0f; };
  const float q0 = product(v0), q1 = product(v1);
  return sr_pair_sums(cvt_rz_f16x2(q1, q0), sr_below_one_pair(q0, q1), random,
                      half ? 0xF3D2u : 0xF1D0u);
}

// The codes of 8 values packed from their 4 sr_pair_sums words (codes 2j and 2j + 1 in bits 9-12
// and 25-28 of x[j]): gathered by byte (bytes 1 and 3: 0x80 + 2 code + a stray bit), codes 0, 2,
// 4, 6 and 1, 3, 5, 7, then each shifted into its nibble and the rest masked off.
__device__ __forceinline__ uint32_t pack_sums(const uint32_t (&x)[4]) {
  const uint32_t a = byte_perm(x[0], x[1], 0x7351), b = byte_perm(x[2], x[3], 0x7351);
  return ((byte_perm(a, b, 0x5410) >> 1) & 0x0F0F0F0Fu) |
         ((byte_perm(a, b, 0x7632) << 3) & 0xF0F0F0F0u);
}

// Codes of 8 values rounded stochastically by the random bytes of two words (value k: byte k % 4
// of word k / 4), two values at a time by float16 arithmetic (stochastic2, pack_sums). A NaN
// encode scale (a block with a NaN) gives code 0 throughout, as the reference's NaN products do.
template <bool kFast, typename Get>
__device__ __forceinline__ uint32_t stochastic8(float enc, uint32_t w0, uint32_t w1, Get get) {
  NVFP4_PATH(kFast ? "stochastic8: float16 pairs, fast" : "stochastic8: float16 pairs");
  uint32_t x[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    x[j] = stochastic2<kFast>(enc, get(2 * j), get(2 * j + 1), j < 2 ? w0 : w1, j % 2);
  return enc == enc ? pack_sums(x) : 0u;
}

// stochastic8 with the copy's index read at run time (kFast or not).
template <typename Get>
__device__ __forceinline__ uint32_t stochastic8(Index index, float enc, uint32_t w0, uint32_t w1,
                                                Get get) {
  if (index == Index::kFast) return stochastic8<true>(enc, w0, w1, get);
  return stochastic8<false>(enc, w0, w1, get);
}

// Codes of 8 values rounded to nearest by the scalar reference path (4over6's candidates).
template <typename Get>
__device__ __forceinline__ uint32_t reference8(float enc, Get get) {
  return pack8([&](int k) { return quantize_value(get(k), enc); });
}

// Transposes 8 words of 8 nibbles (word r, nibble c -> word c, nibble r).
__device__ __forceinline__ void transpose8x8(uint32_t (&a)[8]) {
#pragma unroll
  for (int r = 0; r < 8; r += 2) {  // 1x1 nibbles across word pairs
    const uint32_t t = ((a[r] >> 4) ^ a[r + 1]) & 0x0F0F0F0Fu;
    a[r + 1] ^= t;
    a[r] ^= t << 4;
  }
#pragma unroll
  for (int r = 0; r < 8; r += 4)  // 2x2 blocks of nibbles
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t t = ((a[r + i] >> 8) ^ a[r + i + 2]) & 0x00FF00FFu;
      a[r + i + 2] ^= t;
      a[r + i] ^= t << 8;
    }
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // 4x4 blocks
    const uint32_t t = ((a[i] >> 16) ^ a[i + 4]) & 0x0000FFFFu;
    a[i + 4] ^= t;
    a[i] ^= t << 16;
  }
}

// ---- one tile ----

// Where a thread's 16 x 8 values of a tile sit.
struct Place {
  uint32_t b, m0, n0;  // batch entry, first row, first column
  int nrows, ncols;    // of those inside the input (0 to 16, 0 to 8)
};

// Stages the rowwise copy's word of the thread's row r (the codes of its 8 columns).
__device__ __forceinline__ void stage_row(Staging& st, int r, uint32_t word) {
  NVFP4_STS(&st.row_data[kBlock * (threadIdx.x / 32) + r][threadIdx.x % 32], word);
}

// Stages the rowwise block scale of the thread's row r (its low byte; `r` may differ between
// the lanes of a pair).
__device__ __forceinline__ void stage_row_scale(Staging& st, int r, uint32_t scale) {
  NVFP4_STS(&st.row_scale[kBlock * (threadIdx.x / 32) + r][(threadIdx.x % 32) / 2], uint8_t(scale));
}

// The first row of the pair's rows whose rowwise scales this lane stages: the even lane rows
// 0-7, the odd lane 8-15.
__device__ __forceinline__ int own_rows() { return (threadIdx.x & 1u) ? kBlock / 2 : 0; }

// The random words of the thread's 8 values in each of its 16 rows (rows m0.. of batch entry b,
// their 1x16 block j, the rowwise stream: Stream::row_block): w[r] = words 0-1 of the block's hash
// (even lane, values 0-7) or 2-3 (odd lane). Each lane hashes 8 of the pair's 16 row blocks (the
// even lane rows i, the odd lane rows i + 8) and hands its partner the half it needs; step i
// (row_random_step) gives the words of rows i (lo) and i + 8 (hi).
__device__ __forceinline__ void row_random_step(const Stream& seed, uint32_t j, uint32_t m0,
                                                uint32_t b, int i, uint2& lo, uint2& hi) {
  const bool odd = threadIdx.x & 1u;
  uint32_t h[4];
  seed.row_block(j, m0 + uint32_t(i + (odd ? kBlock / 2 : 0)), b, h);
  const uint2 keep = odd ? uint2{h[2], h[3]} : uint2{h[0], h[1]};
  const uint2 give = odd ? uint2{h[0], h[1]} : uint2{h[2], h[3]};
  const uint2 got{__shfl_xor_sync(~0u, give.x, 1), __shfl_xor_sync(~0u, give.y, 1)};
  lo = odd ? got : keep;
  hi = odd ? keep : got;
}
__device__ __forceinline__ void row_random(const Stream& seed, uint32_t j, uint32_t m0, uint32_t b,
                                           uint2 (&w)[kBlock]) {
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) row_random_step(seed, j, m0, b, i, w[i], w[i + kBlock / 2]);
}

// The magnitude maximum of own row own_rows() + i from load_tile's row maxima (packed dtypes:
// rows i and i + 8 in the halves of row_mag[i]), picked without a branch.
template <typename L>
__device__ __forceinline__ float own_magnitude(const uint32_t (&row_mag)[kBlock], int i) {
  const bool odd = threadIdx.x & 1u;
  if constexpr (std::is_same_v<L, LoadBF16>)  // the half to the high 16 bits: its float bits
    return fabsf(bits_float(byte_perm(row_mag[i], 0, odd ? 0x3244u : 0x1044u)));
  else if constexpr (kPacked<L>)
    return fabsf(L::load(uint16_t(byte_perm(row_mag[i], 0, odd ? 0x4432u : 0x4410u))));
  else
    return magnitude_value<L>(odd ? row_mag[i + kBlock / 2] : row_mag[i]);
}

// Copies 16 staged bytes to global memory where `ok`: one 16-byte store where `vec`, else the
// first n bytes one by one. `site`: the caller's (NVFP4_HERE), for the host model's counters.
__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src, bool ok, bool vec,
                                       uint32_t n, const char* site) {
  if (vec) {
    const uint4 v = NVFP4_LDS_AT(site, reinterpret_cast<const uint4*>(src));
    NVFP4_STG_IF_AT(site, ok, reinterpret_cast<uint4*>(dst), v);
  } else if (ok) {
    for (uint32_t k = 0; k < 16 && k < n; ++k)
      NVFP4_STG_IF_AT(site, true, dst + k, NVFP4_LDS_AT(site, src + k));
  }
}

// Writes a staged rowwise tile (rows tm0.. of columns tn0..): thread t copies 16-byte chunk
// t % 8 of rows t / 8 + 16 j, and threads 0-63 the rows' scales. kFast: the tile is inside the
// input and its data and scale rows are whole 16-byte chunks (no test).
template <bool kFast>
__device__ __forceinline__ void store_rows(const Params& p, const Staging& st, uint32_t b,
                                           uint32_t tm0, uint32_t tn0) {
  constexpr int kParts = kTileCols / 2 / 16;  // 16-byte chunks of a row's data
  constexpr int kStep = kThreads / kParts;    // rows apart
  const uint32_t rows = uint32_t(p.rows), data_cols = p.out.data_cols;
  const bool vec = kFast || p.vec_rows;
  const uint32_t row = threadIdx.x / kParts, start = tn0 / 2 + 16 * (threadIdx.x % kParts);
  uint8_t* dst = p.o.data + (uint64_t(b) * rows + tm0 + row) * data_cols + start;
  const uint64_t step = uint64_t(kStep) * data_cols;
  const uint8_t* src =
      reinterpret_cast<const uint8_t*>(st.row_data[row]) + 16 * (threadIdx.x % kParts);
#pragma unroll
  for (int j = 0; j < kTileRows / kStep; ++j, dst += step) {
    const bool ok = kFast || (tm0 + row + kStep * j < rows && start < data_cols);
    copy16(dst, src + kStep * j * sizeof(st.row_data[0]), ok, vec, data_cols - start, NVFP4_HERE);
  }
  const uint32_t scale_cols = p.out.scale_cols, first = tn0 / kBlock;
  if (threadIdx.x < kTileRows)
    copy16(p.o.scale + (uint64_t(b) * rows + tm0 + threadIdx.x) * scale_cols + first,
           st.row_scale[threadIdx.x], kFast || (tm0 + threadIdx.x < rows && first < scale_cols),
           vec, scale_cols - first, NVFP4_HERE);
}

// Stages column c's 16 codes (two words: rows 0-7, 8-15) and block scale.
__device__ __forceinline__ void stage_column(Staging& st, int c, uint32_t lo, uint32_t hi,
                                             uint32_t scale) {
  const int col = kCols * int(threadIdx.x % 32) + c, warp = threadIdx.x / 32;
  NVFP4_STS(reinterpret_cast<uint2*>(&st.col_data[staged_chunk(col, warp / 2)][8 * (warp % 2)]),
            (uint2{lo, hi}));
  NVFP4_STS(&st.col_scale[staged_scale_row(col)][warp], uint8_t(scale));
}

// Writes a staged columnwise tile (rows tm0.. of columns tn0..): thread t copies chunk
// t % 2 of columns t / 2 + 64 j, and the scales of columns t + 128 j. kFast: the tile is inside
// the input, its data rows whole 16-byte chunks and its scale rows 4-byte ones (no test).
template <bool kFast>
__device__ __forceinline__ void store_columns(const Params& p, const Staging& st, uint32_t b,
                                              uint32_t tm0, uint32_t tn0) {
  constexpr int kStep = kThreads / 2;  // columns apart
  const uint32_t cols = uint32_t(p.cols), data_cols = p.out.data_cols_t;
  const bool vec = kFast || p.vec_cols;
  const uint32_t col = threadIdx.x / 2, half = threadIdx.x % 2, start = tm0 / 2 + 16 * half;
  uint8_t* dst = p.o.data_t + (uint64_t(b) * cols + tn0 + col) * data_cols + start;
  const uint64_t step = uint64_t(kStep) * data_cols;
#pragma unroll
  for (int j = 0; j < kTileCols / kStep; ++j, dst += step) {
    const bool ok = kFast || (tn0 + col + kStep * j < cols && start < data_cols);
    // staged_chunk(col + kStep j, half): the swizzle's XOR term is the same for every j.
    copy16(dst, st.col_data[staged_chunk(col, half) + 2 * kStep * j], ok, vec, data_cols - start,
           NVFP4_HERE);
  }
  const uint32_t scale_cols = p.out.scale_cols_t, first = tm0 / kBlock;
  uint8_t* scale = p.o.scale_t + (uint64_t(b) * cols + tn0 + threadIdx.x) * scale_cols + first;
  const uint64_t scale_step = uint64_t(kThreads) * scale_cols;
#pragma unroll
  for (int j = 0; j < kTileCols / kThreads; ++j, scale += scale_step) {
    const uint32_t c = threadIdx.x + kThreads * j;
    const bool ok = kFast || (tn0 + c < cols && first < scale_cols);
    if (vec) {
      const uint32_t v =
          NVFP4_LDS(reinterpret_cast<const uint32_t*>(st.col_scale[staged_scale_row(int(c))]));
      NVFP4_STG_IF(ok, reinterpret_cast<uint32_t*>(scale), v);
    } else if (ok) {
      for (uint32_t k = 0; k < kTileRows / kBlock && first + k < scale_cols; ++k)
        NVFP4_STG(scale + k, NVFP4_LDS(&st.col_scale[staged_scale_row(int(c))][k]));
    }
  }
}

// 16x16 blocks: the pair's 16 columns share a block; one quantization serves both copies (with
// 4over6 each copy makes its own choice).
template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_2d(const Params& p, Shared& sh, Staging& st,
                                            const Place& at, const Values<L>& w,
                                            const uint32_t (&col_mag)[kCols], const Copy& kr,
                                            const Stream& seed) {
  const QuantizeSpec& spec = p.spec;
  const auto v = [&](int r, int c) { return value<L>(w, r, c); };
  uint32_t mag = col_mag[0];
#pragma unroll
  for (int c = 1; c < kCols; ++c) mag = max_magnitude<L>(mag, col_mag[c]);
  const float bamax = magnitude_value<L>(max_magnitude<L>(mag, __shfl_xor_sync(~0u, mag, 1)));
  const GlobalScales& g = kr.g;
  uint32_t words[kBlock], scale_r, scale_c;
  float enc_c = 0.0f;
  if constexpr (kMode == Mode::kFourOverSix) {
    Candidate row, col;
    tile_choice(v, bamax, g, spec.four_over_six(), row, col);
    scale_r = row.scale;
    scale_c = col.scale;
    enc_c = col.enc;
#pragma unroll
    for (int r = 0; r < kBlock; ++r) words[r] = reference8(row.enc, [&](int k) { return v(r, k); });
  } else {
    const uint32_t s = scale_pair(bamax, bamax, g, g) & 0xFFu;
    const float enc = NVFP4_LDS(kr.enc + s);
    scale_r = scale_c = s;
    // Stochastic bytes come from the rowwise stream of the padded [B, Mp, Np] tile array.
    uint2 rw[kBlock];
    if constexpr (kMode == Mode::kStochastic) row_random(seed, at.n0 / kBlock, at.m0, at.b, rw);
#pragma unroll
    for (int r = 0; r < kBlock; ++r) {
      float u[kCols];  // read turned: the random words of a turned row trade places too
      row_values<L, true>(w, r, u);
      if constexpr (kMode == Mode::kStochastic) {
        const uint32_t w0 = w.turned ? rw[r].y : rw[r].x, w1 = w.turned ? rw[r].x : rw[r].y;
        words[r] = in_order(w, stochastic8(kr.index, enc, w0, w1, [&](int k) { return u[k]; }));
      } else {
        words[r] = in_order(w, nearest8(sh.lut, kr.index, enc, [&](int k) { return u[k]; }));
      }
    }
  }
  scale_r = fix_nan_scales(scale_r) & 0xFFu;
  scale_c = fix_nan_scales(scale_c) & 0xFFu;
  if (p.o.data) {
#pragma unroll
    for (int r = 0; r < kBlock; ++r) stage_row(st, r, words[r]);
#pragma unroll
    for (int i = 0; i < kBlock / 2; ++i) stage_row_scale(st, own_rows() + i, scale_r);
  }
  if (p.o.data_t) {
    if constexpr (kMode == Mode::kFourOverSix) {
#pragma unroll
      for (int r = 0; r < kBlock; ++r) words[r] = reference8(enc_c, [&](int k) { return v(r, k); });
    }
    uint32_t lo[8], hi[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      lo[r] = words[r];
      hi[r] = words[r + 8];
    }
    transpose8x8(lo);
    transpose8x8(hi);
#pragma unroll
    for (int c = 0; c < kCols; ++c) stage_column(st, c, lo[c], hi[c], scale_c);
  }
}

// Stochastic rounding's rowwise 1x16 copy (block n0 / 16 of row m draws counter (n0 / 16, m, b,
// 0)) under encode scales enc_r. Step i takes rows i and i + 8, whose random words the even and
// the odd lane hash (row_random_step), so that one step's words are live, not all 16 rows'.
template <typename L, bool kFast>
__device__ __forceinline__ void stochastic_rows(Staging& st, const Place& at, const Values<L>& w,
                                                const float (&enc_r)[kBlock], const Stream& seed) {
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) {
    uint2 rw[2];
    row_random_step(seed, at.n0 / kBlock, at.m0, at.b, i, rw[0], rw[1]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = i + half * (kBlock / 2);
      float v[kCols];  // read turned: the random words of a turned row trade places too
      row_values<L, true>(w, r, v);
      const uint32_t w0 = w.turned ? rw[half].y : rw[half].x;
      const uint32_t w1 = w.turned ? rw[half].x : rw[half].y;
      stage_row(st, r,
                in_order(w, stochastic8<kFast>(enc_r[r], w0, w1, [&](int k) { return v[k]; })));
    }
  }
}

// 4over6's rowwise 1x16 copy. Step i takes rows i and i + 8: the even lane computes row i's
// candidates, the odd lane row i + 8's, and each hands the other its own, so that only one step's
// candidates are live (a lane's 8 rows of them at once spilled: 456 bytes for bfloat16 on sm_90).
// The copy's index is read at run time: one instantiation of this pass per dtype (build time).
template <typename L>
__device__ __forceinline__ void four_over_six_rows(const Params& p, const FourOverSixShared& sh,
                                                   Staging& st, const Values<L>& w,
                                                   const uint32_t (&row_mag)[kBlock],
                                                   const Copy& kr, const GlobalScales& lane_g) {
  const QuantizeSpec& spec = p.spec;
  const int own = own_rows();
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) {
    FastCandidate c6, c4;  // of row own + i
    fast_candidates(
        own_magnitude<L>(row_mag, i), spec.row_scaled ? row_scales_of(lane_g, own + i) : kr.g,
        spec.row_scaled ? nullptr : kr.enc, sh.scale_value, spec.four_over_six().fast_math, c6, c4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = i + half * (kBlock / 2);
      const bool mine = (half == 1) == (own != 0);  // this lane stages row r's scale
      float v[kCols];
      row_values<L>(w, r, v);
      const GlobalScales g = spec.row_scaled ? row_scales_of(lane_g, r) : kr.g;
      const Candidate chosen =
          row_choice(sh.class_value, v, pick_candidate(mine, c6), pick_candidate(mine, c4), g,
                     spec.four_over_six(), kr.exact, kr.index != Index::kFast);
      stage_row(st, r, nearest8(sh.lut, kr.index, chosen.enc, [&](int k) { return v[k]; }));
      if (mine) stage_row_scale(st, r, fix_nan_scales(chosen.scale));
    }
  }
}

// 1x16 blocks, one pass over the rows: the rowwise copy's words and scales, and with `fused`
// the columnwise copy's codes (nearest rounding of the values themselves: no rht) from the same
// unpacked values. kIndex: how both copies find their codes (nearest rounding; stochastic
// rounding's rows; 4over6 reads its copy's index at run time).
template <typename L, Mode kMode, Index kIndex>
__device__ __forceinline__ void quantize_rows(const Params& p, SharedOf<kMode>& sh, Staging& st,
                                              const Place& at, const Values<L>& w,
                                              const uint32_t (&col_mag)[kCols],
                                              const uint32_t (&row_mag)[kBlock], const Copy& kr,
                                              const Copy& kc, bool fused, const Stream& seed) {
  const QuantizeSpec& spec = p.spec;
  const bool rows_on = p.o.data != nullptr;
  const int own = own_rows();
  GlobalScales lane_g{};
  if (spec.row_scaled && rows_on)
    lane_g = lane_row_scales(spec, p.amax + at.b * p.rows + at.m0, at.nrows);
  if constexpr (kMode == Mode::kFourOverSix) {  // no fused columnwise copy
    if (rows_on) four_over_six_rows<L>(p, sh, st, w, row_mag, kr, lane_g);
    return;
  }
  // Rowwise scales (4over6 chooses its own in four_over_six_rows): each lane of the pair computes
  // those of its own 8 rows and takes the other 8 from its partner.
  float enc_r[kBlock];
  if (rows_on) {
    float enc_own[kBlock / 2];
#pragma unroll
    for (int i = 0; i < kBlock / 2; i += 2) {
      GlobalScales g0 = kr.g, g1 = kr.g;
      if (spec.row_scaled) {
        g0 = row_scales_of(lane_g, own + i);
        g1 = row_scales_of(lane_g, own + i + 1);
      }
      const uint32_t fixed =
          block_pair(spec, kr, own_magnitude<L>(row_mag, i + 1), own_magnitude<L>(row_mag, i), g1,
                     g0, enc_own[i + 1], enc_own[i]);
      stage_row_scale(st, own + i, fixed);
      stage_row_scale(st, own + i + 1, fixed >> 8);
    }
#pragma unroll
    for (int i = 0; i < kBlock / 2; ++i) {
      const float other = __shfl_xor_sync(~0u, enc_own[i], 1);
      enc_r[i] = own ? other : enc_own[i];
      enc_r[i + kBlock / 2] = own ? enc_own[i] : other;
    }
  }
  if constexpr (kMode == Mode::kStochastic) {  // no fused columnwise copy
    if (rows_on) stochastic_rows<L, kIndex == Index::kFast>(st, at, w, enc_r, seed);
    return;
  }
  // Nearest rounding from here on. The rows are read turned (row_values<L, true>): the fused
  // columnwise copy's column c (its scales, codes) is turned_column(w, c).
  float enc_c[kCols];
  uint32_t scale_c[kCols / 2];
  if (fused) {
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      GlobalScales g0 = kc.g, g1 = kc.g;
      if (spec.row_scaled) {
        const float* a = p.amax_t + at.b * p.cols + at.n0;
        g0 = row_scales(spec, a, turned_column(w, c), at.ncols);
        g1 = row_scales(spec, a, turned_column(w, c) + 1, at.ncols);
      }
      scale_c[c / 2] = block_pair(spec, kc, magnitude_value<L>(col_mag[c + 1]),
                                  magnitude_value<L>(col_mag[c]), g1, g0, enc_c[c + 1], enc_c[c]);
    }
  }
  uint32_t acc[kCols][2];  // fused: column c's codes of rows 0-7 and 8-15
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c][0] = acc[c][1] = 0;
#pragma unroll
  for (int r = 0; r < kBlock; r += 2) {
    float v[2][kCols];
    row_values<L, true>(w, r, v[0]);
    row_values<L, true>(w, r + 1, v[1]);
    if (rows_on) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        stage_row(
            st, r + j,
            in_order(w, nearest8<kIndex>(sh.lut, enc_r[r + j], [&](int k) { return v[j][k]; })));
      }
    }
    if (fused) {
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        acc[c][r / 8] += nearest2<kIndex>(sh.lut, enc_c[c], v[0][c], v[1][c]) << (4 * (r % 8));
    }
  }
  if (fused) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (NVFP4_HAS_FP4_CVT() && enc_c[c] != enc_c[c]) acc[c][0] = acc[c][1] = 0;
      stage_column(st, turned_column(w, c), acc[c][0], acc[c][1], scale_c[c / 2] >> (8 * (c % 2)));
    }
  }
}

// The RHT of a column's 16 values in place, rounded to the input dtype (rht16_narrow), and the
// magnitude maximum of the result. 16-bit dtypes round two values a convert (store2) and take the
// maximum on the packed pairs, as load_tile does.
template <typename L>
__device__ __forceinline__ float rht_column(float (&t)[kBlock]) {
  if constexpr (kPacked<L>) {
    using S = std::conditional_t<std::is_same_v<L, LoadBF16>, StoreBF16, StoreF16>;
    rht16(t);
    uint32_t m = 0;
#pragma unroll
    for (int r = 0; r < kBlock; r += 2) {
      const uint32_t pair = store2<S>(t[r + 1], t[r]);
      t[r] = L::load(uint16_t(pair));
      t[r + 1] = L::load(uint16_t(pair >> 16));
      m = r == 0 ? pair : max_magnitude<L>(m, pair);
    }
    return magnitude_value<L>(max_magnitude<L>(m, m >> 16));
  } else {
    rht16_narrow<L>(t);
    uint32_t m = 0;
#pragma unroll
    for (int r = 0; r < kBlock; ++r) m = max(m, magnitude_bits(t[r]));
    return bits_float(m);
  }
}

// The columnwise 1x16 copy where it is not fused into the row pass: of the rht of the values,
// with stochastic rounding, or with 4over6. A column's 16 values are the block (with rht their
// transform; M % 16 == 0, so all 16 rows are real), in registers.
template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_columns(const Params& p, SharedOf<kMode>& sh, Staging& st,
                                                 const Place& at, const Values<L>& w,
                                                 const uint32_t (&col_mag)[kCols], const Copy& kc,
                                                 const Stream& seed) {
  const QuantizeSpec& spec = p.spec;
  const bool rht = spec.columnwise_rht();
  const uint32_t index = kMode == Mode::kStochastic ? seed.column_index(at.m0) : 0u;
#pragma unroll
  for (int turned_c = 0; turned_c < kCols; turned_c += 2) {
    const int c = turned_column(w, turned_c);  // column_pair's columns c and c + 1
    float t[2][kBlock];
    float bamax[2];
    column_pair<L>(w, turned_c, t);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      bamax[j] = magnitude_value<L>(col_mag[turned_c + j]);
      if (rht) bamax[j] = rht_column<L>(t[j]);
    }
    GlobalScales g[2] = {kc.g, kc.g};
    if (spec.row_scaled) {
      const float* a = p.amax_t + at.b * p.cols + at.n0;
      g[0] = row_scales(spec, a, c, at.ncols);
      g[1] = row_scales(spec, a, c + 1, at.ncols);
    }
    // The two columns' encode scales and stored scale codes (not used by 4over6).
    float enc[2] = {0.0f, 0.0f};
    uint32_t pair = 0;
    if constexpr (kMode != Mode::kFourOverSix)
      pair = block_pair(spec, kc, bamax[1], bamax[0], g[1], g[0], enc[1], enc[0]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t lo, hi, scale;
      const auto get = [&](int k) { return t[j][k]; };
      const auto get_hi = [&](int k) { return t[j][k + 8]; };
      if constexpr (kMode == Mode::kFourOverSix) {
        const float* enc_table = spec.row_scaled ? nullptr : kc.enc;
        const Candidate chosen =
            column_choice(sh.class_value, t[j], bamax[j], g[j], enc_table, sh.scale_value,
                          spec.four_over_six(), kc.exact, kc.index != Index::kFast);
        lo = nearest8(sh.lut, kc.index, chosen.enc, get);
        hi = nearest8(sh.lut, kc.index, chosen.enc, get_hi);
        scale = fix_nan_scales(chosen.scale);
      } else {
        scale = pair >> (8 * j);
        if constexpr (kMode == Mode::kStochastic) {
          // Column n's block (rows m0..m0 + 15) is block m0 / 16 of row n of the copy [B, N, M].
          uint32_t h[4];
          seed.column_block(index, at.n0 + c + j, at.b, h);
          lo = stochastic8(kc.index, enc[j], h[0], h[1], get);
          hi = stochastic8(kc.index, enc[j], h[2], h[3], get_hi);
        } else {
          lo = nearest8(sh.lut, kc.index, enc[j], get);
          hi = nearest8(sh.lut, kc.index, enc[j], get_hi);
        }
      }
      stage_column(st, c + j, lo, hi, scale);
    }
  }
}

// `stage`: the tile's values in a ring stage (kRing), or null (kDirect: from x).
template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_tile(const typename L::T* x, const Params& p,
                                              SharedOf<kMode>& sh, Staging& st, TilePos tile,
                                              const Copy& kr, const Copy& kc, const Stream& seed,
                                              const typename L::T* stage = nullptr) {
  const QuantizeSpec& spec = p.spec;
  const uint32_t rows = uint32_t(p.rows), cols = uint32_t(p.cols);  // < 2^31 - 256
  const uint32_t tm0 = tile.tr * kTileRows, tn0 = tile.tc * kTileCols;
  Place at;
  at.b = tile.b;
  at.m0 = tm0 + kBlock * (threadIdx.x / 32);
  at.n0 = tn0 + kCols * (threadIdx.x % 32);
  at.nrows = max(0, min(kBlock, int(rows) - int(at.m0)));
  at.ncols = max(0, min(kCols, int(cols) - int(at.n0)));
#if defined(NVFP4_SASS_BUDGET)
  __builtin_assume(at.nrows == kBlock && at.ncols == kCols);  // the steady state: inside
#endif

  // The whole tile inside the input (the steady state of a large input).
  const bool inside = tm0 + kTileRows <= rows && tn0 + kTileCols <= cols;
#if defined(NVFP4_SASS_BUDGET)
  __builtin_assume(inside);
#endif

  // Each copy's code index (e2m1_lut.cuh), for the host model's path counts.
  NVFP4_PATH(!p.o.data                       ? "rowwise index: none"
             : kr.index == Index::kFast      ? "rowwise index: fast"
             : kr.index == Index::kClassSafe ? "rowwise index: class tie-safe"
             : NVFP4_HAS_FP4_CVT()           ? "rowwise index: convert tie-safe"
                                             : "rowwise index: code-table tie-safe");
  NVFP4_PATH(!p.o.data_t                     ? "columnwise index: none"
             : spec.block_2d                 ? "columnwise index: the rowwise copy's"
             : kc.index == Index::kFast      ? "columnwise index: fast"
             : kc.index == Index::kClassSafe ? "columnwise index: class tie-safe"
             : NVFP4_HAS_FP4_CVT()           ? "columnwise index: convert tie-safe"
                                             : "columnwise index: code-table tie-safe");

  // float32: the block's values tile (Values): the stage, or the dynamic shared memory's start.
  uint4* values = stage != nullptr ? reinterpret_cast<uint4*>(const_cast<typename L::T*>(stage))
                                   : reinterpret_cast<uint4*>(dynamic_shared());
  Values<L> w(values, stage != nullptr);
  uint32_t col_mag[kCols], row_mag[kBlock];
  if (stage != nullptr)  // rows kTileCols apart; rows and columns past the input are not copied
    load_tile<L, true>(
        stage + (kBlock * (threadIdx.x / 32)) * kTileCols + kCols * (threadIdx.x % 32), kTileCols,
        at.nrows, at.ncols, true, inside, w, col_mag, row_mag);
  else
    load_tile<L>(x + (uint64_t(at.b) * rows + min(at.m0, rows)) * cols + min(at.n0, cols), cols,
                 at.nrows, at.ncols, p.vec_in, p.vec_in && inside, w, col_mag, row_mag);

  if (spec.block_2d) {
    quantize_2d<L, kMode>(p, sh, st, at, w, col_mag, kr, seed);
  } else {
    const bool fused = kMode == Mode::kNearest && p.o.data_t && !spec.columnwise_rht();
    // Nearest rounding takes its index as a template argument; the other modes, whose passes
    // are larger, read it at run time (4over6) or need none (stochastic rounding).
    const Index index = kMode == Mode::kStochastic ? kr.index  // not fused: the rows alone
                        : kMode != Mode::kNearest  ? Index::kFast
                        : kr.index > kc.index      ? kr.index
                                                   : kc.index;
    if (index == Index::kLutSafe || (kMode == Mode::kStochastic && index != Index::kFast))
      quantize_rows<L, kMode, Index::kLutSafe>(p, sh, st, at, w, col_mag, row_mag, kr, kc, fused,
                                               seed);
    else if (kMode != Mode::kStochastic && index == Index::kClassSafe)
      quantize_rows<L, kMode, Index::kClassSafe>(p, sh, st, at, w, col_mag, row_mag, kr, kc, fused,
                                                 seed);
    else
      quantize_rows<L, kMode, Index::kFast>(p, sh, st, at, w, col_mag, row_mag, kr, kc, fused,
                                            seed);
    if (p.o.data_t && !fused) quantize_columns<L, kMode>(p, sh, st, at, w, col_mag, kc, seed);
  }
  __syncthreads();  // the tile is staged
  if (p.o.data) {
    if (inside && p.vec_rows)
      store_rows<true>(p, st, at.b, tm0, tn0);
    else
      store_rows<false>(p, st, at.b, tm0, tn0);
  }
  if (p.o.data_t) {
    if (inside && p.vec_cols)
      store_columns<true>(p, st, at.b, tm0, tn0);
    else
      store_columns<false>(p, st, at.b, tm0, tn0);
  }
}

// Whether a block of a copy with global scales g can have scale code s: block maxima are
// magnitudes, so the code's sign is that of g.encode_div6 (positive but for a negative amax); the
// NaN code 0x7F (a block with a NaN: all its codes are 0) never needs the tie-safe index. So only
// these codes decide a copy's index (with all 256, every copy took a tie-safe one).
__device__ __forceinline__ bool reachable_scale(uint32_t s, const GlobalScales& g) {
  return s != 0x7Fu && (s >> 7) == (float_bits(g.encode_div6) >> 31);
}

// The encode scales of batch entry b's 256 scale codes for both copies, and each copy's code
// Index: kFast unless a tie is possible (tie_possible) or there is neither the convert nor the
// class table (`classes`: built); row-scaled copies have no table and always take a tie-safe one
// (every thread of the block calls). Stochastic rounding: kFast unless a product can underflow to
// -0.0 (underflow_possible), else kLutSafe.
template <typename L, Mode kMode>
__device__ __forceinline__ void prepare_entry(const Params& p, Shared& sh, uint32_t b, bool classes,
                                              Copy& kr, Copy& kc) {
  const QuantizeSpec& spec = p.spec;
  const Index safe = classes ? Index::kClassSafe : Index::kLutSafe;
  const bool fast = kMode == Mode::kStochastic || NVFP4_HAS_FP4_CVT() || classes;
  kr = Copy{nullptr, safe, GlobalScales{}, false};
  kc = kr;
  if (spec.row_scaled) return;
  kr.g = spec.global_scales(NVFP4_LDG(p.amax + b));
  kc.g = spec.global_scales(NVFP4_LDG(p.amax_t + b));
  kr.exact = units_always_exact(kr.g.amax);
  kc.exact = units_always_exact(kc.g.amax);
  __syncthreads();  // the previous entry's tables are no longer read
  if (threadIdx.x < 2) sh.safe[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * kCodes; i += kThreads) {
    const int copy = i / kCodes, s = i % kCodes;
    const GlobalScales& g = copy ? kc.g : kr.g;
    const float enc = block_encode_scale(uint8_t(s), g);
    sh.enc[copy][s] = enc;
    if (reachable_scale(uint32_t(s), g) &&
        (kMode == Mode::kStochastic ? underflow_possible<L>(enc) : tie_possible<L>(enc)))
      sh.safe[copy] = 1;
  }
  __syncthreads();
  kr.enc = sh.enc[0];
  kc.enc = sh.enc[1];
  kr.index = fast && sh.safe[0] == 0 ? Index::kFast : safe;
  kc.index = fast && sh.safe[1] == 0 ? Index::kFast : safe;
}

// Whether dtype L's kernel loading by kLoad can hold the class table at the start of its dynamic
// shared memory: not float32's direct kernel, whose values are there (its ring's are in the
// stages).
template <typename L, Load kLoad>
constexpr bool kClassTableRoom = kPacked<L> || kLoad == Load::kRing;

// Builds the class table in the block's dynamic shared memory where nearest rounding or 4over6
// has no E2M1 convert, the kernel has the room (kClassTableRoom) and the launch gave it; whether
// it did (else the kernel takes the code table's tie-safe index: slower, the same bytes: the class
// index serves any product, so float32's too). Stochastic rounding needs no table. Every thread
// of the block calls. `tail`: the bytes at the end of the dynamic shared memory that hold the
// staging and the ring.
template <typename L, Mode kMode, Load kLoad>
__device__ __forceinline__ bool build_dynamic_table(Shared& sh, uint32_t tail) {
  if constexpr (kClassTableRoom<L, kLoad> && kMode != Mode::kStochastic) {
    if (NVFP4_HAS_FP4_CVT() || dynamic_shared_size() < kLaneTableBytes + tail) return false;
    for (int i = threadIdx.x; i < 256; i += kThreads) sh.f16_codes[i] = f16_class_code(uint32_t(i));
    __syncthreads();
    // 16 bytes a store: words 4 j to 4 j + 3 are copies of class j / 8's code.
    auto* table = reinterpret_cast<uint4*>(dynamic_shared());
    for (int j = threadIdx.x; j < kLaneTableWords / 4; j += kThreads) {
      const uint32_t code = sh.f16_codes[j / 8];
      table[j] = uint4{code, code, code, code};
    }
    return true;
  } else {
    return false;
  }
}

// kRing: tile t's values into ring stage s (warp 0), completing on the stage's mbarrier. With a
// tensor map (`map`: x as [batch, rows, cols], boxes of one tile), one tensor copy of the tile,
// values past the input zero; without, a bulk copy a row (lane 0 announcing their bytes first),
// rows past the input not copied, nor columns past its end (p.vec_in: a row's part is whole
// 16-byte chunks). load_tile reads neither.
template <typename L>
__device__ __forceinline__ void load_stage(const typename L::T* x, const Params& p, Shared& sh,
                                           typename L::T* stage, int s, TilePos t,
                                           const TensorMap* map) {
  if (threadIdx.x >= 32) return;
  const uint32_t rows = uint32_t(p.rows), cols = uint32_t(p.cols);
  const uint32_t m0 = t.tr * kTileRows, n0 = t.tc * kTileCols;
  // The block read this stage last, before the barrier that led here.
  if (map != nullptr) {
    NVFP4_PATH("stage fill: a tensor copy a tile");
    if (threadIdx.x == 0) {
      mbarrier_arrive_expect_tx(&sh.full[s], kStageBytes<L>);
      fence_proxy_async();
      tensor_load_3d(stage, map, int32_t(n0), int32_t(m0), int32_t(t.b), &sh.full[s]);
    }
    return;
  }
  NVFP4_PATH("stage fill: a bulk copy a row");
  const uint32_t nrows = min(uint32_t(kTileRows), rows - m0);
  const uint32_t bytes = min(uint32_t(kTileCols), cols - n0) * uint32_t(sizeof(typename L::T));
  warp_bulk_load_rows(stage, kTileCols, x + (uint64_t(t.b) * rows + m0) * cols + n0, cols, nrows,
                      bytes, &sh.full[s]);
}

// The block's static code tables (every thread of the block calls; a barrier before they are read).
template <Mode kMode>
__device__ __forceinline__ void build_code_tables(SharedOf<kMode>& sh) {
  // The code table serves the tie-safe index without the E2M1 convert only (with it, the convert
  // does).
  if (!NVFP4_HAS_FP4_CVT())
    for (int i = threadIdx.x; i < kLutSize; i += kThreads) sh.lut[i] = lut_entry(uint32_t(i));
  if constexpr (kMode == Mode::kFourOverSix)
    for (int i = threadIdx.x; i < 256; i += kThreads) {
      sh.class_value[i] = f16_class_value(i);
      sh.scale_value[i] = e4m3_to_float(uint8_t(i));
    }
}

// Bytes of the input ring (Shared) of dtype L's kernel loading by kLoad, of `stages` stages.
template <typename L, Load kLoad>
NVFP4_HD constexpr uint32_t ring_bytes(uint32_t stages) {
  return kLoad == Load::kRing ? stages * kStageBytes<L> : 0;
}

// The staged tiles in the block's dynamic shared memory (Shared), before the ring.
template <typename L, Load kLoad>
__device__ __forceinline__ Staging* staged_tiles(const Params& p) {
  return reinterpret_cast<Staging*>(dynamic_shared() + dynamic_shared_size() -
                                    ring_bytes<L, kLoad>(p.stages)) -
         p.staged;
}

// `map`: kRing's tensor map of x, or null (bulk copies a row).
template <typename L, Mode kMode, Load kLoad = Load::kDirect>
__device__ __forceinline__ void quantize_tiles(const typename L::T* x, const Params& p,
                                               const TensorMap* map = nullptr) {
  __shared__ SharedOf<kMode> sh;
  const uint32_t ring_size = ring_bytes<L, kLoad>(p.stages);
  using T = typename L::T;
  constexpr uint32_t kStageValues = kStageBytes<L> / sizeof(T);
  T* ring = reinterpret_cast<T*>(dynamic_shared() + dynamic_shared_size() - ring_size);
  Staging* staged = staged_tiles<L, kLoad>(p);
  TilePos tile = tile_pos(blockIdx.x, p.row_tiles, p.col_tiles);
  TilePos ahead = tile;  // kRing: the next tile whose copies go out (stages - 1 tiles on)
  if constexpr (kLoad == Load::kRing) {  // the first tiles' copies go out before the tables
    NVFP4_PATH(p.stages == 3 ? "ring: three stages" : "ring: two stages");
    if (threadIdx.x == 0) {
      for (uint32_t s = 0; s < p.stages; ++s) mbarrier_init(&sh.full[s], 1);
      mbarrier_init_fence();
    }
    __syncthreads();
    for (uint32_t s = 0; s + 1 < p.stages; ++s, advance(ahead, p))
      if (ahead.b < p.batch) load_stage<L>(x, p, sh, ring + s * kStageValues, int(s), ahead, map);
  }
  build_code_tables<kMode>(sh);
  const bool classes =
      build_dynamic_table<L, kMode, kLoad>(sh, ring_size + p.staged * sizeof(Staging));
  __syncthreads();
  Stream seed{Seed{0, 0}};
  if constexpr (kMode == Mode::kStochastic) seed = stream_of(p.seed, p.placed, p.rows);
  uint32_t entry = ~0u;
  Copy kr, kc;
  for (uint32_t k = 0; tile.b < p.batch; ++k, advance(tile, p)) {
    if (tile.b != entry) {
      entry = tile.b;
      prepare_entry<L, kMode>(p, sh, entry, classes, kr, kc);
    }
    const T* stage = nullptr;
    if constexpr (kLoad == Load::kRing) {
      // Tile k + stages - 1's copies into its stage, which the block last read in the previous
      // tile (every thread has passed that tile's barrier since); then this tile's stage, filled
      // for the (k / stages)-th time.
      const uint32_t s = k % p.stages, s_ahead = (k + p.stages - 1) % p.stages;
      if (ahead.b < p.batch)
        load_stage<L>(x, p, sh, ring + s_ahead * kStageValues, int(s_ahead), ahead, map);
      advance(ahead, p);
      mbarrier_wait(&sh.full[s], (k / p.stages) & 1u);
      stage = ring + s * kStageValues;
    }
    NVFP4_PATH(p.staged == 2 ? "staging: two tiles" : "staging: one tile");
    if (p.staged == 1 && k > 0) __syncthreads();  // the last tile's stores have read its staging
    quantize_tile<L, kMode>(x, p, sh, staged[(k & 1u) * (p.staged - 1)], tile, kr, kc, seed, stage);
  }
}

// float32's block holds its 64 KB of values (and two staged tiles): two blocks a multiprocessor at
// most, which it tells ptxas (left alone, ptxas cut the stochastic kernel to 80 registers on sm_90
// and spilled). The 16-bit kernels' occupancy is ptxas's own choice (0: no minimum given).
template <typename L>
constexpr int kDirectMinBlocks = kPacked<L> ? 0 : 2;

template <typename L, Mode kMode>
__global__ void __launch_bounds__(kThreads, kDirectMinBlocks<L>)
    quantize_kernel(const typename L::T* x, Params p) {
  quantize_tiles<L, kMode>(x, p);
}

// The kRing variant of quantize_kernel and quantize_4over6_kernel (every rounding mode). Its ring
// takes 64 KB of shared memory or more besides the tables (float32: 128 KB, its values' own), so
// at most two blocks fit an SM: ptxas may use the registers.
template <typename L, Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    quantize_ring_kernel(const typename L::T* x, Params p,
                         const NVFP4_GRID_CONSTANT TensorMap map) {
  quantize_tiles<L, kMode, Load::kRing>(x, p, p.mapped ? &map : nullptr);
}

// 4over6 keeps two candidates per block live: one block per SM lets ptxas use the
// registers it needs.
template <typename L>
__global__ void __launch_bounds__(kThreads, 1)
    quantize_4over6_kernel(const typename L::T* x, Params p) {
  quantize_tiles<L, Mode::kFourOverSix>(x, p);
}

#if !defined(NVFP4_SASS_BUDGET)
// The dynamic shared memory of kernel K (dtype L, mode kMode, load kLoad; Shared): its bytes and
// how many tiles it stages (Params::staged; 0: K does not fit the device).
struct DynamicShared {
  size_t bytes;
  uint32_t staged;
  uint32_t stages;  // the input ring's (Params::stages)
};

// K's dynamic shared memory, its attribute set: float32's values (Values: the direct kernel), or
// with nearest rounding or 4over6 (kClassTableRoom) the class table where K's code was built
// without the E2M1 convert (PTX for sm_90, which a GPU newer than our sm_100a/sm_120a code also
// runs); two staged tiles, or one where two do not fit the device's opt-in maximum beside the
// static Shared (sm_120's 99 KB); the ring (kRing). Where even one does not fit, the class table
// goes (the tie-safe code index: slower, the same bytes). Queried and set once per device
// (once_per), not on every call.
template <auto K, typename L, Mode kMode, Load kLoad>
ffi::Error dynamic_shared_of(DynamicShared& out) {
  const auto [value, err, what] = once_per(device_key(), [](bool& ok) {
    DynamicShared d{0, 0, 0};
    const auto failed = [&](cudaError_t e, const char* call) {
      ok = false;
      return std::tuple(d, e, call);
    };
    // What the layout puts first (float32 on the ring keeps its values in the stage).
    size_t table = kClassTableRoom<L, kLoad> ? 0 : kValuesBytes;
    bool optional = false;  // whether the kernel can do without it
    if constexpr (kClassTableRoom<L, kLoad> && kMode != Mode::kStochastic) {
      cudaFuncAttributes attr{};
      if (const cudaError_t e = cudaFuncGetAttributes(&attr, K); e != cudaSuccess)
        return failed(e, "cudaFuncGetAttributes");
      table = attr.ptxVersion >= 100 ? 0 : size_t(kLaneTableBytes);
      optional = true;
    }
    int device = 0, optin = 0, per_multiprocessor = 0;
    if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
      return failed(e, "cudaGetDevice");
    for (const auto& [value, attr] :
         {std::pair(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin),
          std::pair(&per_multiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor)})
      if (const cudaError_t e = cudaDeviceGetAttribute(value, attr, device); e != cudaSuccess)
        return failed(e, "cudaDeviceGetAttribute");
    constexpr size_t kStatic = sizeof(SharedOf<kMode>);
    const size_t room = std::max<size_t>(size_t(optin), kStatic) - kStatic;
    const auto need = [&](uint32_t staged, uint32_t stages) {
      return table + staged * sizeof(Staging) + ring_bytes<L, kLoad>(stages);
    };
    // Tiles whose copies are in flight on a multiprocessor with a ring of `stages`: (stages - 1) a
    // block, times the blocks its shared memory holds (each also reserves 1 KB), at most
    // kRingBlocks.
    const auto in_flight = [&](uint32_t staged, uint32_t stages) {
      const size_t block = need(staged, stages) + kStatic + 1024;
      return std::min<size_t>(kRingBlocks, size_t(per_multiprocessor) / block) * (stages - 1);
    };
    // Two staged tiles first (one barrier a tile); then the ring depth with the most tiles in
    // flight a multiprocessor, the shallower on a tie (more blocks, more warps): three stages on
    // sm_90, where one block fits either way, two stages at two blocks where the class table goes.
    const auto choose = [&]() -> std::pair<uint32_t, uint32_t> {
      for (uint32_t staged = 2; staged >= 1; --staged) {
        if constexpr (kLoad == Load::kDirect) {
          if (need(staged, 0) <= room) return {staged, 0};
        } else {
          uint32_t best = 0;
          for (uint32_t stages = 2; stages <= kMaxStages; ++stages)
            if (need(staged, stages) <= room &&
                (best == 0 || in_flight(staged, stages) > in_flight(staged, best)))
              best = stages;
          if (best) return {staged, best};
        }
      }
      return {0, 0};
    };
    std::tie(d.staged, d.stages) = choose();
    if (d.staged == 0 && optional) {
      table = 0;
      std::tie(d.staged, d.stages) = choose();
    }
    d.bytes = d.staged ? need(d.staged, d.stages) : 0;
    if (d.bytes) {
      const cudaError_t e =
          cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, int(d.bytes));
      if (e != cudaSuccess) return failed(e, "cudaFuncSetAttribute");
    }
    return std::tuple(d, cudaSuccess, "");
  });
  out = value;
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error(what, err);
}

// Launches kernel K (dtype L, mode kMode, load kLoad) as a persistent grid over the tiles; where K
// does not fit the device, `fits` (if given) turns false and nothing launches.
// kRing: `map` is x's tensor map, or null (bulk copies a row).
template <auto K, typename L, Mode kMode, Load kLoad = Load::kDirect>
ffi::Error launch_tiles(cudaStream_t stream, const typename L::T* x, Params p, bool* fits = nullptr,
                        const TensorMap* map = nullptr) {
  DynamicShared shared{};
  if (auto e = dynamic_shared_of<K, L, kMode, kLoad>(shared); e.failure()) return e;
  if (fits != nullptr) *fits = shared.staged != 0;
  if (shared.staged == 0) {
    if (fits != nullptr) return ffi::Error::Success();
    return invalid("quantize: the kernel's shared memory does not fit this GPU's");
  }
  const uint32_t per_entry = p.row_tiles * p.col_tiles;
  const uint32_t blocks =
      std::min<uint32_t>(p.batch * per_entry, uint32_t(resident_blocks(K, kThreads, shared.bytes)));
  p.step = tile_pos(blocks, p.row_tiles, p.col_tiles);
  p.staged = shared.staged;
  p.stages = shared.stages;
  if constexpr (kLoad == Load::kRing) {
    p.mapped = map != nullptr;
    return launch<K>("quantize", blocks, kThreads, shared.bytes, stream, x, p,
                     p.mapped ? *map : TensorMap{});
  } else {
    return launch<K>("quantize", blocks, kThreads, shared.bytes, stream, x, p);
  }
}

// The spec's rounding mode.
inline Mode mode_of(const QuantizeSpec& spec) {
  return spec.stochastic_rounding    ? Mode::kStochastic
         : spec.four_over_six().on() ? Mode::kFourOverSix
                                     : Mode::kNearest;
}

// Launches dtype L's kernel of rounding mode M, its input loaded by kLoad (kRing: where its ring
// fits the device, else the direct kernel).
template <typename L, Mode M, Load kLoad>
ffi::Error launch_mode(cudaStream_t stream, const typename L::T* x, const Params& p,
                       const TensorMap* map) {
  if constexpr (kLoad == Load::kRing) {
    bool fits = false;
    auto e = launch_tiles<quantize_ring_kernel<L, M>, L, M, kLoad>(stream, x, p, &fits, map);
    return e.failure() || fits ? std::move(e)
                               : launch_mode<L, M, Load::kDirect>(stream, x, p, nullptr);
  } else if constexpr (M == Mode::kFourOverSix)
    return launch_tiles<quantize_4over6_kernel<L>, L, M>(stream, x, p);
  else
    return launch_tiles<quantize_kernel<L, M>, L, M>(stream, x, p);
}

template <typename L, Load kLoad>
ffi::Error launch_loaded(cudaStream_t stream, const typename L::T* x, const Params& p,
                         const TensorMap* map = nullptr) {
  switch (mode_of(p.spec)) {
    case Mode::kStochastic:
      return launch_mode<L, Mode::kStochastic, kLoad>(stream, x, p, map);
    case Mode::kFourOverSix:
      return launch_mode<L, Mode::kFourOverSix, kLoad>(stream, x, p, map);
    default:
      return launch_mode<L, Mode::kNearest, kLoad>(stream, x, p, map);
  }
}

template <typename L>
ffi::Error launch_quantize(cudaStream_t stream, const typename L::T* x, Params p) {
  // The ring's bulk copies need 16-byte rows (vec_in) and a 16-byte aligned input, as a tensor
  // map does. Tensor copies where the map encodes (and NVFP4_QUANTIZE_LOAD is not ring-rows), else
  // a copy a row.
  if (const RingLoad ring = ring_load();
      ring != RingLoad::kNone && p.vec_in && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    TensorMap map{};
    const bool mapped = ring == RingLoad::kTensor &&
                        cached_tensor_map_3d(map, x, sizeof(typename L::T), uint64_t(p.cols),
                                             uint64_t(p.rows), p.batch, kTileCols, kTileRows);
    return launch_loaded<L, Load::kRing>(stream, x, p, mapped ? &map : nullptr);
  }
  return launch_loaded<L, Load::kDirect>(stream, x, p);
}

ffi::Error quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                         ffi::Buffer<ffi::F32> amax_t, ffi::Buffer<ffi::U32> seed,
                         ffi::RemainingRets outs, QuantizeSpec spec) {
  int64_t batch = 0, rows = 0, cols = 0;
  QuantizeOutputs o;
  bool placed = false;
  if (auto e = check_quantize(x, amax, amax_t, seed, outs, spec, batch, rows, cols, o, placed);
      e.failure())
    return e;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = batch * row_tiles * col_tiles;
  if (tiles <= 0) return ffi::Error::Success();
  if (tiles > INT32_MAX || rows > INT32_MAX - kTileCols || cols > INT32_MAX - kTileCols)
    return invalid("quantize input is too large for one launch");
  const Params p{amax.typed_data(),
                 amax_t.typed_data(),
                 seed.typed_data(),
                 rows,
                 cols,
                 uint32_t(batch),
                 uint32_t(row_tiles),
                 uint32_t(col_tiles),
                 {uint32_t(packed_size(cols)), uint32_t(num_blocks(cols)),
                  uint32_t(packed_size(rows)), uint32_t(num_blocks(rows))},
                 TilePos{},
                 0,  // launch_tiles sets staged, stages and step
                 0,
                 placed,
                 cols % kCols == 0,
                 packed_size(cols) % 16 == 0 && num_blocks(cols) % 16 == 0,
                 packed_size(rows) % 16 == 0 && num_blocks(rows) % 4 == 0,
                 false,  // launch_tiles sets mapped
                 spec,
                 o};
  ffi::Error launched = ffi::Error::Success();
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    launched = launch_quantize<L>(stream, data, p);
  });
  if (!ok) return invalid("quantize input must be bfloat16, float16 or float32");
  return launched;
}

#endif  // !NVFP4_SASS_BUDGET

}  // namespace
}  // namespace nvfp4::cuda

#if defined(NVFP4_SASS_BUDGET)
// The hook of benchmarks/sass_budget.py, which builds this file with its entry points: the
// persistent tile loop of quantize_tiles in the steady state (an input of whole tiles and even
// sizes, the copies the spec names, the entry's tables ready, the fast code index unless
// row-scaled or kTieSafe: the index of a copy whose products can be round-down ties) with the
// spec's flags as constants, so that the loop body holds just that path. The script counts the
// loop body: what a thread issues per tile.
namespace nvfp4::cuda {
template <typename L, Mode kMode, bool kTieSafe = false>
__device__ __forceinline__ void budget_tile(const typename L::T* x, Params p, QuantizeSpec spec) {
  __shared__ SharedOf<kMode> sh;
  p.spec = spec;
  p.vec_in = p.vec_rows = p.vec_cols = true;
  __builtin_assume(p.rows % 2 == 0);  // whole tiles: even sizes
  __builtin_assume(p.cols % 2 == 0);
  __builtin_assume(spec.rowwise == (p.o.data != nullptr));
  __builtin_assume(spec.columnwise == (p.o.data_t != nullptr));
  if (!spec.rowwise) p.o.data = nullptr;
  if (!spec.columnwise) p.o.data_t = nullptr;
  // As prepare_entry leaves them: row-scaled copies have no table and a tie-safe index (the
  // class table's, where there is one: 16-bit nearest rounding without the convert), as do copies
  // whose amax lets a product be a round-down tie (kTieSafe).
  const bool per_row = spec.row_scaled;
  const Index index = !per_row && !kTieSafe ? Index::kFast
                      : kPacked<L> && kMode != Mode::kStochastic && !NVFP4_HAS_FP4_CVT()
                          ? Index::kClassSafe
                          : Index::kLutSafe;
  // The entry's global scales as the kernel keeps them in registers (here loaded, not computed:
  // prepare_entry's work is once per entry).
  const auto* g = reinterpret_cast<const GlobalScales*>(p.amax);
  // The tables as the kernel builds them before its loop (else the compiler may read the never
  // written shared memory as undefined and drop what depends on it: 4over6's candidates did).
  build_code_tables<kMode>(sh);
  for (int i = threadIdx.x; i < 2 * kCodes; i += kThreads)
    sh.enc[i / kCodes][i % kCodes] = block_encode_scale(uint8_t(i % kCodes), g[i / kCodes]);
  __syncthreads();
  // 4over6's exact units hold for every block (units_always_exact): an amax in [2^-104, 2^116].
  Copy kr{per_row ? nullptr : sh.enc[0], index, g[0], !per_row};
  Copy kc{per_row ? nullptr : sh.enc[1], index, g[1], !per_row};
  const Stream seed = stream_of(p.seed, p.placed, p.rows);
  p.staged = 2;
  Staging* staged = staged_tiles<L, Load::kDirect>(p);
  TilePos tile = tile_pos(blockIdx.x, p.row_tiles, p.col_tiles);
  uint32_t entry = tile.b;
  for (uint32_t k = 0; tile.b < p.batch; ++k, advance(tile, p)) {
    if (tile.b != entry) {  // prepare_entry's place in the loop (here a reload of the scales)
      entry = tile.b;
      kr.g = g[2 * entry];
      kc.g = g[2 * entry + 1];
    }
    quantize_tile<L, kMode>(x, p, sh, staged[k % 2], tile, kr, kc, seed);
  }
}
}  // namespace nvfp4::cuda
#else

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCuda, nvfp4::cuda::quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<nvfp4::cuda::StreamContext>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingRets()
                                  .Attrs<nvfp4::QuantizeSpec>());

bool nvfp4::cuda::quantize_tensor_map_encodes(uintptr_t base, int64_t batch, int64_t rows,
                                              int64_t cols, int element_bytes) {
  TensorMap map{};
  return encode_tensor_map_3d(map, reinterpret_cast<const void*>(base), uint32_t(element_bytes),
                              uint64_t(cols), uint64_t(rows), uint64_t(batch), kTileCols,
                              kTileRows);
}
#endif  // NVFP4_SASS_BUDGET
