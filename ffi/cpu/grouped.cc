// The grouped ops of a mixture of experts on the CPU (jax_nvfp4/reference/grouped.py is the
// spec): x [B, M, N] holds token rows sorted by group, group_sizes [B, G] how many each group
// takes. Global block j (rows 16j..16j+15) of group g (its rows only, the others zero) is block
// j + g of the grouped columnwise copy, which has P = ceil(M/16) + G - 1 blocks; the blocks no
// group owns are zero. Each input stripe is loaded once: its rowwise copy, then the columnwise
// block of every group that has rows in it.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/handlers.h"
#include "cpu/stripe.h"

namespace nvfp4::cpu {
namespace {

// The rows [start, end) of each group of one batch entry, cut at M.
struct Groups {
  std::vector<int64_t> start, end;

  Groups(const int32_t* sizes, int64_t groups, int64_t rows) : start(groups), end(groups) {
    int64_t at = 0;
    for (int64_t g = 0; g < groups; ++g) {
      start[g] = at;
      at = std::min(rows, at + std::max<int64_t>(0, sizes[g]));
      end[g] = at;
    }
  }
  int64_t count() const { return int64_t(start.size()); }
  int64_t rows_in_groups() const { return end.empty() ? 0 : end.back(); }
  // The first group with rows at or after row m (groups are in row order).
  int64_t first_ending_after(int64_t m) const {
    return std::upper_bound(end.begin(), end.end(), m) - end.begin();
  }
};

// The rows of the stripe `all` [16][width] in [lo, hi) (stripe-relative), the others zero.
void masked_rows(const std::vector<float>& all, int64_t width, int64_t lo, int64_t hi,
                 std::vector<float>& out) {
  out.assign(kBlock * width, 0.0f);
  for (int64_t r = std::max<int64_t>(lo, 0); r < std::min<int64_t>(hi, kBlock); ++r)
    std::memcpy(out.data() + r * width, all.data() + r * width, size_t(width) * sizeof(float));
}

// The operands and outputs of one grouped quantize call.
struct GroupedCall {
  QuantizeSpec spec;
  int64_t batch, rows, cols, groups, blocks;  // blocks: P of the grouped copy
  const int32_t* sizes;                       // [B, G]
  const float *amax, *amax_t;                 // [B] or [B, M]; [B, G] or [B, G, N]
  Stream seed;                                // the rowwise copy's key and both copies' place
  const uint32_t* group_seeds;                // [G, 2]
  QuantizeOutputs o;                          // data_t [B, N, 8P], scale_t [B, N, P]
};

// Quantizes stripe j of batch entry b: its rowwise copy and the columnwise blocks of its groups.
template <typename L>
void grouped_stripe(const typename L::T* x, const GroupedCall& c, const Groups& gr, int64_t b,
                    int64_t j, std::vector<float>& all, Stripe& st) {
  const int64_t m0 = j * kBlock, nrows = std::min<int64_t>(kBlock, c.rows - m0);
  const int64_t width = num_blocks(c.cols) * kBlock, mp = c.blocks * kBlock;
  all.resize(kBlock * width);
  load_stripe<L>(x + m0 * c.cols, c.cols, nrows, width, all.data());
  const uint32_t entry = uint32_t(b);
  if (c.spec.rowwise) {
    Options p{c.spec, GlobalScales{}, GlobalScales{}, nullptr, nullptr, c.seed, entry};
    p.set_rows(c.amax, b, c.rows);
    masked_rows(all, width, 0, gr.rows_in_groups() - m0, st.value);  // rows past the groups: zero
    const QuantizeOutputs rows_out =
        QuantizeOutputs{c.o.data, c.o.scale, nullptr, nullptr}.entry(b, c.rows, c.cols);
    rowwise_1d(st, c.rows, nrows, c.cols, width, m0, p, rows_out);
  }
  const QuantizeOutputs cols_out{nullptr, nullptr, c.o.data_t + b * c.cols * (mp / 2),
                                 c.o.scale_t + b * c.cols * c.blocks};
  for (int64_t g = gr.first_ending_after(m0); g < gr.count() && gr.start[g] < m0 + kBlock; ++g) {
    if (gr.end[g] == gr.start[g]) continue;
    Options p{c.spec, GlobalScales{}, GlobalScales{}, nullptr, nullptr, c.seed, entry};
    p.seed.key =
        Seed{c.group_seeds[2 * g], c.group_seeds[2 * g + 1]};  // the group's, at the same place
    p.set_columns(c.amax_t, b * c.groups + g, c.cols);
    masked_rows(all, width, gr.start[g] - m0, gr.end[g] - m0, st.value);
    if (c.spec.columnwise_rht()) transform_stripe<L>(st, width);
    column_maxima(st, width);
    column_scales(st, c.cols, width, p);
    // Random words of global block j; the block lands at j + g of the grouped copy.
    encode_columns(st, width, m0, p);
    store_columns(st, mp, c.cols, width, (j + g) * kBlock, cols_out);
  }
}

ffi::Error grouped_quantize_impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> amax,
                                 ffi::Buffer<ffi::F32> amax_t, ffi::Buffer<ffi::U32> seed,
                                 ffi::Buffer<ffi::U32> group_seeds, ffi::RemainingRets outs,
                                 QuantizeSpec spec) {
  GroupedShape s;
  QuantizeOutputs o;
  bool placed = false;
  if (auto e = check_grouped_quantize(x, sizes, amax, amax_t, seed, group_seeds, outs, spec, s, o,
                                      placed);
      e.failure())
    return e;
  const GroupedCall c{spec,
                      s.batch,
                      s.rows,
                      s.cols,
                      s.groups,
                      s.blocks,
                      sizes.typed_data(),
                      amax.typed_data(),
                      amax_t.typed_data(),
                      stream_of(seed.typed_data(), placed, s.rows),
                      group_seeds.typed_data(),
                      o};
  // Blocks that no group owns stay zero codes with zero scales.
  std::memset(c.o.data_t, 0, size_t(s.grouped_data_count()));
  std::memset(c.o.scale_t, 0, size_t(s.grouped_scale_count()));
  std::vector<Groups> groups;
  for (int64_t b = 0; b < c.batch; ++b)
    groups.emplace_back(c.sizes + b * c.groups, c.groups, c.rows);
  const int64_t stripes = num_blocks(c.rows);
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    const int64_t cost = c.batch * c.rows * c.cols * int64_t(sizeof(typename L::T)) *
                         std::max<int64_t>(2, spec.cost_per_byte());
    parallel_for(pool, c.batch * stripes, cost, [&](int64_t lo, int64_t hi) {
      Stripe st;
      std::vector<float> all;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t b = i / stripes;
        grouped_stripe<L>(data + b * c.rows * c.cols, c, groups[b], b, i % stripes, all, st);
      }
    });
  });
  return ok ? ffi::Error::Success()
            : invalid("grouped quantize input must be bfloat16, float16 or float32");
}

// Each group's column maxima of one batch entry, plain and (with `transform`) of the RHT, as
// magnitude bits [G][N]: work items of one group and 256 columns, each down its group's stripes.
template <typename L>
void group_column_maxima(ffi::ThreadPool& pool, const typename L::T* x, int64_t rows, int64_t cols,
                         const Groups& gr, bool transform, std::vector<uint32_t>& plain,
                         std::vector<uint32_t>& transformed) {
  constexpr int64_t kWidth = 256;
  const int64_t chunks = (cols + kWidth - 1) / kWidth, groups = gr.count();
  plain.assign(groups * cols, 0);
  transformed.assign(groups * cols, 0);
  const int64_t cost = rows * cols * int64_t(sizeof(typename L::T)) * (transform ? 8 : 1);
  parallel_for(pool, groups * chunks, cost, [&](int64_t lo, int64_t hi) {
    std::vector<float> v(kBlock * kWidth);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t g = item / chunks, c0 = (item % chunks) * kWidth;
      const int64_t width = std::min(kWidth, cols - c0);
      uint32_t* mp = plain.data() + g * cols + c0;
      uint32_t* mt = transformed.data() + g * cols + c0;
      for (int64_t m0 = gr.start[g] / kBlock * kBlock; m0 < gr.end[g]; m0 += kBlock) {
        for (int64_t r = 0; r < kBlock; ++r) {
          const int64_t m = m0 + r;
          const bool mine = m >= gr.start[g] && m < gr.end[g];
          for (int64_t k = 0; k < width; ++k) {
            const float value = mine ? L::load(x[m * cols + c0 + k]) : 0.0f;
            v[r * width + k] = value;
            mp[k] = std::max(mp[k], magnitude_bits(value));
          }
        }
        if (!transform) continue;
        rht_rows(v.data(), width);
        for (int64_t r = 0; r < kBlock; ++r)
          for (int64_t k = 0; k < width; ++k)
            mt[k] = std::max(mt[k], magnitude_bits(L::narrow(v[r * width + k])));
      }
    }
  });
}

ffi::Error grouped_amax_impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sizes,
                             ffi::RemainingRets outs, bool rht_amax, bool per_row) {
  GroupedShape s;
  float* ptrs[2] = {nullptr, nullptr};
  if (auto e = check_grouped_amax(x, sizes, outs, rht_amax, per_row, s, ptrs); e.failure())
    return e;
  const int64_t batch = s.batch, rows = s.rows, cols = s.cols, groups = s.groups;
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    std::vector<uint32_t> plain, transformed;
    for (int64_t b = 0; b < batch; ++b) {
      const auto* xb = data + b * rows * cols;
      const Groups gr(sizes.typed_data() + b * groups, groups, rows);
      group_column_maxima<L>(pool, xb, rows, cols, gr, rht_amax, plain, transformed);
      const std::vector<uint32_t>& cols_max = rht_amax ? transformed : plain;
      if (per_row) {
        float* row_amax = ptrs[0] + b * rows;
        for (int64_t m = 0; m < rows; ++m) {
          uint32_t mag = 0;
          if (m < gr.rows_in_groups())
            for (int64_t n = 0; n < cols; ++n)
              mag = std::max(mag, magnitude_bits(L::load(xb[m * cols + n])));
          row_amax[m] = amax_from_bits(mag);
        }
        for (int64_t i = 0; i < groups * cols; ++i)
          ptrs[1][b * groups * cols + i] = amax_from_bits(cols_max[i]);
        continue;
      }
      uint32_t whole = 0;
      for (int64_t g = 0; g < groups; ++g) {
        uint32_t mine = 0;
        for (int64_t n = 0; n < cols; ++n) {
          whole = std::max(whole, plain[g * cols + n]);
          mine = std::max(mine, cols_max[g * cols + n]);
        }
        ptrs[1][b * groups + g] = amax_from_bits(mine);
      }
      ptrs[0][b] = amax_from_bits(whole);
    }
  });
  return ok ? ffi::Error::Success()
            : invalid("grouped amax input must be bfloat16, float16 or float32");
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4GroupedAmaxCpu, nvfp4::cpu::grouped_amax_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<bool>("rht_amax")
                                  .Attr<bool>("per_row"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4GroupedQuantizeCpu, nvfp4::cpu::grouped_quantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingRets()
                                  .Attrs<nvfp4::QuantizeSpec>());
