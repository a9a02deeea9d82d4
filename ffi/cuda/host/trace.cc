// The host model's profiler (trace.h): accesses buffered per thread of the running block, folded
// into per-site counters once the block ends.
#include "cuda/host/trace.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "cuda/host/runtime.h"

namespace nvfp4::host {
namespace {

constexpr uint64_t kSector = 32;  // bytes of a global-memory sector
constexpr int kBanks = 32;        // 4-byte shared-memory banks
constexpr uint32_t kWavefrontBytes = kBanks * 4;

struct Record {
  const char* site;
  uint64_t address;
  uint32_t size;
  Space space;
  Access access;
  bool active;
};

std::atomic<bool> tracing{false};
std::mutex traces_mutex;
std::vector<std::unique_ptr<LaunchTrace>> traces;  // launches begun since trace_start

// The worker's launch, its block's accesses by thread, and its share of the launch's counters
// (merged into the launch's once the worker is done).
struct Worker {
  LaunchTrace* launch = nullptr;
  std::vector<std::vector<Record>> threads;
  std::unordered_map<const char*, uint64_t> paths;
  LaunchTrace counted;
};
thread_local Worker worker;

int thread_in_block() {
  return int(thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z));
}

// One request: its lanes' accesses (lane, address, size), the active ones only.
using Lanes = std::vector<std::tuple<int, uint64_t, uint32_t>>;

// Sectors touched, and the fewest the same distinct bytes fill.
std::pair<uint64_t, uint64_t> sectors(const Lanes& lanes) {
  std::set<uint64_t> touched;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [lane, a, size] : lanes) {
    for (uint64_t s = a / kSector; s <= (a + size - 1) / kSector; ++s) touched.insert(s);
    ranges.emplace_back(a, a + size);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t distinct = 0, end = 0;
  for (const auto& [b, e] : ranges) {
    const uint64_t from = std::max(b, end);
    if (e > from) distinct += e - from;
    end = std::max(end, e);
  }
  return {touched.size(), (distinct + kSector - 1) / kSector};
}

// Wavefronts: a request is served in phases of 128 bytes' worth of lanes (all 32 lanes for
// accesses of up to 4 bytes, 16 for 8 bytes, 8 for 16); a phase takes as many wavefronts as
// the most distinct words one bank holds (lanes reading one word share it). The fewest: one a
// phase, or the distinct words over 32.
std::pair<uint64_t, uint64_t> wavefronts(const Lanes& lanes) {
  const uint32_t size = std::get<2>(lanes.front());
  const int per_phase = size <= 4 ? kWarpSize : int(kWavefrontBytes / size);
  std::map<int, std::vector<std::set<uint64_t>>> phases;
  for (const auto& [lane, a, sz] : lanes) {
    auto& banks = phases[lane / per_phase];
    banks.resize(kBanks);
    for (uint64_t w = a / 4; w <= (a + sz - 1) / 4; ++w) banks[w % kBanks].insert(w);
  }
  uint64_t got = 0, fewest = 0;
  for (const auto& [phase, banks] : phases) {
    size_t most = 0, words = 0;
    for (const auto& b : banks) {
      most = std::max(most, b.size());
      words += b.size();
    }
    got += most;
    fewest += std::max<uint64_t>(1, (words + kBanks - 1) / kBanks);
  }
  return {got, fewest};
}

// Folds the block's accesses into the launch's counters: per warp, the n-th access of a site by
// each lane is the site's n-th request.
void fold_block(LaunchTrace& launch, std::vector<std::vector<Record>>& threads) {
  const int count = int(threads.size());
  for (int warp = 0; warp * kWarpSize < count; ++warp) {
    // (site, space, access) -> its n-th request's lanes
    using Key = std::tuple<const char*, Space, Access>;
    std::map<std::pair<Key, uint32_t>, Lanes> requests;
    for (int lane = 0; lane < kWarpSize && warp * kWarpSize + lane < count; ++lane) {
      std::map<Key, uint32_t> seq;
      for (const Record& r : threads[warp * kWarpSize + lane]) {
        const Key key{r.site, r.space, r.access};
        Lanes& request = requests[{key, seq[key]++}];
        if (r.active) request.emplace_back(lane, r.address, r.size);
      }
    }
    for (const auto& [key, lanes] : requests) {
      if (lanes.empty()) continue;
      const auto [where, space, access] = key.first;
      SiteCounters& c = launch.sites[Site{where, space, access}];
      c.size = std::get<2>(lanes.front());
      ++c.requests;
      for (const auto& l : lanes) c.bytes += std::get<2>(l);
      const auto [got, fewest] = space == Space::kGlobal ? sectors(lanes) : wavefronts(lanes);
      c.transactions += got;
      c.ideal += fewest;
    }
  }
  for (auto& t : threads) t.clear();
}

}  // namespace

void trace_start() {
  std::lock_guard<std::mutex> lock(traces_mutex);
  traces.clear();
  tracing = true;
}

std::vector<LaunchTrace> trace_stop() {
  std::lock_guard<std::mutex> lock(traces_mutex);
  tracing = false;
  std::vector<LaunchTrace> out;
  for (auto& t : traces) out.push_back(std::move(*t));
  traces.clear();
  return out;
}

void trace_access(const char* site, Space space, Access access, const void* address, uint32_t size,
                  bool active) {
  if (worker.launch == nullptr) return;
  worker.threads[thread_in_block()].push_back(
      Record{site, uint64_t(reinterpret_cast<uintptr_t>(address)), size, space, access, active});
}

void trace_path(const char* name) {
  if (worker.launch != nullptr) ++worker.paths[name];
}

LaunchTrace* trace_launch_begin(const std::string& kernel) {
  if (!tracing) return nullptr;
  std::lock_guard<std::mutex> lock(traces_mutex);
  traces.push_back(std::make_unique<LaunchTrace>());
  traces.back()->kernel = kernel;
  return traces.back().get();
}

void trace_worker_begin(LaunchTrace* launch, int threads) {
  worker = Worker{};
  worker.launch = launch;
  worker.threads.resize(launch ? size_t(threads) : 0);
}

void trace_block_end() {
  if (worker.launch != nullptr) fold_block(worker.counted, worker.threads);
}

void trace_worker_end() {
  if (worker.launch != nullptr) {
    std::lock_guard<std::mutex> lock(traces_mutex);
    for (const auto& [name, n] : worker.paths) worker.launch->paths[name] += n;
    for (const auto& [site, c] : worker.counted.sites) {
      SiteCounters& to = worker.launch->sites[site];
      to.size = c.size;
      to.requests += c.requests;
      to.transactions += c.transactions;
      to.ideal += c.ideal;
      to.bytes += c.bytes;
    }
  }
  worker = Worker{};
}

void trace_launch_end(LaunchTrace* launch, bool succeeded) {
  if (launch == nullptr || succeeded) return;
  std::lock_guard<std::mutex> lock(traces_mutex);
  std::erase_if(traces, [&](const auto& t) { return t.get() == launch; });
}

}  // namespace nvfp4::host
