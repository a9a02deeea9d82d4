// Global amax: max |x| per batch entry, as an integer max over magnitude bits
// (exact, and any NaN wins and comes out canonical). With `rht_amax`, the same pass
// also gives the amax of the Random Hadamard Transform of x^T (16-row chunks of
// each column, rounded to the input dtype).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/common.h"
#include "cpu/handlers.h"

namespace nvfp4::cpu {
namespace {

template <typename Loader>
uint32_t max_magnitude_bits(const typename Loader::T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, magnitude_bits(Loader::load(x[i])));
  return m;
}

// Max magnitude bits of x and of its RHT over the 16-row stripe at x
// (16 x cols values); `v` is scratch of 16 * cols floats.
template <typename L>
void stripe_rht_max(const typename L::T* x, int64_t cols, std::vector<float>& v, uint32_t& m,
                    uint32_t& m_rht) {
  v.resize(kBlock * cols);
  for (int64_t i = 0; i < kBlock * cols; ++i) {
    v[i] = L::load(x[i]);
    m = std::max(m, magnitude_bits(v[i]));
  }
  rht_rows(v.data(), cols);
  for (int64_t i = 0; i < kBlock * cols; ++i)
    m_rht = std::max(m_rht, magnitude_bits(L::narrow(v[i])));
}

// Per-row amax of one [rows, cols] matrix: the max of each row (amax_rows)
// and of each column, or with rht_amax of each column's transformed chunks (amax_cols).
template <typename L>
void per_row_amax(ffi::ThreadPool& pool, const typename L::T* x, int64_t rows, int64_t cols,
                  bool rht_amax, float* amax_rows, float* amax_cols) {
  const int64_t cost = rows * cols * int64_t(sizeof(typename L::T)) * (rht_amax ? 8 : 1);
  parallel_for(pool, rows, cost, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      amax_rows[r] = amax_from_bits(max_magnitude_bits<L>(x + r * cols, cols));
  });
  // Columns in chunks of kWidth, each chunk down all the rows (16 at a time with rht_amax).
  constexpr int64_t kWidth = 256;
  const int64_t chunks = (cols + kWidth - 1) / kWidth;
  parallel_for(pool, chunks, cost, [&](int64_t lo, int64_t hi) {
    std::vector<uint32_t> m(kWidth);
    std::vector<float> v(kBlock * kWidth);
    for (int64_t chunk = lo; chunk < hi; ++chunk) {
      const int64_t c0 = chunk * kWidth, width = std::min(kWidth, cols - c0);
      std::fill(m.begin(), m.end(), 0u);
      if (rht_amax) {
        for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
          for (int64_t r = 0; r < kBlock; ++r)
            for (int64_t c = 0; c < width; ++c)
              v[r * width + c] = L::load(x[(r0 + r) * cols + c0 + c]);
          rht_rows(v.data(), width);
          for (int64_t r = 0; r < kBlock; ++r)
            for (int64_t c = 0; c < width; ++c)
              m[c] = std::max(m[c], magnitude_bits(L::narrow(v[r * width + c])));
        }
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          const typename L::T* xr = x + r * cols + c0;
          for (int64_t c = 0; c < width; ++c) m[c] = std::max(m[c], magnitude_bits(L::load(xr[c])));
        }
      }
      for (int64_t c = 0; c < width; ++c) amax_cols[c0 + c] = amax_from_bits(m[c]);
    }
  });
}

ffi::Error amax_impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingRets outs, bool rht_amax,
                     bool per_row) {
  int64_t batch = 0, rows = 0, cols = 0;
  float *amax = nullptr, *amax_t = nullptr;
  if (auto e = check_amax(x, outs, rht_amax, per_row, batch, rows, cols, amax, amax_t); e.failure())
    return e;
  const int64_t per_batch = rows * cols;
  const bool ok = dispatch_input(x.element_type(), [&](auto loader) {
    using L = decltype(loader);
    const auto* data = static_cast<const typename L::T*>(x.untyped_data());
    for (int64_t b = 0; b < batch; ++b) {
      if (per_row) {
        per_row_amax<L>(pool, data + b * per_batch, rows, cols, rht_amax, amax + b * rows,
                        amax_t + b * cols);
        continue;
      }
      const auto* xb = data + b * per_batch;
      // Split the tensor into chunks, reduce each on its own thread, then combine.
      constexpr int64_t kChunks = 64;
      uint32_t partial[kChunks] = {}, partial_rht[kChunks] = {};
      const int64_t cost = per_batch * int64_t(sizeof(typename L::T)) * (rht_amax ? 8 : 1);
      if (rht_amax) {
        // Chunks of whole 16-row stripes.
        const int64_t stripes = rows / kBlock;
        const int64_t chunk = (stripes + kChunks - 1) / kChunks;
        parallel_for(pool, kChunks, cost, [&](int64_t lo, int64_t hi) {
          std::vector<float> v;
          for (int64_t c = lo; c < hi; ++c) {
            const int64_t end = std::min(stripes, (c + 1) * chunk);
            for (int64_t s = c * chunk; s < end; ++s)
              stripe_rht_max<L>(xb + s * kBlock * cols, cols, v, partial[c], partial_rht[c]);
          }
        });
      } else {
        const int64_t chunk = (per_batch + kChunks - 1) / kChunks;
        parallel_for(pool, kChunks, cost, [&](int64_t lo, int64_t hi) {
          for (int64_t c = lo; c < hi; ++c) {
            const int64_t begin = std::min(per_batch, c * chunk);
            const int64_t end = std::min(per_batch, begin + chunk);
            partial[c] = max_magnitude_bits<L>(xb + begin, end - begin);
          }
        });
      }
      uint32_t m = 0, m_rht = 0;
      for (int64_t c = 0; c < kChunks; ++c) {
        m = std::max(m, partial[c]);
        m_rht = std::max(m_rht, partial_rht[c]);
      }
      amax[b] = amax_from_bits(m);
      if (rht_amax) amax_t[b] = amax_from_bits(m_rht);
    }
  });
  return ok ? ffi::Error::Success() : invalid("amax input must be bfloat16, float16 or float32");
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4AmaxCpu, nvfp4::cpu::amax_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<bool>("rht_amax")
                                  .Attr<bool>("per_row"));
