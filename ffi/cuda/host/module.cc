// _nvfp4_cuda_host: the CUDA FFI handlers over the host execution model (a test-only build,
// CMake option NVFP4_CUDA_HOST). registrations() gives the handlers of cuda/handlers.h, each
// wrapped to fill its results with a poison byte before it runs, as a GPU's fresh buffers hold
// garbage: an output element a kernel never writes, or an atomic accumulation into an output not
// zeroed on the stream, then differs from the CPU kernels' bytes. Also exports the model's
// settings and self-tests.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "build_config.h"
#include "cuda/e2m1_lut.cuh"
#include "cuda/handlers.h"
#include "cuda/host/probes.h"
#include "cuda/host/runtime.h"
#include "cuda/host/trace.h"
#include "nvfp4/ptx.h"
#include "nvfp4/subnormal_guard.h"

namespace nb = nanobind;

namespace {

constexpr int kPoison = 0xA5;

void poison_results(XLA_FFI_CallFrame* frame) {
  for (int64_t i = 0; i < frame->rets.size; ++i) {
    if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER) continue;
    auto* buf = static_cast<XLA_FFI_Buffer*>(frame->rets.rets[i]);
    size_t count = 1;
    for (int64_t d = 0; d < buf->rank; ++d) count *= size_t(buf->dims[d]);
    std::memset(buf->data, kPoison, count * xla::ffi::ByteWidth(xla::ffi::DataType(buf->dtype)));
  }
}

template <nvfp4::cuda::Handler* H>
XLA_FFI_Error* poisoned(XLA_FFI_CallFrame* frame) {
  const bool metadata_query = frame->extension_start != nullptr &&
                              frame->extension_start->type == XLA_FFI_Extension_Metadata;
  if (!metadata_query && frame->stage == XLA_FFI_ExecutionStage_EXECUTE) poison_results(frame);
  return H(frame);
}

nb::dict registrations() {
  nb::dict d;
  d["nvfp4_amax"] = nb::capsule(reinterpret_cast<void*>(poisoned<Nvfp4AmaxCuda>));
  d["nvfp4_quantize"] = nb::capsule(reinterpret_cast<void*>(poisoned<Nvfp4QuantizeCuda>));
  d["nvfp4_dequantize"] = nb::capsule(reinterpret_cast<void*>(poisoned<Nvfp4DequantizeCuda>));
  d["nvfp4_grouped_amax"] = nb::capsule(reinterpret_cast<void*>(poisoned<Nvfp4GroupedAmaxCuda>));
  d["nvfp4_grouped_quantize"] =
      nb::capsule(reinterpret_cast<void*>(poisoned<Nvfp4GroupedQuantizeCuda>));
  if (d.size() != nvfp4::cuda::handlers().size())
    throw std::logic_error("a CUDA handler is not wrapped");
  return d;
}

using Floats = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::bytes cvt_e2m1x2(Floats hi, Floats lo) {
  if (hi.shape(0) != lo.shape(0))
    throw std::invalid_argument("hi and lo must have the same length");
  std::string out(hi.shape(0), '\0');
  for (size_t i = 0; i < hi.shape(0); ++i)
    out[i] = char(nvfp4::cvt_rn_satfinite_e2m1x2(hi.data()[i], lo.data()[i]));
  return nb::bytes(out.data(), out.size());
}

// Calls count(u, v, counts) for every float32 bit pattern u (value v) but signalling NaNs
// (arithmetic makes none), on 4 threads, and returns the N counts summed.
template <int N, typename Count>
std::array<uint64_t, N> count_over_floats(Count count) {
  constexpr int kParts = 4;
  std::array<std::array<uint64_t, N>, kParts> counts{};
  std::vector<std::thread> threads;
  for (int part = 0; part < kParts; ++part)
    threads.emplace_back([&, part] {
      nvfp4::SubnormalGuard guard;
      const uint64_t begin = (uint64_t(part) << 32) / kParts,
                     end = (uint64_t(part + 1) << 32) / kParts;
      // Counted here, stored once: counts[part] of the 4 threads share cache lines (the E2M1 table
      // check took 72 s on 2 cores with every count written there, 33 s with these).
      std::array<uint64_t, N> local{};
      for (uint64_t i = begin; i < end; ++i) {
        const uint32_t u = uint32_t(i);
        if ((u & 0x7FFFFFFFu) > 0x7F800000u && !(u & 0x400000u)) continue;
        count(u, nvfp4::bits_float(u), local);
      }
      counts[part] = local;
    });
  for (auto& t : threads) t.join();
  std::array<uint64_t, N> total{};
  for (const auto& c : counts)
    for (int k = 0; k < N; ++k) total[k] += c[k];
  return total;
}

// The products the fast code indices are never used for: the round-down ties (0.25, 1.25, 2.5,
// 5, either sign) and -0.0.
bool fast_index_excluded(uint32_t u) {
  const float a = nvfp4::bits_float(u & 0x7FFFFFFFu);
  return u == 0x80000000u || a == 0.25f || a == 1.25f || a == 2.5f || a == 5.0f;
}

// Counts, in one pass over the float32 bit patterns, those whose E2M1 code from the quantize
// kernel's tables differs from float_to_e2m1's: the code table by the tie-safe index, by the fast
// index and the class table's class of the truncated float16 (both outside the cases they are
// not used for, counted as excluded), and the class table's class of the truncated tie-safe bits.
nb::tuple e2m1_tables_mismatches() {
  uint8_t lut[nvfp4::cuda::kLutSize];
  for (uint32_t i = 0; i < uint32_t(nvfp4::cuda::kLutSize); ++i) lut[i] = nvfp4::cuda::lut_entry(i);
  uint8_t codes[256];
  for (uint32_t b = 0; b < 256; ++b) codes[b] = nvfp4::cuda::f16_class_code(b);
  const auto [safe, fast, pair, excluded, pair_safe] =
      count_over_floats<5>([&](uint32_t u, float v, std::array<uint64_t, 5>& c) {
        const uint8_t want = nvfp4::float_to_e2m1(v);
        const uint32_t safe_bits = nvfp4::cuda::tie_safe_bits(u);
        c[0] += lut[safe_bits >> nvfp4::cuda::kLutShift] != want;
        c[4] += codes[nvfp4::f16_rz_bits(nvfp4::bits_float(safe_bits)) >> 8] != want;
        if (fast_index_excluded(u)) {
          ++c[3];
        } else {
          c[1] += lut[u >> nvfp4::cuda::kLutShift] != want;
          c[2] += codes[nvfp4::f16_rz_bits(v) >> 8] != want;
        }
      });
  return nb::make_tuple(safe, fast, pair, excluded, pair_safe);
}

// Checks the quantize kernel's stochastic-rounding arithmetic (sr_pair_sums, cuda/e2m1_lut.cuh)
// in two parts. The position: over every float32 magnitude up to inf as both products of a pair,
// with random byte 0 and no sign, (half - 2^15) >> 1 of each half of the sums against
// sr_position clamped to 7 * 256. The codes, which then depend only on (position, random byte,
// sign): over every float16 value h but NaNs as both products (every position a float can have is
// some such value's), both halves' codes against float_to_e2m1_stochastic for every random byte;
// the kernel's products are never -0.0, so the float16 -0.0 stands for a tiny negative product.
// Returns (position mismatches, code mismatches).
nb::tuple sr_arithmetic_mismatches() {
  const auto sums = [](float q, uint32_t random, uint32_t sel) {
    return nvfp4::cuda::sr_pair_sums(nvfp4::cvt_rz_f16x2(q, q),
                                     nvfp4::cuda::sr_below_one_pair(q, q), random, sel);
  };
  const auto [position] =
      count_over_floats<1>([&](uint32_t u, float v, std::array<uint64_t, 1>& c) {
        if (u > 0x7F800000u) return;  // NaNs and negative values: positions are of magnitudes
        const uint32_t want = std::min(nvfp4::sr_position(u), 7u * 256u);
        const uint32_t x = sums(v, 0, 0xF1D0u);
        c[0] += ((x & 0xFFFFu) - 0x8000u) >> 1 != want || ((x >> 16) - 0x8000u) >> 1 != want;
      });
  uint64_t codes = 0;
  nvfp4::SubnormalGuard guard;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7FFFu) > 0x7C00u) continue;  // float16 NaNs
    const float v = h == 0x8000u ? -0x1p-40f : nvfp4::f16_to_float(uint16_t(h));
    for (uint32_t r = 0; r < 256; ++r) {
      // Four different random bytes, each over all 256 values: halves read their own byte.
      const uint32_t bytes[4] = {r, r ^ 0xA5u, r ^ 0x3Cu, r ^ 0xFFu};
      const uint32_t random = bytes[0] | bytes[1] << 8 | bytes[2] << 16 | bytes[3] << 24;
      for (int half = 0; half < 2; ++half) {
        const uint32_t x = sums(v, random, half ? 0xF3D2u : 0xF1D0u);
        codes += ((x >> 9) & 0xFu) != nvfp4::float_to_e2m1_stochastic(v, bytes[2 * half]);
        codes += ((x >> 25) & 0xFu) != nvfp4::float_to_e2m1_stochastic(v, bytes[2 * half + 1]);
      }
    }
  }
  return nb::make_tuple(position, codes);
}

nb::bytes prmt(nb::bytes a, nb::bytes b, uint32_t sel) {
  if (a.size() != b.size() || a.size() % 4) throw std::invalid_argument("a and b: equal uint32");
  std::string out(a.size(), '\0');
  for (size_t i = 0; i < a.size(); i += 4) {
    uint32_t x, y;
    std::memcpy(&x, a.c_str() + i, 4);
    std::memcpy(&y, b.c_str() + i, 4);
    const uint32_t d = nvfp4::prmt_b32(x, y, sel);
    std::memcpy(&out[i], &d, 4);
  }
  return nb::bytes(out.data(), out.size());
}

nb::bytes f16_rz(Floats x) {
  std::string out(x.shape(0) * 2, '\0');
  for (size_t i = 0; i < x.shape(0); ++i) {
    const uint16_t h = uint16_t(nvfp4::f16_rz_bits(x.data()[i]));
    std::memcpy(&out[2 * i], &h, 2);
  }
  return nb::bytes(out.data(), out.size());
}

// The launches traced since trace_start (cuda/host/trace.h), as dicts: kernel, paths (name:
// thread executions) and sites (a list: site "file:line", space, access, size, requests,
// transactions, ideal, bytes).
nb::list trace_stop() {
  nb::list out;
  for (const auto& t : nvfp4::host::trace_stop()) {
    nb::list sites;
    nb::dict paths;
    for (const auto& [site, c] : t.sites) {
      nb::dict d;
      d["site"] = site.where;
      d["space"] = site.space == nvfp4::host::Space::kGlobal ? "global" : "shared";
      d["access"] = site.access == nvfp4::host::Access::kLoad ? "load" : "store";
      d["size"] = c.size;
      d["requests"] = c.requests;
      d["transactions"] = c.transactions;
      d["ideal"] = c.ideal;
      d["bytes"] = c.bytes;
      sites.append(d);
    }
    for (const auto& [name, n] : t.paths) paths[name.c_str()] = n;
    nb::dict launch;
    launch["kernel"] = t.kernel;
    launch["sites"] = sites;
    launch["paths"] = paths;
    out.append(launch);
  }
  return out;
}

}  // namespace

NB_MODULE(_nvfp4_cuda_host, m) {
  m.doc() = "NVFP4 CUDA FFI handlers on the CPU, over the CUDA host execution model (tests only)";
  m.def("registrations", &registrations);
  m.def("build_config", &nvfp4::build_config,
        "What this module was built with (CMake's settings).");
  m.def("set_emulated_sm", &nvfp4::host::set_emulated_sm, nb::arg("sm"),
        "The GPU the model stands for: 90 (Hopper) or 100/120 (sm_100a/sm_120a code paths).");
  m.def("emulated_sm", &nvfp4::host::emulated_sm);
  m.def("tensor_map_encodes", &nvfp4::host::tensor_map_encodes,
        "How many tensor maps the model has encoded in this process (cuTensorMapEncodeTiled's "
        "calls).");
  m.def("trace_start", &nvfp4::host::trace_start,
        "Starts the model's profiler (cuda/host/trace.h), clearing what it traced before.");
  m.def("trace_stop", &trace_stop,
        "Stops the profiler; returns each launch traced since trace_start: {kernel, paths: {name: "
        "thread executions}, sites: [{site (file:line), space, access, size, requests, "
        "transactions (sectors or wavefronts), ideal, bytes}]}.");
  m.def("cvt_rn_satfinite_e2m1x2", &cvt_e2m1x2, nb::arg("hi"), nb::arg("lo"),
        "The bytes cvt.rn.satfinite.e2m1x2.f32 gives for float32 arrays hi and lo (host "
        "equivalent).");
  m.def("e2m1_tables_mismatches", &e2m1_tables_mismatches,
        "Exhaustive check of the quantize kernel's E2M1 tables (cuda/e2m1_lut.cuh), one pass: "
        "(code table mismatches by the tie-safe index, by the fast index, class table class "
        "mismatches, cases excluded from the fast index and the class table, class table class "
        "mismatches of the tie-safe bits).");
  m.def("sr_arithmetic_mismatches", &sr_arithmetic_mismatches,
        "Exhaustive check of the quantize kernel's stochastic-rounding positions and codes "
        "(float16 arithmetic): (position mismatches, code mismatches).");
  m.def("prmt", &prmt, nb::arg("a"), nb::arg("b"), nb::arg("sel"),
        "prmt.b32 of uint32 arrays a and b (bytes) under selector sel (host equivalent).");
  m.def("f16_rz", &f16_rz, nb::arg("x"),
        "The float16 bits cvt.rz.f16x2.f32 gives for a float32 array (host equivalent).");
  m.def("probe", &nvfp4::cuda::probes::probe, nb::arg("name"), nb::arg("size"), nb::arg("a") = 0,
        nb::arg("b") = 0, nb::arg("c") = 0, nb::arg("mask") = 0xFFFFFFFFu,
        "Runs one of the model's self-test kernels (probes.cu).");
}
