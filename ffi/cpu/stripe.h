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

// The encode scales of all 256 E4M3 scale codes under one global decode scale (block_encode_scale
// depends on nothing else): a block's encode scale looked up instead of computed. Two tables
// (the rowwise and the columnwise copy's), each kept while its global scales stay.
struct EncodeTables {
  uint32_t key[2] = {0, 0};
  bool valid[2] = {false, false};
  float enc[2][256];
  int next = 0;

  const float* get(const GlobalScales& g) {
    const uint32_t k = float_bits(g.decode);
    for (int t = 0; t < 2; ++t)
      if (valid[t] && key[t] == k) return enc[t];
    const int t = next;
    next ^= 1;
    float* __restrict e = enc[t];
    for (int c = 0; c < 256; ++c) e[c] = block_encode_scale(uint8_t(c), g);
    key[t] = k;
    valid[t] = true;
    return e;
  }
};

// Per-thread scratch for one 16-row stripe, reused across stripes.
struct Stripe {
  std::vector<float> value;      // [16][width]: the stripe as float32, zero-padded
  std::vector<uint8_t> code;     // [16][width]: codes with per-column encode scales
  std::vector<uint32_t> mag;     // [width]: column max magnitude (bits)
  std::vector<float> enc;        // [width]: encode scale of each column's block
  std::vector<uint8_t> scale;    // [width]: E4M3 scale of each column's block
  std::vector<uint32_t> word;    // [2][width]: a column's 8 packed bytes of the columnwise copy,
                                 // bytes 0-3 (rows 0-7) then bytes 4-7 (rows 8-15)
  std::vector<uint32_t> rand;    // random words of stochastic rounding: [blocks][4] or [4][blocks]
  std::vector<GlobalScales> g;   // [width]: the global scales of each block (4over6, row-scaled)
  std::vector<float> rowt;       // [16][blocks]: one row's 1x16 chunks as columns (4over6)
  std::vector<uint8_t> scale_t;  // [width]: the columnwise copy's scales (16x16 4over6)
  std::vector<float> enc_t;      // [width]: the columnwise copy's encode scales (16x16 4over6)
  std::vector<uint64_t> band_word;  // [width][8]: the band's columnwise words (store_band)
  std::vector<uint8_t> band_scale;  // [width][8]: the band's columnwise scales
  std::vector<float> enc8;          // [8 nb]: a row's encode scales, one per byte
  EncodeTables tables;
  FosScratch fos;
};

// The options of one quantize call and one batch entry's global scales.
struct Options {
  QuantizeSpec spec;
  GlobalScales g;          // from amax: the rowwise copy and 16x16 blocks (not row-scaled)
  GlobalScales g_t;        // from amax_t: the columnwise 1x16 copy (not row-scaled)
  const float* amax_rows;  // row-scaled: the entry's amax per row of x [M] (rowwise)
  const float* amax_cols;  // row-scaled: the entry's amax per row of x^T [N] (columnwise)
  Stream seed;             // stochastic rounding's key and the copy's place (random counters)
  uint32_t b;              // the batch entry (random counters)

  // The rowwise copy's global scales for batch entry b, from amax [B] ([B, M] row-scaled).
  void set_rows(const float* amax, int64_t b, int64_t rows) {
    if (spec.row_scaled)
      amax_rows = amax + b * rows;
    else
      g = spec.global_scales(amax[b]);
  }
  // The columnwise copy's for entry e of amax_t [E] ([E, N] row-scaled).
  void set_columns(const float* amax_t, int64_t e, int64_t cols) {
    if (spec.row_scaled)
      amax_cols = amax_t + e * cols;
    else
      g_t = spec.global_scales(amax_t[e]);
  }

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

// Encodes and packs n pairs of values, pair k (values 2k and 2k + 1) with encode scale enc[k]:
// byte k (vectorizes over k).
inline void encode_pack(const float* __restrict v, const float* __restrict enc,
                        uint8_t* __restrict out, int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    out[k] = uint8_t(encode_pair(v[2 * k], enc[k], v[2 * k + 1], enc[k]));
}

// Each of n values repeated 8 times (an encode scale per byte of a block's 8).
inline void spread8(const float* __restrict in, float* __restrict out, int64_t n) {
  for (int64_t b = 0; b < n; ++b)
    for (int i = 0; i < 8; ++i) out[8 * b + i] = in[b];
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

// Scales and encode scales of blocks from their max magnitudes: the scales in a vector loop,
// the encode scales from the table of g (EncodeTables).
inline void block_scales(const uint32_t* __restrict mag, int64_t n, const GlobalScales& g,
                         const float* __restrict table, uint8_t* __restrict scale,
                         float* __restrict enc) {
  for (int64_t i = 0; i < n; ++i) scale[i] = block_scale(amax_from_bits(mag[i]), g);
  for (int64_t i = 0; i < n; ++i) enc[i] = table[scale[i]];
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

// The random bytes of the n rowwise blocks j = 0..n-1 of row r (Stream::row_block) in value
// order: w [n][4] holds block j's words, so that byte 16 j + k of w is value k's (vectorizes).
inline void random_row_bytes(const Stream& seed, int64_t r, uint32_t b, uint32_t* __restrict w,
                             int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    uint32_t out[4];
    seed.row_block(uint32_t(j), r, b, out);
    for (int q = 0; q < 4; ++q) w[4 * j + q] = out[q];
  }
}

// The random words of the columnwise blocks of rows m0..m0 + 15 in the n columns c = 0..n-1
// (Stream::column_block) into w [4][n]: word q of column c's block at w[q n + c], for loops over
// the columns (vectorizes).
inline void random_column_words(const Stream& seed, int64_t m0, uint32_t b, uint32_t* __restrict w,
                                int64_t n) {
  const uint32_t index = seed.column_index(m0);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t out[4];
    seed.column_block(index, uint32_t(i), b, out);
    w[i] = out[0];
    w[n + i] = out[1];
    w[2 * n + i] = out[2];
    w[3 * n + i] = out[3];
  }
}

// Encodes and packs n pairs of values stochastically, pair k with encode scale enc[k], value i
// with random byte rbyte[i] (random_row_bytes): byte k (vectorizes over k).
inline void encode_pack_stochastic(const float* __restrict v, const float* __restrict enc,
                                   const uint8_t* __restrict rbyte, uint8_t* __restrict out,
                                   int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    out[k] = uint8_t(quantize_value_stochastic(v[2 * k], enc[k], rbyte[2 * k]) |
                     (quantize_value_stochastic(v[2 * k + 1], enc[k], rbyte[2 * k + 1]) << 4));
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
// random words of p.seed.row_block(j, m, b).
inline void rowwise_1d(Stripe& st, int64_t /*rows*/, int64_t nrows, int64_t cols, int64_t width,
                       int64_t m0, const Options& p, const QuantizeOutputs& o) {
  const int64_t data_cols = packed_size(cols), nb = num_blocks(cols);
  st.mag.resize(nb);
  st.enc.resize(nb);
  st.enc8.resize(8 * nb);
  if (p.spec.stochastic_rounding) st.rand.resize(4 * nb);
  for (int64_t r = 0; r < nrows; ++r) {
    const float* v = st.value.data() + r * width;
    uint8_t* scale = o.scale + (m0 + r) * nb;
    const GlobalScales g = p.row(m0 + r);
    block_max(v, st.mag.data(), nb);
    if (p.spec.four_over_six().on())
      row_4over6(st, v, nb, g, p.spec.four_over_six(), scale);
    else
      block_scales(st.mag.data(), nb, g, st.tables.get(g), scale, st.enc.data());
    // The row's bytes, the last one cut by an odd row (data_cols < 8 nb).
    spread8(st.enc.data(), st.enc8.data(), nb);
    uint8_t* out = o.data + (m0 + r) * data_cols;
    if (p.spec.stochastic_rounding) {
      random_row_bytes(p.seed, m0 + r, p.b, st.rand.data(), nb);
      encode_pack_stochastic(v, st.enc8.data(), reinterpret_cast<const uint8_t*>(st.rand.data()),
                             out, data_cols);
    } else {
      encode_pack(v, st.enc8.data(), out, data_cols);
    }
  }
}

// The columnwise words st.word [2][width] from the codes st.code [16][width]: byte k of column c
// packs the codes of rows 2k and 2k+1.
inline void pack_words(Stripe& st, int64_t width) {
  st.word.assign(2 * width, 0u);
  for (int k = 0; k < kBlock / 2; ++k) {
    const uint8_t* __restrict lo = st.code.data() + 2 * k * width;
    const uint8_t* __restrict hi = lo + width;
    uint32_t* __restrict word = st.word.data() + (k >> 2) * width;
    const int shift = 8 * (k & 3);
    for (int64_t c = 0; c < width; ++c) word[c] |= uint32_t(lo[c] | (hi[c] << 4)) << shift;
  }
}

// Encodes the stripe st.value [16][width] with one encode scale per column (st.enc): the
// columnwise 1x16 copy's packed words st.word (rows 0-7 and 8-15 of each column), each column's
// 16 codes made in registers; 16x16 blocks also keep the codes st.code [16][width] for the
// rowwise copy. Stochastic rounding: a 16x16 stripe draws from the rowwise stream (block j of
// row m0 + r: p.seed.row_block(j, m0 + r, b)); a columnwise one from stream 1, column n's block
// of the stripe's 16 rows being block m0 / 16 of row n of the copy [B, N, M]:
// p.seed.column_block(p.seed.column_index(m0), n, b).
inline void encode_columns(Stripe& st, int64_t width, int64_t m0, const Options& p) {
  const float* __restrict enc = st.enc.data();
  const float* __restrict v = st.value.data();
  if (p.spec.block_2d) {
    st.code.resize(kBlock * width);
    if (!p.spec.stochastic_rounding) {
      for (int64_t r = 0; r < kBlock; ++r) {
        const float* __restrict vr = v + r * width;
        uint8_t* __restrict code = st.code.data() + r * width;
        for (int64_t c = 0; c < width; ++c) code[c] = uint8_t(e2m1_code(vr[c] * enc[c]));
      }
    } else {
      const int64_t nb = width / kBlock;
      st.rand.resize(4 * nb);
      const uint8_t* __restrict rbyte = reinterpret_cast<const uint8_t*>(st.rand.data());
      for (int64_t r = 0; r < kBlock; ++r) {
        random_row_bytes(p.seed, m0 + r, p.b, st.rand.data(), nb);
        const float* __restrict vr = v + r * width;
        uint8_t* __restrict code = st.code.data() + r * width;
        for (int64_t c = 0; c < width; ++c)
          code[c] = quantize_value_stochastic(vr[c], enc[c], rbyte[c]);
      }
    }
    pack_words(st, width);
    return;
  }
  // Byte k % 4 of word k / 4 of column c packs rows 2k and 2k + 1, row r's random byte being
  // byte r % 4 of word r / 4 of the column's block.
  st.word.assign(2 * width, 0u);
  if (p.spec.stochastic_rounding) {
    st.rand.resize(4 * width);
    random_column_words(p.seed, m0, p.b, st.rand.data(), width);
  }
  for (int k = 0; k < kBlock / 2; ++k) {
    const float* __restrict v0 = v + 2 * k * width;
    const float* __restrict v1 = v0 + width;
    uint32_t* __restrict word = st.word.data() + (k >> 2) * width;
    const int shift = 8 * (k & 3);
    if (!p.spec.stochastic_rounding) {
      for (int64_t c = 0; c < width; ++c)
        word[c] |= encode_pair(v0[c], enc[c], v1[c], enc[c]) << shift;
      continue;
    }
    const uint32_t* __restrict rw = st.rand.data() + (k >> 1) * width;
    const int r0 = 16 * (k & 1);  // rows 2k and 2k + 1: bytes 2 (k % 2) and 2 (k % 2) + 1
    for (int64_t c = 0; c < width; ++c)
      word[c] |= (quantize_value_stochastic(v0[c], enc[c], (rw[c] >> r0) & 0xFFu) |
                  (quantize_value_stochastic(v1[c], enc[c], (rw[c] >> (r0 + 8)) & 0xFFu) << 4))
                 << shift;
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

// Writes the stripe's packed words st.word and per-column scales st.scale to the columnwise copy.
inline void store_columns(Stripe& st, int64_t rows, int64_t cols, int64_t width, int64_t m0,
                          const QuantizeOutputs& o) {
  const int64_t data_t_cols = packed_size(rows), scale_t_cols = num_blocks(rows);
  const int64_t nbytes = std::min<int64_t>(kBlock / 2, data_t_cols - m0 / 2);
  const uint32_t* lo = st.word.data();
  const uint32_t* hi = lo + width;
  uint8_t* data = o.data_t + m0 / 2;
  uint8_t* scale = o.scale_t + m0 / kBlock;
  for (int64_t c = 0; c < cols; ++c) {
    const uint64_t word = uint64_t(lo[c]) | uint64_t(hi[c]) << 32;
    std::memcpy(data + c * data_t_cols, &word, size_t(nbytes));
    scale[c * scale_t_cols] = st.scale[c];
  }
}

// A band: up to kBandStripes consecutive stripes, whose columnwise copy is gathered in
// st.band_word / st.band_scale and written once, 8 bytes per stripe and column side by side:
// one whole 64-byte line of a column's codes instead of 8 scattered stores over 8 stripes.
constexpr int64_t kBandStripes = 8;

// Keeps the stripe's packed words st.word and per-column scales st.scale as stripe `slot` of the
// band (store_band writes them).
inline void band_columns(Stripe& st, int64_t width, int64_t slot) {
  st.band_word.resize(kBandStripes * width);
  st.band_scale.resize(kBandStripes * width);
  const uint32_t* __restrict lo = st.word.data();
  const uint32_t* __restrict hi = lo + width;
  const uint8_t* __restrict scale = st.scale.data();
  uint64_t* __restrict word = st.band_word.data() + slot;
  uint8_t* __restrict band_scale = st.band_scale.data() + slot;
  for (int64_t c = 0; c < width; ++c) {
    word[c * kBandStripes] = uint64_t(lo[c]) | uint64_t(hi[c]) << 32;
    band_scale[c * kBandStripes] = scale[c];
  }
}

// Writes the band starting at row m0 (a multiple of 16 kBandStripes) to the columnwise copy.
inline void store_band(const Stripe& st, int64_t rows, int64_t cols, int64_t m0,
                       const QuantizeOutputs& o) {
  const int64_t data_t_cols = packed_size(rows), scale_t_cols = num_blocks(rows);
  const size_t nbytes = size_t(std::min<int64_t>(kBandStripes * 8, data_t_cols - m0 / 2));
  const size_t nscales = size_t(std::min<int64_t>(kBandStripes, scale_t_cols - m0 / kBlock));
  uint8_t* data = o.data_t + m0 / 2;
  uint8_t* scale = o.scale_t + m0 / kBlock;
  for (int64_t c = 0; c < cols; ++c) {
    std::memcpy(data + c * data_t_cols, st.band_word.data() + c * kBandStripes, nbytes);
    std::memcpy(scale + c * scale_t_cols, st.band_scale.data() + c * kBandStripes, nscales);
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
    block_scales(st.mag.data(), nb, p.g, st.tables.get(p.g), st.scale.data(), st.enc.data());
  }
  spread_tiles(st.scale, nb);
  spread_tiles(st.enc, nb);
}

// Scales and encode scales of the columnwise 1x16 blocks (one per column of the
// stripe) from the column maxima st.mag.
inline void column_scales(Stripe& st, int64_t cols, int64_t width, const Options& p) {
  if (!p.spec.four_over_six().on() && !p.spec.row_scaled) {
    block_scales(st.mag.data(), width, p.g_t, st.tables.get(p.g_t), st.scale.data(), st.enc.data());
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
