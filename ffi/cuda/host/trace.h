// The host model's profiler: per kernel launch, the counters a GPU profiler would give, taken
// without a GPU. Kernels route their global and shared memory accesses through the macros of
// cuda/memory.cuh and name their code paths with NVFP4_PATH; while tracing is on (trace_start),
// each launch is summarized per access site:
//   - global memory: requests (one per warp-wide access instruction) and the 32-byte sectors they
//     touch, against the fewest sectors their bytes could fill (coalescing);
//   - shared memory: requests and wavefronts (bank conflicts: per phase of a request, the most
//     distinct 4-byte words any one of the 32 banks serves), against the fewest possible;
//   - bytes moved, and how often each named path ran (thread executions).
// A warp's request is rebuilt from its lanes' accesses: the n-th access of a site by each lane
// of a warp forms the site's n-th request (lanes run as fibers, not in lockstep). A predicated
// access (the _IF macros) counts in the numbering whether or not its lane is active, as a
// predicated instruction issues for the whole warp.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cuda/host/runtime.h"

namespace nvfp4::host {

enum class Space : uint8_t { kGlobal, kShared };
enum class Access : uint8_t { kLoad, kStore };

// An access site: where (file:line), and what it accesses.
struct Site {
  std::string where;
  Space space;
  Access access;
  auto operator<=>(const Site&) const = default;
};

// One access site's counters over a launch.
struct SiteCounters {
  uint32_t size = 0;          // bytes a lane accesses
  uint64_t requests = 0;      // warp-wide requests with an active lane
  uint64_t transactions = 0;  // sectors (global) or wavefronts (shared)
  uint64_t ideal = 0;         // the fewest sectors or wavefronts the same bytes need
  uint64_t bytes = 0;         // bytes the active lanes access (a byte twice counts twice)
};

// A traced launch: its kernel's name, counters by site, paths by name.
struct LaunchTrace {
  std::string kernel;
  std::map<Site, SiteCounters> sites;
  std::map<std::string, uint64_t> paths;
};

// Starts tracing (clearing what was traced before); trace_stop ends it and returns every launch
// traced since, in order.
void trace_start();
std::vector<LaunchTrace> trace_stop();

// Called by kernels (through cuda/memory.cuh): no-ops unless tracing and inside a kernel.
void trace_access(const char* site, Space space, Access access, const void* address, uint32_t size,
                  bool active);
void trace_path(const char* name);

// Called by the launch (runtime.cc): a launch's trace (null when not tracing), a worker's
// blocks, and the launch's end (kept where it succeeded).
LaunchTrace* trace_launch_begin(const std::string& kernel);
void trace_worker_begin(LaunchTrace* launch, int threads);
void trace_block_end();
void trace_worker_end();
void trace_launch_end(LaunchTrace* launch, bool succeeded);

// Shared accesses are checked against asynchronous copies in flight (runtime.h) whether or not
// tracing is on.
template <typename T>
T traced_load_if(const char* site, Space space, bool active, const T* p, T fallback) {
  if (active && space == Space::kShared) check_shared_access(p, sizeof(T), false, site);
  trace_access(site, space, Access::kLoad, p, sizeof(T), active);
  return active ? *p : fallback;
}
template <typename T>
T traced_load(const char* site, Space space, const T* p) {
  return traced_load_if(site, space, true, p, T{});
}
template <typename T, typename V>
void traced_store_if(const char* site, Space space, bool active, T* p, const V& v) {
  if (active && space == Space::kShared) check_shared_access(p, sizeof(T), true, site);
  trace_access(site, space, Access::kStore, p, sizeof(T), active);
  if (active) *p = T(v);
}

}  // namespace nvfp4::host
