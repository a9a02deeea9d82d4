// The 16-row stripe machinery of the CPU quantize kernels, shared by the plain
// quantize (cpu/quantize.cc) and the grouped one (cpu/grouped.cc): a stripe is
// converted to float32 once; the rowwise copy takes its rows, the columnwise
// copy (of its RHT, with rht) one block of 16 values per column.
#pragma once

#include <cstring>

#include "cpu/common.h"
#include "cpu/four_over_six.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "columnwise packing writes little-endian words");

namespace nvfp4::cpu {

// Per-thread scratch for one 16-row stripe, reused across stripes.
struct Stripe {
  std::vector<float> value;      // [16][width]: the stripe as float32, zero-padded
  std::vector<uint8_t> code;     // [16][width]: codes with per-column encode scales
  std::vector<uint32_t> mag;     // [width]: column max magnitude (bits)
  std::vector<float> enc;        // [width]: encode scale of each column's block
  std::vector<uint8_t> scale;    // [width]: E4M3 scale of each column's block
  std::vector<uint64_t> word;    // [width]: a column's 8 packed bytes of the columnwise copy
  std::vector<uint32_t> rand;    // random words of stochastic rounding: [blocks][4] or [4][blocks]
  std::vector<GlobalScales> g;   // [width]: the global scales of each block (4over6, row-scaled)
  std::vector<float> rowt;       // [16][blocks]: one row's 1x16 chunks as columns (4over6)
  std::vector<uint8_t> scale_t;  // [width]: the columnwise copy's scales (16x16 4over6)
  std::vector<float> enc_t;      // [width]: the columnwise copy's encode scales (16x16 4over6)
  FosScratch fos;
};

// The options of one quantize call and one batch entry's global scales.
struct Options {
  QuantizeSpec spec;
  GlobalScales g;          // from amax: the rowwise copy and 16x16 blocks (not row-scaled)
  GlobalScales g_t;        // from amax_t: the columnwise 1x16 copy (not row-scaled)
  const float* amax_rows;  // row-scaled: the entry's amax per row of x [M] (rowwise)
  const float* amax_cols;  // row-scaled: the entry's amax per row of x^T [N] (columnwise)
  Seed seed;
  uint32_t b;  // the batch entry (random counters)

  // Global scales of row m of the rowwise copy and of row n of the columnwise one.
  GlobalScales row(int64_t m) const {
    return spec.row_scaled ? spec.global_scales(amax_rows[m]) : g;
  }
  GlobalScales column(int64_t n) const {
    return spec.row_scaled ? spec.global_scales(amax_cols[n]) : g_t;
  }
};

// Packs codes into bytes, element 2i in the low nibble.
inline void pack(const uint8_t* __restrict codes, uint8_t* __restrict dst, int64_t nbytes) {
  for (int64_t k = 0; k < nbytes; ++k) dst[k] = uint8_t(codes[2 * k] | (codes[2 * k + 1] << 4));
}

// Encodes n values with one encode scale per value (vectorizes over n).
inline void encode(const float* __restrict v, const float* __restrict enc,
                   uint8_t* __restrict codes, int64_t n) {
  for (int64_t k = 0; k < n; ++k) codes[k] = quantize_value(v[k], enc[k]);
}

template <typename L>
inline void load_stripe(const typename L::T* x, int64_t cols, int64_t nrows, int64_t width,
                        float* out) {
  for (int64_t r = 0; r < kBlock; ++r) {
    float* o = out + r * width;
    if (r < nrows) {
      const typename L::T* xr = x + r * cols;
      for (int64_t c = 0; c < cols; ++c) o[c] = L::load(xr[c]);
      std::fill(o + cols, o + width, 0.0f);  // zero padding, as the reference pads
    } else {
      std::fill(o, o + width, 0.0f);
    }
  }
}

// Scales and encode scales of blocks from their max magnitudes (vectorizes).
inline void block_scales(const uint32_t* __restrict mag, int64_t n, const GlobalScales& g,
                         uint8_t* __restrict scale, float* __restrict enc) {
  for (int64_t i = 0; i < n; ++i) {
    scale[i] = block_scale(amax_from_bits(mag[i]), g);
    enc[i] = block_encode_scale(scale[i], g);
  }
}

// Scales and encode scales of blocks, block i with global scales g[i] (vectorizes).
inline void block_scales_each(const uint32_t* __restrict mag, int64_t n,
                              const GlobalScales* __restrict g, uint8_t* __restrict scale,
                              float* __restrict enc) {
  for (int64_t i = 0; i < n; ++i) {
    scale[i] = block_scale(amax_from_bits(mag[i]), g[i]);
    enc[i] = block_encode_scale(scale[i], g[i]);
  }
}

// Max magnitude (bits) of each run of 16 values.
inline void block_max(const float* __restrict v, uint32_t* __restrict mag, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    uint32_t m = 0;
    for (int k = 0; k < kBlock; ++k) m = std::max(m, magnitude_bits(v[b * kBlock + k]));
    mag[b] = m;
  }
}

// The random bytes of the n blocks j = 0..n-1 of row r (Philox counters (j, r, b, stream)) in
// value order: w [n][4] holds block j's words, so that byte 16 j + k of w is value k's
// (vectorizes).
inline void random_row_bytes(Seed seed, uint32_t r, uint32_t b, uint32_t stream,
                             uint32_t* __restrict w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    uint32_t out[4];
    block_random(seed, uint32_t(j), r, b, stream, out);
    for (int q = 0; q < 4; ++q) w[4 * j + q] = out[q];
  }
}

// The random words of block j of the n rows r = 0..n-1 (Philox counters (j, r, b, stream)) into
// w [4][n]: word q of row r's block at w[q n + r], for loops over the rows (vectorizes).
inline void random_column_words(Seed seed, uint32_t j, uint32_t b, uint32_t stream,
                                uint32_t* __restrict w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t out[4];
    block_random(seed, j, uint32_t(i), b, stream, out);
    w[i] = out[0];
    w[n + i] = out[1];
    w[2 * n + i] = out[2];
    w[3 * n + i] = out[3];
  }
}

// Encodes runs of 16 values, each run with its own encode scale.
inline void encode_blocks(const float* __restrict v, const float* __restrict enc,
                          uint8_t* __restrict codes, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float e = enc[b];
    for (int k = 0; k < kBlock; ++k) codes[b * kBlock + k] = quantize_value(v[b * kBlock + k], e);
  }
}

// Encodes runs of 16 values stochastically, each run with its own encode scale, value i with
// random byte rbyte[i] (random_row_bytes).
inline void encode_blocks_stochastic(const float* __restrict v, const float* __restrict enc,
                                     const uint8_t* __restrict rbyte, uint8_t* __restrict codes,
                                     int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float e = enc[b];
    for (int k = 0; k < kBlock; ++k)
      codes[b * kBlock + k] =
          quantize_value_stochastic(v[b * kBlock + k], e, rbyte[b * kBlock + k]);
  }
}

// 4over6 scales and encode scales of one row's nb 1x16 chunks: the chunks are
// transposed into columns of st.rowt [16][nb] for the vector loops.
inline void row_4over6(Stripe& st, const float* v, int64_t nb, const GlobalScales& g,
                       FourOverSix fos, uint8_t* scale) {
  st.rowt.resize(kBlock * nb);
  for (int64_t j = 0; j < nb; ++j)
    for (int k = 0; k < kBlock; ++k) st.rowt[k * nb + j] = v[j * kBlock + k];
  st.g.assign(nb, g);
  choose_1d(st.rowt.data(), nb, st.mag.data(), st.g.data(), fos, st.fos, scale, st.enc.data());
}

// Rowwise 1x16: each row's blocks get their own scale. Block j of row m draws the
// random words of counter (j, m, b, 0).
inline void rowwise_1d(Stripe& st, int64_t rows, int64_t nrows, int64_t cols, int64_t width,
                       int64_t m0, const Options& p, const QuantizeOutputs& o) {
  const int64_t data_cols = packed_size(cols), nb = num_blocks(cols);
  st.code.resize(width);
  st.mag.resize(nb);
  st.enc.resize(nb);
  if (p.spec.stochastic_rounding) st.rand.resize(4 * nb);
  for (int64_t r = 0; r < nrows; ++r) {
    const float* v = st.value.data() + r * width;
    uint8_t* scale = o.scale + (m0 + r) * nb;
    const GlobalScales g = p.row(m0 + r);
    block_max(v, st.mag.data(), nb);
    if (p.spec.four_over_six().on())
      row_4over6(st, v, nb, g, p.spec.four_over_six(), scale);
    else
      block_scales(st.mag.data(), nb, g, scale, st.enc.data());
    if (p.spec.stochastic_rounding) {
      random_row_bytes(p.seed, uint32_t(m0 + r), p.b, 0, st.rand.data(), nb);
      encode_blocks_stochastic(v, st.enc.data(), reinterpret_cast<const uint8_t*>(st.rand.data()),
                               st.code.data(), nb);
    } else {
      encode_blocks(v, st.enc.data(), st.code.data(), nb);
    }
    pack(st.code.data(), o.data + (m0 + r) * data_cols, data_cols);
  }
}

// Codes of the stripe st.value [16][width] with one encode scale per column
// (st.enc): the columnwise 1x16 or 16x16 codes. Stochastic rounding: a 16x16
// stripe draws from the rowwise stream (block j of row m0 + r: counter (j, m0 + r,
// b, 0)); a columnwise one from stream 1, column n's block of the stripe's 16
// rows being block m0 / 16 of row n of the copy [B, N, M]: counter (m0 / 16, n, b, 1).
inline void encode_columns(Stripe& st, int64_t width, int64_t m0, const Options& p) {
  st.code.resize(kBlock * width);
  if (!p.spec.stochastic_rounding) {
    for (int64_t r = 0; r < kBlock; ++r)
      encode(st.value.data() + r * width, st.enc.data(), st.code.data() + r * width, width);
    return;
  }
  const float* __restrict enc = st.enc.data();
  if (p.spec.block_2d) {
    const int64_t nb = width / kBlock;
    st.rand.resize(4 * nb);
    const uint8_t* __restrict rbyte = reinterpret_cast<const uint8_t*>(st.rand.data());
    for (int64_t r = 0; r < kBlock; ++r) {
      random_row_bytes(p.seed, uint32_t(m0 + r), p.b, 0, st.rand.data(), nb);
      const float* __restrict v = st.value.data() + r * width;
      uint8_t* __restrict code = st.code.data() + r * width;
      for (int64_t c = 0; c < width; ++c)
        code[c] = quantize_value_stochastic(v[c], enc[c], rbyte[c]);
    }
    return;
  }
  st.rand.resize(4 * width);
  random_column_words(p.seed, uint32_t(m0 / kBlock), p.b, 1, st.rand.data(), width);
  for (int64_t r = 0; r < kBlock; ++r) {
    const uint32_t* __restrict w = st.rand.data() + (r >> 2) * width;
    const float* __restrict v = st.value.data() + r * width;
    uint8_t* __restrict code = st.code.data() + r * width;
    const int shift = 8 * (r & 3);
    for (int64_t c = 0; c < width; ++c)
      code[c] = quantize_value_stochastic(v[c], enc[c], (w[c] >> shift) & 0xFFu);
  }
}

// Writes the rowwise 16x16 copy of the stripe: st.code, one scale per tile (st.scale per column).
inline void store_rows_2d(const Stripe& st, int64_t nrows, int64_t cols, int64_t width, int64_t m0,
                          const QuantizeOutputs& o) {
  const int64_t data_cols = packed_size(cols), scale_cols = num_blocks(cols);
  for (int64_t r = 0; r < nrows; ++r) {
    pack(st.code.data() + r * width, o.data + (m0 + r) * data_cols, data_cols);
    for (int64_t b = 0; b < scale_cols; ++b)
      o.scale[(m0 + r) * scale_cols + b] = st.scale[b * kBlock];
  }
}

// Writes the stripe's codes st.code and per-column scales st.scale to the columnwise copy.
inline void store_columns(Stripe& st, int64_t rows, int64_t cols, int64_t width, int64_t m0,
                          const QuantizeOutputs& o) {
  const int64_t data_t_cols = packed_size(rows), scale_t_cols = num_blocks(rows);
  const int64_t nbytes = std::min<int64_t>(kBlock / 2, data_t_cols - m0 / 2);
  // Byte k of column c packs the codes of rows 2k and 2k+1: build each
  // column's 8 bytes as one little-endian word, row pair by row pair.
  st.word.assign(width, 0);
  uint64_t* __restrict word = st.word.data();
  for (int64_t k = 0; k < kBlock / 2; ++k) {
    const uint8_t* __restrict lo = st.code.data() + 2 * k * width;
    const uint8_t* __restrict hi = lo + width;
    for (int64_t c = 0; c < width; ++c) word[c] |= uint64_t(lo[c] | (hi[c] << 4)) << (8 * k);
  }
  for (int64_t c = 0; c < cols; ++c) {
    std::memcpy(o.data_t + c * data_t_cols + m0 / 2, &word[c], size_t(nbytes));
    o.scale_t[c * scale_t_cols + m0 / kBlock] = st.scale[c];
  }
}

// Scales and encode scales of the 16x16 tiles of the stripe from the column
// maxima st.mag, spread to the tiles' columns; with 4over6 also the columnwise
// copy's (st.scale_t, st.enc_t), whose choice may differ.
inline void tile_scales(Stripe& st, int64_t width, const Options& p) {
  // One block per 16 columns: fold the column maxima.
  const int64_t nb = width / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    uint32_t m = 0;
    for (int k = 0; k < kBlock; ++k) m = std::max(m, st.mag[b * kBlock + k]);
    st.mag[b] = m;
  }
  if (p.spec.four_over_six().on()) {
    st.scale_t.resize(width);
    st.enc_t.resize(width);
    choose_2d(st.value.data(), width, st.mag.data(), p.g, p.spec.four_over_six(), st.fos,
              st.scale.data(), st.enc.data(), st.scale_t.data(), st.enc_t.data());
    spread_tiles(st.scale_t, nb);
    spread_tiles(st.enc_t, nb);
  } else {
    block_scales(st.mag.data(), nb, p.g, st.scale.data(), st.enc.data());
  }
  spread_tiles(st.scale, nb);
  spread_tiles(st.enc, nb);
}

// Scales and encode scales of the columnwise 1x16 blocks (one per column of the
// stripe) from the column maxima st.mag.
inline void column_scales(Stripe& st, int64_t cols, int64_t width, const Options& p) {
  if (!p.spec.four_over_six().on() && !p.spec.row_scaled) {
    block_scales(st.mag.data(), width, p.g_t, st.scale.data(), st.enc.data());
    return;
  }
  st.g.resize(width);
  for (int64_t c = 0; c < width; ++c) st.g[c] = c < cols ? p.column(c) : p.g_t;  // padding: unused
  if (p.spec.four_over_six().on())
    choose_1d(st.value.data(), width, st.mag.data(), st.g.data(), p.spec.four_over_six(), st.fos,
              st.scale.data(), st.enc.data());
  else
    block_scales_each(st.mag.data(), width, st.g.data(), st.scale.data(), st.enc.data());
}

// The columnwise copy of the RHT of x^T: the stripe st.value [16][width] transformed in place,
// each value rounded to the input dtype as the transform's output is.
template <typename L>
void transform_stripe(Stripe& st, int64_t width) {
  rht_rows(st.value.data(), width);
  for (int64_t k = 0; k < kBlock * width; ++k) st.value[k] = L::narrow(st.value[k]);
}

// The max magnitude (bits) of each column of the stripe into st.mag; sizes st.enc and st.scale.
inline void column_maxima(Stripe& st, int64_t width) {
  st.mag.assign(width, 0);
  st.enc.resize(width);
  st.scale.resize(width);
  for (int64_t r = 0; r < kBlock; ++r) {
    const float* v = st.value.data() + r * width;
    for (int64_t c = 0; c < width; ++c) st.mag[c] = std::max(st.mag[c], magnitude_bits(v[c]));
  }
}

}  // namespace nvfp4::cpu
