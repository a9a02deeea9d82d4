// Helpers of the CPU FFI handlers: a parallel-for over XLA's intra-op thread
// pool (the loaders, dispatch and buffer checks are in nvfp4/ffi_common.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "nvfp4/ffi_common.h"
#include "nvfp4/subnormal_guard.h"

namespace nvfp4::cpu {

// The work of one parallel_for: chunks claimed one at a time by the caller and
// by the tasks it schedules. Shared (shared_ptr) with the tasks, since a task
// may start after the call has returned, when every chunk is done: it then
// finds none to claim and touches nothing else.
struct ParallelWork {
  int64_t n = 0, chunks = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;

  // Runs chunks until none is left; body(begin, end) under a SubnormalGuard.
  template <typename Body>
  void run(Body& body) {
    SubnormalGuard guard;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      body(c * n / chunks, (c + 1) * n / chunks);
      if (done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

// Runs body(begin, end) over [0, n) in chunks across threads when the work
// (`cost`, roughly bytes touched) is large enough to pay for them: on XLA's
// intra-op thread pool (the handler's ffi::ThreadPool context) where the
// runtime has one, else on threads of our own. The caller works on chunks too,
// and waits only for chunks that a task has started, so a busy pool (whose
// tasks start late, or run inline when XLA has no pool) costs parallelism,
// never progress. Chunks are claimed dynamically, several per thread, so that
// a thread slowed by other work on the machine takes fewer.
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t cost, Body&& body) {
  constexpr int64_t kMinCostPerThread = int64_t(1) << 20;
  constexpr int64_t kChunksPerThread = 8;
  const int64_t pool_threads = pool.num_threads();
  const int64_t hw =
      pool_threads > 0 ? pool_threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::min({hw, n, std::max<int64_t>(1, cost / kMinCostPerThread)});
  if (threads <= 1) {
    SubnormalGuard guard;
    body(int64_t(0), n);
    return;
  }
  auto work = std::make_shared<ParallelWork>();
  work->n = n;
  work->chunks = std::min(n, threads * kChunksPerThread);
  if (pool_threads > 0) {
    for (int64_t t = 1; t < threads; ++t) pool.Schedule([work, &body] { work->run(body); });
    work->run(body);
    std::unique_lock<std::mutex> lock(work->mu);
    work->all_done.wait(lock, [&] { return work->done.load() == work->chunks; });
    return;
  }
  std::vector<std::thread> own;
  for (int64_t t = 1; t < threads; ++t) own.emplace_back([&work, &body] { work->run(body); });
  work->run(body);
  for (auto& th : own) th.join();
}

// The RHT (rht16, before rounding to the input dtype) of every column of a
// 16-row block v [16][width], in place: the same float32 operations as rht16,
// vectorized across the columns.
inline void rht_rows(float* __restrict v, int64_t width) {
  for (int i = 0; i < kBlock; ++i) {
    if (!((kRhtNegative >> i) & 1u)) continue;
    float* __restrict row = v + i * width;
    for (int64_t c = 0; c < width; ++c) row[c] = -row[c];
  }
  for (int h = 1; h < kBlock; h *= 2) {
    for (int i = 0; i < kBlock; ++i) {
      if (i & h) continue;
      float* __restrict lo = v + i * width;
      float* __restrict hi = v + (i + h) * width;
      for (int64_t c = 0; c < width; ++c) {
        const float a = lo[c], b = hi[c];
        lo[c] = a + b;
        hi[c] = a - b;
      }
    }
  }
  for (int64_t k = 0; k < kBlock * width; ++k) v[k] = v[k] * 0.25f;
}

}  // namespace nvfp4::cpu
