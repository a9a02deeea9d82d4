// NVFP4 quantization on the GPU, bit-identical to the CPU kernel: one pass over the input
// gives the rowwise and/or columnwise copy with 1x16 or 16x16 blocks.
//
// Layout, for memory speed (benchmarks/sass_budget.py counts the instructions):
//   - A CUDA block of 128 threads loops over tiles of 64 rows x 256 columns (a persistent grid,
//     so the per-entry tables below are built once per batch entry, not per tile). Warp w owns
//     rows 16w..16w+15 of the tile, lane l columns 8l..8l+7: 16 rows x 8 columns per thread,
//     read with one 16-byte load per row.
//   - Columnwise 1x16 blocks are a thread's own 16 values; rowwise blocks are a lane pair's
//     (xor 1). Maxima are taken on packed 16-bit pairs (max.NaN.xorsign.abs).
//   - A block's scale is computed once, two at a time by cvt.rn.satfinite.e4m3x2; its encode
//     scale 1 / (s * gds) comes from a per-entry table of the 256 E4M3 codes.
//   - Codes of nearest rounding come from a 2048-entry table (e2m1_lut.cuh) on sm_90, from the
//     E2M1 convert on sm_100a/sm_120a; 8 codes pack into a word.
//   - The columnwise copy goes through a shared-memory tile and is written 16 bytes a store.
// Stochastic rounding draws each Threefry hash for two neighbouring values; 4over6 decides each
// chunk in registers (four_over_six.cuh); row-scaled copies take per-row global scales.
#include "cuda/common.cuh"
#include "cuda/e2m1_lut.cuh"
#include "cuda/four_over_six.cuh"
#include "cuda/handlers.h"

namespace nvfp4::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 8;                             // columns per thread
constexpr int kTileRows = (kThreads / 32) * kBlock;  // 64
constexpr int kTileCols = 32 * kCols;                // 256
constexpr int kCodes = 256;                          // E4M3 scale codes (0x7F: NaN)
constexpr int kStagedBytes = kTileRows / 2 + 8;      // +8: fewer shared-memory bank conflicts

// The kernel's operands and options (by value).
struct Params {
  const float* amax;     // [B] (row-scaled: [B, M]): the rowwise copy and 16x16 blocks
  const float* amax_t;   // [B] (row-scaled: [B, N]): the columnwise 1x16 copy
  const uint32_t* seed;  // [2]: the Threefry key of stochastic rounding (device memory)
  int64_t rows, cols;
  uint32_t row_tiles, col_tiles, tiles;  // tiles per entry along M and N; in all
  bool vec;           // N % 8 == 0: 16-byte loads and 4-byte stores of a thread's 8 columns
  QuantizeSpec spec;  // its rht applies as columnwise_rht(): a columnwise 1x16 copy
  QuantizeOutputs o;
};

// How the codes round: to nearest, stochastically, or to nearest with the 4over6 choice of
// the block scale (a kernel each, so that each keeps its registers).
enum class Mode { kNearest, kStochastic, kFourOverSix };

// Per CUDA block: the code table, the current batch entry's encode scales, and the staged
// columnwise tile.
struct Shared {
  uint8_t lut[kLutSize];
  float enc[2][kCodes];  // [rowwise, columnwise][scale code]: block_encode_scale
  int safe[2];           // whether that copy needs the tie-safe code index
  alignas(16) uint8_t data_t[kTileCols][kStagedBytes];
  alignas(16) uint8_t scale_t[kTileCols][kTileRows / kBlock];
};

// What quantizing one copy needs of its batch entry.
struct Copy {
  const float* enc;  // Shared::enc of the copy, or null (row-scaled: per-row scales)
  bool safe;
  GlobalScales g;  // the entry's global scales (unused when row-scaled)
};

// ---- loading: 16 rows x 8 columns, their column and row maxima ----

template <typename L>
constexpr bool kPacked = sizeof(typename L::T) == 2;  // bfloat16 or float16: two per word

template <typename L>
__device__ __forceinline__ uint32_t max_magnitude(uint32_t a, uint32_t b) {
  if constexpr (kPacked<L>)
    return max_magnitude_x2<std::is_same_v<L, LoadBF16>>(a, b);
  else
    return max(a & 0x7FFFFFFFu, b & 0x7FFFFFFFu);
}

// The float value of a magnitude in the dtype's bits (the low half of a packed word).
template <typename L>
__device__ __forceinline__ float magnitude_value(uint32_t m) {
  if constexpr (kPacked<L>)
    return L::load(uint16_t(m & 0x7FFFu));
  else
    return amax_from_bits(m & 0x7FFFFFFFu);
}

template <typename L>
constexpr int kWords = kPacked<L> ? kCols / 2 : kCols;  // 32-bit words of a thread's row

// The value of row r, column c of a thread's words.
template <typename L>
__device__ __forceinline__ float value(const uint32_t (&w)[kBlock][kWords<L>], int r, int c) {
  if constexpr (kPacked<L>)
    return L::load(uint16_t(c % 2 ? w[r][c / 2] >> 16 : w[r][c / 2]));
  else
    return bits_float(w[r][c]);
}

// The thread's values as words (zero outside the input, as the reference pads), the magnitude
// maxima of its 8 columns (16 rows each) and of its 16 rows (16 columns each, with the pair's
// lane). `vec`: 16-byte loads (rows of a multiple of 8 values).
template <typename L>
__device__ __forceinline__ void load_tile(const typename L::T* x, int64_t cols, int nrows,
                                          int ncols, bool vec, uint32_t (&w)[kBlock][kWords<L>],
                                          uint32_t (&col_mag)[kCols], uint32_t (&row_mag)[kBlock]) {
  using T = typename L::T;
  constexpr int kW = kWords<L>;
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    const T* src = x + r * cols;
    if (vec) {
      uint4 q[kW / 4];
#pragma unroll
      for (int i = 0; i < kW / 4; ++i)
        q[i] =
            (r < nrows && ncols > 0) ? reinterpret_cast<const uint4*>(src)[i] : uint4{0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < kW / 4; ++i) {
        w[r][4 * i] = q[i].x;
        w[r][4 * i + 1] = q[i].y;
        w[r][4 * i + 2] = q[i].z;
        w[r][4 * i + 3] = q[i].w;
      }
    } else {
      uint32_t e[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        T t{};
        if (r < nrows && c < ncols) t = src[c];
        if constexpr (kPacked<L>)
          e[c] = t;
        else
          e[c] = float_bits(t);
      }
#pragma unroll
      for (int i = 0; i < kW; ++i) w[r][i] = kPacked<L> ? e[2 * i] | (e[2 * i + 1] << 16) : e[i];
    }
  }
  // Column maxima (packed: columns 2i and 2i + 1 in word i).
  uint32_t cm[kW];
#pragma unroll
  for (int i = 0; i < kW; ++i) {
    cm[i] = w[0][i];
#pragma unroll
    for (int r = 1; r < kBlock; ++r) cm[i] = max_magnitude<L>(cm[i], w[r][i]);
  }
  // Row maxima over the thread's 8 columns, then over the pair's 16.
  uint32_t rm[kBlock];
#pragma unroll
  for (int r = 0; r < kBlock; ++r) {
    rm[r] = w[r][0];
#pragma unroll
    for (int i = 1; i < kW; ++i) rm[r] = max_magnitude<L>(rm[r], w[r][i]);
  }
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

// The scale codes of two blocks (pre-fix: a NaN is 0x7F) packed as (hi << 8) | lo.
__device__ __forceinline__ uint32_t scale_pair(float bamax_hi, float bamax_lo,
                                               const GlobalScales& g_hi, const GlobalScales& g_lo) {
  return e4m3x2_satfinite(min_nan(bamax_hi * g_hi.encode_div6, kE4M3Max),
                          min_nan(bamax_lo * g_lo.encode_div6, kE4M3Max));
}

// The element encode scale of scale code s (pre-fix).
__device__ __forceinline__ float encode_scale(uint32_t s, const Copy& k, const GlobalScales& g) {
  return k.enc ? k.enc[s] : block_encode_scale(uint8_t(s), g);
}

// The codes code(0), ..., code(7) packed into a word, code k in nibble k.
template <typename Code>
__device__ __forceinline__ uint32_t pack8(Code code) {
  uint32_t word = 0;
#pragma unroll
  for (int k = 7; k >= 0; --k) word = (word << 4) | code(k);
  return word;
}

// Codes of 8 values rounded to nearest, value k in nibble k: the E2M1 convert where there is
// one, else the code table (the tie-safe index where the copy needs it).
template <typename Get>
__device__ __forceinline__ uint32_t nearest8(const uint8_t* lut, bool safe, float enc, Get get) {
  if (NVFP4_HAS_FP4_CVT() && !safe) {
    // x * enc + 0: no -0.0 (the convert keeps its sign). A NaN product comes only from a NaN
    // encode scale (a block with a NaN), whose codes are all 0.
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 8; k += 2)
      word |= uint32_t(
                  cvt_rn_satfinite_e2m1x2(fma_rn(get(k + 1), enc, 0.0f), fma_rn(get(k), enc, 0.0f)))
              << (4 * k);
    return enc == enc ? word : 0u;
  }
  if (safe) return pack8([&](int k) { return lut_code<true>(lut, get(k), enc); });
  return pack8([&](int k) { return lut_code<false>(lut, get(k), enc); });
}

// Codes of 8 values rounded stochastically by their words.
template <typename Get>
__device__ __forceinline__ uint32_t stochastic8(float enc, const uint32_t (&words)[8], Get get) {
  return pack8([&](int k) { return quantize_value_stochastic(get(k), enc, words[k]); });
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
  int64_t b, m0, n0;  // batch entry, first row, first column
  int nrows, ncols;   // of those inside the input (0 to 16, 0 to 8)
};

// Stores the rowwise copy's word of row r (codes of columns n0..n0+7) and, from the lane that
// holds its rows (the even lane rows 0-7, the odd lane 8-15), the row's block scale.
__device__ __forceinline__ void store_row(const Params& p, const Place& at, int r, uint32_t word,
                                          uint32_t scale) {
  const int64_t cols = p.cols, row = at.b * p.rows + at.m0 + r;
  if (r >= at.nrows) return;
  if (at.ncols > 0) {
    uint8_t* dst = p.o.data + row * packed_size(cols) + at.n0 / 2;
    if (p.vec) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
      for (int k = 0; k < (at.ncols + 1) / 2; ++k) dst[k] = uint8_t(word >> (8 * k));
    }
  }
  const bool odd = threadIdx.x & 1u;
  if ((r >= kBlock / 2) == odd && (at.n0 & ~int64_t(kBlock - 1)) < cols)
    p.o.scale[row * num_blocks(cols) + at.n0 / kBlock] = uint8_t(scale);
}

// Stages column c's 16 codes (two words: rows 0-7, 8-15) and block scale.
__device__ __forceinline__ void stage_column(Shared& sh, int c, uint32_t lo, uint32_t hi,
                                             uint32_t scale) {
  const int col = kCols * (threadIdx.x % 32) + c, warp = threadIdx.x / 32;
  *reinterpret_cast<uint2*>(&sh.data_t[col][8 * warp]) = uint2{lo, hi};
  sh.scale_t[col][warp] = uint8_t(scale);
}

// Writes the staged columnwise tile (rows tm0.. of columns tn0..), 16 bytes a store where the
// rows of the copy allow it.
__device__ __forceinline__ void store_columns(const Params& p, const Shared& sh, int64_t b,
                                              int64_t tm0, int64_t tn0) {
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t data_cols = packed_size(rows), scale_cols = num_blocks(rows);
  for (int i = threadIdx.x; i < 2 * kTileCols; i += kThreads) {
    const int col = i / 2, half = i % 2;
    const int64_t n = tn0 + col, start = tm0 / 2 + 16 * half;
    if (n >= cols || start >= data_cols) continue;
    uint8_t* dst = p.o.data_t + (b * cols + n) * data_cols + start;
    const uint8_t* src = &sh.data_t[col][16 * half];
    if (data_cols % 16 == 0) {
      const uint2 a = *reinterpret_cast<const uint2*>(src),
                  c = *reinterpret_cast<const uint2*>(src + 8);
      *reinterpret_cast<uint4*>(dst) = uint4{a.x, a.y, c.x, c.y};
    } else {
      for (int k = 0; k < 16 && start + k < data_cols; ++k) dst[k] = src[k];
    }
  }
  for (int col = threadIdx.x; col < kTileCols; col += kThreads) {
    const int64_t n = tn0 + col, start = tm0 / kBlock;
    if (n >= cols || start >= scale_cols) continue;
    uint8_t* dst = p.o.scale_t + (b * cols + n) * scale_cols + start;
    if (scale_cols % 4 == 0) {
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(sh.scale_t[col]);
    } else {
      for (int k = 0; k < kTileRows / kBlock && start + k < scale_cols; ++k)
        dst[k] = sh.scale_t[col][k];
    }
  }
}

template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_tile(const typename L::T* x, const Params& p, Shared& sh,
                                              uint32_t tile, const Copy& kr, const Copy& kc,
                                              Seed seed) {
  const QuantizeSpec& spec = p.spec;
  const int64_t rows = p.rows, cols = p.cols;
  const uint32_t per_entry = p.row_tiles * p.col_tiles, in_entry = tile % per_entry;
  Place at;
  at.b = tile / per_entry;
  const int64_t tm0 = int64_t(in_entry / p.col_tiles) * kTileRows;
  const int64_t tn0 = int64_t(in_entry % p.col_tiles) * kTileCols;
  at.m0 = tm0 + kBlock * int64_t(threadIdx.x / 32);
  at.n0 = tn0 + kCols * int64_t(threadIdx.x % 32);
  at.nrows = int(max(int64_t(0), min(int64_t(kBlock), rows - at.m0)));
  at.ncols = int(max(int64_t(0), min(int64_t(kCols), cols - at.n0)));

  uint32_t w[kBlock][kWords<L>], col_mag[kCols], row_mag[kBlock];
  load_tile<L>(x + (at.b * rows + min(at.m0, rows)) * cols + min(at.n0, cols), cols, at.nrows,
               at.ncols, p.vec, w, col_mag, row_mag);
  const auto v = [&](int r, int c) { return value<L>(w, r, c); };

  const uint32_t ucols = uint32_t(cols), urows = uint32_t(rows), ub = uint32_t(at.b);
  if (spec.block_2d) {
    // 16x16: the pair's 16 columns share a block; one quantization serves both copies (with
    // 4over6 each copy makes its own choice).
    uint32_t mag = col_mag[0];
#pragma unroll
    for (int c = 1; c < kCols; ++c) mag = max_magnitude<L>(mag, col_mag[c]);
    const float bamax = magnitude_value<L>(max_magnitude<L>(mag, __shfl_xor_sync(~0u, mag, 1)));
    const GlobalScales& g = kr.g;
    uint32_t words[kBlock], scale_r, scale_c;
    float enc_c = 0.0f;
    if constexpr (kMode == Mode::kFourOverSix) {
      Candidate row, col;
      float all[kBlock][kCols];
#pragma unroll
      for (int r = 0; r < kBlock; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) all[r][c] = v(r, c);
      tile_choice(all, bamax, g, spec.four_over_six(), row, col);
      scale_r = row.scale;
      scale_c = col.scale;
      enc_c = col.enc;
#pragma unroll
      for (int r = 0; r < kBlock; ++r)
        words[r] = reference8(row.enc, [&](int k) { return v(r, k); });
    } else {
      const uint32_t s = scale_pair(bamax, bamax, g, g) & 0xFFu;
      const float enc = encode_scale(s, kr, g);
      scale_r = scale_c = s;
      // Stochastic words come from the rowwise stream of the padded [B, Mp, Np] tile array.
      const uint32_t rows_padded = uint32_t(num_blocks(rows) * kBlock);
#pragma unroll
      for (int r = 0; r < kBlock; ++r) {
        if constexpr (kMode == Mode::kStochastic) {
          uint32_t rw[8];
          random_words(seed, (ub * rows_padded + uint32_t(at.m0 + r)) * ucols + uint32_t(at.n0), 0,
                       rw);
          words[r] = stochastic8(enc, rw, [&](int k) { return v(r, k); });
        } else {
          words[r] = nearest8(sh.lut, kr.safe, enc, [&](int k) { return v(r, k); });
        }
      }
    }
    scale_r = fix_nan_scales(scale_r) & 0xFFu;
    scale_c = fix_nan_scales(scale_c) & 0xFFu;
    if (p.o.data) {
#pragma unroll
      for (int r = 0; r < kBlock; ++r) store_row(p, at, r, words[r], scale_r);
    }
    if (p.o.data_t) {
      if constexpr (kMode == Mode::kFourOverSix) {
#pragma unroll
        for (int r = 0; r < kBlock; ++r)
          words[r] = reference8(enc_c, [&](int k) { return v(r, k); });
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
      for (int c = 0; c < kCols; ++c) stage_column(sh, c, lo[c], hi[c], scale_c);
    }
  } else {
    if (p.o.data) {
      // 1x16 rowwise: a row's block is the pair's 16 columns.
#pragma unroll
      for (int r = 0; r < kBlock; r += 2) {
        GlobalScales g0 = kr.g, g1 = kr.g;
        if (spec.row_scaled) {
          const float* a = p.amax + at.b * rows + at.m0;
          g0 = spec.global_scales(r < at.nrows ? a[r] : 0.0f);
          g1 = spec.global_scales(r + 1 < at.nrows ? a[r + 1] : 0.0f);
        }
        const float bamax0 = magnitude_value<L>(row_mag[r]),
                    bamax1 = magnitude_value<L>(row_mag[r + 1]);
        uint32_t word[2], scale[2];
        if constexpr (kMode == Mode::kFourOverSix) {
          float row0[kCols], row1[kCols];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            row0[c] = v(r, c);
            row1[c] = v(r + 1, c);
          }
          const Candidate c0 = row_chunk(row0, bamax0, g0, spec.four_over_six());
          const Candidate c1 = row_chunk(row1, bamax1, g1, spec.four_over_six());
          word[0] = reference8(c0.enc, [&](int k) { return v(r, k); });
          word[1] = reference8(c1.enc, [&](int k) { return v(r + 1, k); });
          scale[0] = c0.scale;
          scale[1] = c1.scale;
        } else {
          const uint32_t s = scale_pair(bamax1, bamax0, g1, g0);
          const float enc0 = encode_scale(s & 0xFFu, kr, g0), enc1 = encode_scale(s >> 8, kr, g1);
          const uint32_t fixed = fix_nan_scales(s);
          scale[0] = fixed & 0xFFu;
          scale[1] = fixed >> 8;
          if constexpr (kMode == Mode::kStochastic) {
            // Rowwise element (b, m, n) draws word (b M + m) N + n of stream 0.
            uint32_t w0[8], w1[8];
            const uint32_t base = (ub * urows + uint32_t(at.m0 + r)) * ucols + uint32_t(at.n0);
            random_words(seed, base, 0, w0);
            random_words(seed, base + ucols, 0, w1);
            word[0] = stochastic8(enc0, w0, [&](int k) { return v(r, k); });
            word[1] = stochastic8(enc1, w1, [&](int k) { return v(r + 1, k); });
          } else {
            word[0] = nearest8(sh.lut, kr.safe, enc0, [&](int k) { return v(r, k); });
            word[1] = nearest8(sh.lut, kr.safe, enc1, [&](int k) { return v(r + 1, k); });
          }
        }
        store_row(p, at, r, word[0], scale[0]);
        store_row(p, at, r + 1, word[1], scale[1]);
      }
    }
    if (p.o.data_t) {
      // 1x16 columnwise: a column's 16 values are the block, or with rht their transform
      // (M % 16 == 0, so all 16 rows are real), in registers.
      const bool rht = spec.columnwise_rht();
#pragma unroll
      for (int c = 0; c < kCols; c += 2) {
        float t[2][kBlock];
        uint32_t mag[2] = {col_mag[c], col_mag[c + 1]};
        float bamax[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int r = 0; r < kBlock; ++r) t[j][r] = v(r, c + j);
          bamax[j] = magnitude_value<L>(mag[j]);
          if (rht) {
            rht16_narrow<L>(t[j]);
            uint32_t m = 0;
#pragma unroll
            for (int r = 0; r < kBlock; ++r) m = max(m, magnitude_bits(t[j][r]));
            bamax[j] = amax_from_bits(m);
          }
        }
        GlobalScales g[2] = {kc.g, kc.g};
        if (spec.row_scaled) {
          const float* a = p.amax_t + at.b * cols + at.n0;
          g[0] = spec.global_scales(c < at.ncols ? a[c] : 0.0f);
          g[1] = spec.global_scales(c + 1 < at.ncols ? a[c + 1] : 0.0f);
        }
        // The two columns' scale codes, in bytes 0 and 1 (not used by 4over6).
        const uint32_t pair =
            kMode == Mode::kFourOverSix ? 0u : scale_pair(bamax[1], bamax[0], g[1], g[0]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t lo, hi, scale;
          const auto get = [&](int k) { return t[j][k]; };
          const auto get_hi = [&](int k) { return t[j][k + 8]; };
          if constexpr (kMode == Mode::kFourOverSix) {
            const Candidate chosen = column_chunk(t[j], bamax[j], g[j], spec.four_over_six());
            lo = reference8(chosen.enc, get);
            hi = reference8(chosen.enc, get_hi);
            scale = fix_nan_scales(chosen.scale) & 0xFFu;
          } else {
            const uint32_t s = (pair >> (8 * j)) & 0xFFu;
            const float enc = encode_scale(s, kc, g[j]);
            scale = fix_nan_scales(s) & 0xFFu;
            if constexpr (kMode == Mode::kStochastic) {
              // Columnwise element (b, n, m) draws word (b N + n) M + m of stream 1.
              uint32_t w[kBlock];
              random_words(seed, (ub * ucols + uint32_t(at.n0 + c + j)) * urows + uint32_t(at.m0),
                           1, w);
              uint32_t wl[8], wh[8];
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                wl[k] = w[k];
                wh[k] = w[k + 8];
              }
              lo = stochastic8(enc, wl, get);
              hi = stochastic8(enc, wh, get_hi);
            } else {
              lo = nearest8(sh.lut, kc.safe, enc, get);
              hi = nearest8(sh.lut, kc.safe, enc, get_hi);
            }
          }
          stage_column(sh, c + j, lo, hi, scale);
        }
      }
    }
  }
  if (p.o.data_t) {
    __syncthreads();
    store_columns(p, sh, at.b, tm0, tn0);
    __syncthreads();  // the next tile stages into the same memory
  }
}

// The encode scales of batch entry b's 256 scale codes for both copies, and whether each copy
// needs the tie-safe code index; row-scaled copies have no table and always need it (every
// thread of the block calls).
template <typename L, Mode kMode>
__device__ __forceinline__ void prepare_entry(const Params& p, Shared& sh, uint32_t b, Copy& kr,
                                              Copy& kc) {
  const QuantizeSpec& spec = p.spec;
  kr = Copy{nullptr, true, GlobalScales{}};
  kc = kr;
  if (spec.row_scaled) return;
  kr.g = spec.global_scales(p.amax[b]);
  kc.g = spec.global_scales(p.amax_t[b]);
  __syncthreads();  // the previous entry's tables are no longer read
  if (threadIdx.x < 2) sh.safe[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * kCodes; i += kThreads) {
    const int copy = i / kCodes, s = i % kCodes;
    const float enc = block_encode_scale(uint8_t(s), copy ? kc.g : kr.g);
    sh.enc[copy][s] = enc;
    if (kMode == Mode::kNearest && tie_possible<L>(enc)) sh.safe[copy] = 1;
  }
  __syncthreads();
  kr.enc = sh.enc[0];
  kc.enc = sh.enc[1];
  kr.safe = sh.safe[0] != 0;
  kc.safe = sh.safe[1] != 0;
}

template <typename L, Mode kMode>
__device__ __forceinline__ void quantize_tiles(const typename L::T* x, const Params& p) {
  __shared__ Shared sh;
  for (int i = threadIdx.x; i < kLutSize; i += kThreads) sh.lut[i] = lut_entry(uint32_t(i));
  __syncthreads();
  Seed seed{0, 0};
  if constexpr (kMode == Mode::kStochastic) seed = Seed{p.seed[0], p.seed[1]};
  const uint32_t per_entry = p.row_tiles * p.col_tiles;
  uint32_t entry = ~0u;
  Copy kr, kc;
  for (uint32_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    if (tile / per_entry != entry) {
      entry = tile / per_entry;
      prepare_entry<L, kMode>(p, sh, entry, kr, kc);
    }
    quantize_tile<L, kMode>(x, p, sh, tile, kr, kc, seed);
  }
}

template <typename L, Mode kMode>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const typename L::T* x, Params p) {
  quantize_tiles<L, kMode>(x, p);
}

// 4over6 keeps two candidates per block live: one block per SM lets ptxas use the
// registers it needs.
template <typename L>
__global__ void __launch_bounds__(kThreads, 1)
    quantize_4over6_kernel(const typename L::T* x, Params p) {
  quantize_tiles<L, Mode::kFourOverSix>(x, p);
}

#if !defined(NVFP4_SASS_BUDGET)
template <typename L>
ffi::Error launch_quantize(cudaStream_t stream, const typename L::T* x, const Params& p) {
  const unsigned blocks = unsigned(std::min<uint32_t>(p.tiles, uint32_t(resident_blocks())));
  if (p.spec.stochastic_rounding)
    return launch<quantize_kernel<L, Mode::kStochastic>>("quantize", blocks, kThreads, 0, stream, x,
                                                         p);
  if (p.spec.four_over_six().on())
    return launch<quantize_4over6_kernel<L>>("quantize", blocks, kThreads, 0, stream, x, p);
  return launch<quantize_kernel<L, Mode::kNearest>>("quantize", blocks, kThreads, 0, stream, x, p);
}

ffi::Error quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                         ffi::Buffer<ffi::F32> amax_t, ffi::Buffer<ffi::U32> seed,
                         ffi::RemainingRets outs, QuantizeSpec spec) {
  int64_t batch = 0, rows = 0, cols = 0;
  QuantizeOutputs o;
  if (auto e = check_quantize(x, amax, amax_t, seed, outs, spec, batch, rows, cols, o); e.failure())
    return e;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = batch * row_tiles * col_tiles;
  if (tiles <= 0) return ffi::Error::Success();
  if (tiles > INT32_MAX || rows > INT32_MAX || cols > INT32_MAX)
    return invalid("quantize input is too large for one launch");
  const Params p{
      amax.typed_data(),   amax_t.typed_data(), seed.typed_data(), rows, cols, uint32_t(row_tiles),
      uint32_t(col_tiles), uint32_t(tiles),     cols % kCols == 0, spec, o};
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
// The hook of benchmarks/sass_budget.py, which builds this file with its entry points: one
// tile of the steady state (rows of a multiple of 8 values, the copies the spec names, the
// entry's tables ready, the fast code index unless row-scaled) with the spec's flags as
// constants, so that the SASS holds just that path.
namespace nvfp4::cuda {
template <typename L, Mode kMode>
__device__ __forceinline__ void budget_tile(const typename L::T* x, Params p, QuantizeSpec spec) {
  __shared__ Shared sh;
  p.spec = spec;
  p.vec = true;
  __builtin_assume(spec.rowwise == (p.o.data != nullptr));
  __builtin_assume(spec.columnwise == (p.o.data_t != nullptr));
  if (!spec.rowwise) p.o.data = nullptr;
  if (!spec.columnwise) p.o.data_t = nullptr;
  // As prepare_entry leaves them: row-scaled copies have no table and the tie-safe index.
  const bool per_row = spec.row_scaled;
  const Copy kr{per_row ? nullptr : sh.enc[0], per_row, spec.global_scales(p.amax[0])};
  const Copy kc{per_row ? nullptr : sh.enc[1], per_row, spec.global_scales(p.amax_t[0])};
  quantize_tile<L, kMode>(x, p, sh, blockIdx.x, kr, kc, Seed{p.seed[0], p.seed[1]});
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
#endif  // NVFP4_SASS_BUDGET
