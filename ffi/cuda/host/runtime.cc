// The CUDA host execution model's scheduler: blocks on worker threads, each block's threads as
// fibers (context.h) on its worker, switched only at __syncthreads() and warp exchanges.
#include "cuda/host/runtime.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda/host/context.h"
#include "cuda/host/trace.h"
#include "nvfp4/subnormal_guard.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define NVFP4_HOST_ASAN 1
#endif

namespace nvfp4::host {

thread_local uint3 thread_idx, block_idx;
thread_local dim3 block_dim, grid_dim;

namespace {

thread_local cudaError_t last_error = cudaSuccess;
// What ended this thread's last failed launch: cudaGetErrorString's text for it.
thread_local std::string last_failure;

// A launch's outcome, shared by its workers: the first failure ends it.
struct LaunchState {
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string message;

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (failed.exchange(true)) return;
    message = what;  // the launch's error text (printing it too would clutter expected failures)
  }
};

// The stream handed to the handlers: any non-null value (the model never dereferences it).
CUstream_st* const kXlaStream = reinterpret_cast<CUstream_st*>(uintptr_t(0x5742));

std::mutex shared_limits_mutex;
// cudaFuncSetAttribute's MaxDynamicSharedMemorySize per kernel and emulated GPU (a GPU's function
// attributes are its own: each device is set apart).
std::map<std::pair<const void*, int>, size_t> shared_limits;

#if defined(NVFP4_HOST_ASAN)
constexpr size_t kStackBytes = 512 * 1024;  // ASan's redzones make frames larger
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif

// kExited: the thread function returned and the fiber is parked there (exit_thread): the next
// block resumes it, and it runs the thread function again on the same stack (and, under ASan, the
// same fake stack).
enum class State { kRunnable, kBarrier, kWarp, kMbarrier, kExited };

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kIdx:
      return "__shfl_sync";
    case WarpOp::kUp:
      return "__shfl_up_sync";
    case WarpOp::kDown:
      return "__shfl_down_sync";
    case WarpOp::kXor:
      return "__shfl_xor_sync";
    case WarpOp::kBallot:
      return "__ballot_sync";
    case WarpOp::kSync:
      return "__syncwarp";
  }
  return "?";
}

std::string hex(unsigned mask) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", mask);
  return buf;
}

struct Fiber {
  Context context;
  char* stack = nullptr;  // kStackBytes above a guard page
  State state = State::kRunnable;
  const char* site = nullptr;  // where it waits
  // Its warp exchange while in State::kWarp.
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  int lane_arg = 0, width = kWarpSize;
  uint64_t value = 0, result = 0;
  // Its mbarrier wait while in State::kMbarrier.
  Mbarrier* mbar = nullptr;
  uint32_t parity = 0;
#if defined(NVFP4_HOST_ASAN)
  void* fake_stack = nullptr;
#endif
};

// An asynchronous bulk copy into shared memory: issued in its mbarrier's phase `phase`. A tensor
// copy (`tensor`) gathers map's box at `origin` when it completes; a plain one copies src.
struct BulkCopy {
  unsigned char* dst;
  const unsigned char* src;
  uint32_t bytes;
  Mbarrier* bar;
  uint32_t phase;
  bool done;
  const char* site;
  bool tensor = false;
  TensorMap map{};
  std::array<int64_t, kMaxTensorRank> origin{};
};

// The box origin of a copy at `at` (map.rank coordinates) in all kMaxTensorRank dimensions.
std::array<int64_t, kMaxTensorRank> box_origin(const TensorMap& map, const int32_t* at) {
  std::array<int64_t, kMaxTensorRank> origin{};
  for (uint32_t d = 0; d < map.rank; ++d) origin[d] = at[d];
  return origin;
}

// Calls f(k, row, x, n) for each row k of map's box at `origin` (box[1] x box[2] rows; dimensions
// past the rank are 1): `row` is the tensor's first element of it inside the tensor, at element x
// of the box row, and n its elements inside; null (n 0) where the row lies outside the tensor.
template <typename F>
void for_each_box_row(const TensorMap& map, const std::array<int64_t, kMaxTensorRank>& origin,
                      F f) {
  const int64_t x0 = std::max<int64_t>(origin[0], 0);
  const int64_t x1 = std::min<int64_t>(origin[0] + map.box[0], int64_t(map.dims[0]));
  for (uint32_t z = 0; z < map.box[2]; ++z)
    for (uint32_t y = 0; y < map.box[1]; ++y) {
      const int64_t iy = origin[1] + y, iz = origin[2] + z;
      const bool inside =
          x1 > x0 && iy >= 0 && uint64_t(iy) < map.dims[1] && iz >= 0 && uint64_t(iz) < map.dims[2];
      const unsigned char* row = inside ? map.base + uint64_t(x0) * map.element_bytes +
                                              uint64_t(iy) * map.strides[1] +
                                              uint64_t(iz) * map.strides[2]
                                        : nullptr;
      f(z * map.box[1] + y, row, uint32_t(x0 - origin[0]), inside ? uint32_t(x1 - x0) : 0u);
    }
}

// The bytes of map's box at `origin` into dst (densely, innermost first), zeros outside the tensor.
void gather_box(unsigned char* dst, const TensorMap& map,
                const std::array<int64_t, kMaxTensorRank>& origin) {
  const uint32_t e = map.element_bytes, row_bytes = map.box[0] * e;
  for_each_box_row(map, origin, [&](uint32_t k, const unsigned char* row, uint32_t x, uint32_t n) {
    unsigned char* out = dst + size_t(k) * row_bytes;
    std::memset(out, 0, row_bytes);
    if (row != nullptr) std::memcpy(out + size_t(x) * e, row, size_t(n) * e);
  });
}

// One worker's block: its threads as fibers, run in turn until each waits or exits.
class Block {
 public:
  Block(const char* kernel, dim3 dims, const std::function<void()>& thread, LaunchState& state)
      : kernel_(kernel),
        dims_(dims),
        count_(int(dims.x * dims.y * dims.z)),
        thread_(thread),
        state_(state),
        fibers_(count_),
        arrived_((count_ + kWarpSize - 1) / kWarpSize),
        exited_((count_ + kWarpSize - 1) / kWarpSize) {
    for (Fiber& f : fibers_) {
      void* mem = mmap(nullptr, kStackBytes + kGuard, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (mem == MAP_FAILED) {
        std::perror("nvfp4 CUDA host model: mmap of a fiber stack");
        std::abort();
      }
      mprotect(mem, kGuard, PROT_NONE);  // a stack overflow faults instead of corrupting memory
      f.stack = static_cast<char*>(mem) + kGuard;
    }
#if defined(NVFP4_HOST_ASAN)
    pthread_attr_t attr;
    pthread_getattr_np(pthread_self(), &attr);
    pthread_attr_getstack(&attr, &main_stack_, &main_stack_size_);
    pthread_attr_destroy(&attr);
#endif
  }
  ~Block() {
#if defined(NVFP4_HOST_ASAN)
    // A parked fiber's fake stack is ASan's to free, from the fiber's last switch (leave).
    finishing_ = true;
    for (int t = 0; t < count_; ++t)
      if (fibers_[t].state == State::kExited) switch_to(t);
#endif
    for (Fiber& f : fibers_) {
#if defined(NVFP4_HOST_ASAN)
      ASAN_UNPOISON_MEMORY_REGION(f.stack,
                                  kStackBytes);  // a failed block leaves its frames poisoned
#endif
      munmap(f.stack - kGuard, kStackBytes + kGuard);
    }
  }

  // Runs every thread of block `index` to its end; false if the block failed (see fail).
  bool run(uint3 index) {
    index_ = index;
    block_idx = index;
    exited_count_ = barrier_waiting_ = 0;
    copies_.clear();
    seen_.assign(size_t(count_), {});
    std::fill(arrived_.begin(), arrived_.end(), 0u);
    std::fill(exited_.begin(), exited_.end(), 0u);
    for (Fiber& f : fibers_) {
      if (f.state != State::kExited)  // a parked one resumes in exit_thread
        make_context(f.context, f.stack, kStackBytes, &Block::entry);
      f.state = State::kRunnable;
    }
    current_ = -1;
    failed_ = false;
    while (exited_count_ < count_ && !failed_) {
      const int next = next_runnable(-1);
      if (next < 0) {
        diagnose_deadlock();
        break;
      }
      switch_to(next);  // returns when no thread is runnable, all exited, or one failed
    }
    for (const auto& [at, c] : copies_)
      if (!failed_ && !c.done)
        fail(-1, std::string("the block exits with an asynchronous copy in flight (issued at ") +
                     c.site + "): nothing waited on its mbarrier");
    return !failed_;
  }

  // ---- mbarriers and bulk copies (runtime.h) ----

  void mbarrier_init(Mbarrier* bar, uint32_t arrivals, const char* site) {
    if (arrivals == 0)
      fail(current_, std::string("mbarrier init at ") + site + " with an arrival count of 0");
    for (const auto& [at, c] : copies_)
      if (c.bar == bar && !c.done)
        fail(current_, std::string("mbarrier init at ") + site +
                           " while a copy on it is in flight (issued at " + c.site + ")");
    *bar = Mbarrier{0, arrivals, int32_t(arrivals), 0};
    for (auto& seen : seen_) std::erase_if(seen, [&](const auto& e) { return e.first == bar; });
  }

  void arrive_expect_tx(Mbarrier* bar, uint32_t bytes, const char* site) {
    if (bar->pending <= 0 || bar->arrivals == 0)
      fail(current_, std::string("mbarrier arrive at ") + site +
                         " on an mbarrier never initialized or with no arrival pending");
    bar->tx += bytes;
    --bar->pending;
    settle(bar, site);
  }

  void bulk_load(void* dst, const void* src, uint32_t bytes, Mbarrier* bar, const char* site) {
    auto* d = static_cast<unsigned char*>(dst);
    if (bytes == 0 || bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 ||
        reinterpret_cast<uintptr_t>(src) % 16)
      fail(current_, std::string("bulk copy at ") + site + " of " + std::to_string(bytes) +
                         " bytes: the size and both addresses must be multiples of 16");
    for (auto it = overlapping(d); it != copies_.end() && it->first < d + bytes;) {
      if (!it->second.done)
        fail(current_, std::string("bulk copy at ") + site +
                           " into bytes another copy in flight writes (issued at " +
                           it->second.site + ")");
      it = copies_.erase(it);  // a completed copy's bytes, now rewritten
    }
    std::memset(d, kInFlight, bytes);
    copies_.emplace(d, BulkCopy{d, static_cast<const unsigned char*>(src), bytes, bar, bar->phase,
                                false, site});
  }

  void tensor_load(void* dst, const TensorMap* map, const int32_t* at, Mbarrier* bar,
                   const char* site) {
    if (!map->encoded)
      fail(current_, std::string("tensor copy at ") + site + " through a map never encoded");
    if (reinterpret_cast<uintptr_t>(dst) % 128)
      fail(current_, std::string("tensor copy at ") + site +
                         ": its shared-memory destination must be 128-byte aligned");
    const uint32_t bytes = map->element_bytes * map->box[0] * map->box[1] * map->box[2];
    bulk_load(dst, map->base, bytes, bar, site);  // the same checks and in-flight bytes
    BulkCopy& c = copies_.at(static_cast<unsigned char*>(dst));
    c.tensor = true;
    c.map = *map;
    c.origin = box_origin(*map, at);
  }

  void mbarrier_wait(Mbarrier* bar, uint32_t parity, const char* site) {
    const int t = current_;
    for (;;) {
      // Done before its copies land where the phase asked for is an earlier one (a wrong parity):
      // the reads that follow then find the copies in flight.
      if ((bar->phase & 1u) != (parity & 1u)) break;
      if (in_flight(bar)) {
        complete_copies(bar, site);
        continue;
      }
      Fiber& me = fibers_[t];
      me.state = State::kMbarrier;
      me.site = site;
      me.mbar = bar;
      me.parity = parity;
      yield();
    }
    auto& seen = seen_[t];
    auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& e) { return e.first == bar; });
    if (it == seen.end())
      seen.emplace_back(bar, bar->phase);
    else
      it->second = bar->phase;
  }

  void check_shared_access(const void* p, size_t bytes, bool store, const char* site) {
    if (copies_.empty()) return;
    const auto* a = static_cast<const unsigned char*>(p);
    for (auto it = overlapping(a); it != copies_.end() && it->first < a + bytes; ++it) {
      const BulkCopy& c = it->second;
      const std::string what = std::string(store ? "shared store" : "shared load") + " at " + site +
                               " of bytes a bulk copy (issued at " + c.site + ") writes";
      if (!c.done) fail(current_, what + " while it is in flight");
      if (!store && seen_phase(current_, c.bar) <= c.phase)
        fail(current_, what + ", before this thread waited on its mbarrier");
    }
  }

  static Block*& active() {
    static thread_local Block* block = nullptr;
    return block;
  }

  void syncthreads(const char* site) {
    Fiber& me = fibers_[current_];
    me.state = State::kBarrier;
    me.site = site;
    if (++barrier_waiting_ == count_) {
      for (int t = 0; t < count_; ++t) {
        if (std::strcmp(fibers_[t].site, site) != 0)
          fail(current_, std::string("__syncthreads() at ") + site + " meets thread " +
                             std::to_string(t) + "'s __syncthreads() at " + fibers_[t].site);
        fibers_[t].state = State::kRunnable;
      }
      barrier_waiting_ = 0;
      return;  // the last thread to arrive goes on
    }
    yield();
  }

  uint64_t warp_exchange(const char* site, WarpOp op, unsigned mask, uint64_t value, int lane_arg,
                         int width) {
    const int t = current_, warp = t / kWarpSize, lane = t % kWarpSize;
    const int lanes = std::min(kWarpSize, count_ - warp * kWarpSize);  // the warp's threads
    auto call = [&] {
      return std::string(op_name(op)) + " at " + site + " with mask " + hex(mask);
    };
    if (!(mask >> lane & 1u))
      fail(t, call() + ": the mask leaves out the calling lane " + std::to_string(lane));
    if (lanes < kWarpSize && (mask >> lanes) != 0)
      fail(t, call() + ": the mask names lanes the warp does not have (it has " +
                  std::to_string(lanes) + ")");
    if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0)
      fail(t, call() + ": width " + std::to_string(width) + " is not a power of 2 up to 32");
    if (const unsigned gone = mask & exited_[warp]; gone != 0)
      fail(t, call() + ": lane " + std::to_string(__builtin_ctz(gone)) +
                  " named in the mask has exited");
    Fiber& me = fibers_[t];
    me.state = State::kWarp;
    me.site = site;
    me.op = op;
    me.mask = mask;
    me.value = value;
    me.lane_arg = lane_arg;
    me.width = width;
    arrived_[warp] |= 1u << lane;
    if (complete(warp)) {
      me.state = State::kRunnable;
      return me.result;
    }
    yield();
    return me.result;
  }

  // The current thread's function returned: its fiber parks until the next block resumes it (or,
  // under ASan, the block's destructor, to end it).
  void exit_thread() {
    fibers_[current_].state = State::kExited;
    exited_[current_ / kWarpSize] |= 1u << (current_ % kWarpSize);
    ++exited_count_;
    switch_to(next_runnable(current_));
#if defined(NVFP4_HOST_ASAN)
    if (finishing_) leave(-1);
#endif
  }

  // Thread t did what a GPU would hang or corrupt on: the launch fails with this message (the
  // kernel's error), the block's fibers are abandoned where they wait, and from a fiber control
  // goes straight back to the worker (no return).
  void fail(int t, const std::string& what) {
    char head[256];
    if (t < 0)  // the block as a whole
      std::snprintf(head, sizeof(head),
                    "nvfp4 CUDA host model: kernel %s, block (%u, %u, %u): ", kernel_, index_.x,
                    index_.y, index_.z);
    else
      std::snprintf(
          head, sizeof(head),
          "nvfp4 CUDA host model: kernel %s, block (%u, %u, %u), thread %d (warp %d, lane %d): ",
          kernel_, index_.x, index_.y, index_.z, t, t / kWarpSize, t % kWarpSize);
    state_.fail(head + what);
    failed_ = true;
    if (current_ >= 0) leave(-1);
  }

 private:
  static constexpr size_t kGuard = 4096;

  // A fiber's life: the thread function of each block the worker runs (exit_thread parks it in
  // between), until the block fails or is destroyed.
  static void entry() {
    Block* b = active();
#if defined(NVFP4_HOST_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    for (;;) {
      b->thread_();
      b->exit_thread();
    }
  }

  // Sets the built-in variables for thread t, about to run.
  void enter(int t) {
    current_ = t;
    thread_idx = uint3{unsigned(t) % dims_.x, unsigned(t) / dims_.x % dims_.y,
                       unsigned(t) / (dims_.x * dims_.y)};
  }

  // The next runnable thread after `after`; if none, a thread waiting on an mbarrier that can
  // make progress (its copies complete when it runs) is woken.
  int next_runnable(int after) {
    for (int k = 1; k <= count_; ++k) {
      const int t = (after + k + count_) % count_;
      if (fibers_[t].state == State::kRunnable) return t;
    }
    for (int k = 1; k <= count_; ++k) {
      const int t = (after + k + count_) % count_;
      Fiber& f = fibers_[t];
      if (f.state == State::kMbarrier && (in_flight(f.mbar) || (f.mbar->phase & 1u) != f.parity)) {
        f.state = State::kRunnable;
        return t;
      }
    }
    return -1;
  }

  // The copies that may overlap [p, ...): from the last one starting at or before p.
  std::map<const unsigned char*, BulkCopy>::iterator overlapping(const unsigned char* p) {
    auto it = copies_.upper_bound(p);
    if (it != copies_.begin()) {
      auto before = std::prev(it);
      if (before->first + before->second.bytes > p) return before;
    }
    return it;
  }

  bool in_flight(const Mbarrier* bar) const {
    for (const auto& [at, c] : copies_)
      if (c.bar == bar && !c.done) return true;
    return false;
  }

  // Completes the copies in flight on bar (their bytes land), then its phase if it is due.
  void complete_copies(Mbarrier* bar, const char* site) {
    for (auto& [at, c] : copies_) {
      if (c.bar != bar || c.done) continue;
      if (c.tensor)
        gather_box(c.dst, c.map, c.origin);
      else
        std::memcpy(c.dst, c.src, c.bytes);
      c.done = true;
      bar->tx -= c.bytes;
    }
    settle(bar, site);
  }

  // Ends bar's phase where no arrival and no byte is pending.
  void settle(Mbarrier* bar, const char* site) {
    if (bar->tx < 0)
      fail(current_, std::string("mbarrier at ") + site +
                         ": its copies completed more bytes than expect_tx announced");
    if (bar->pending == 0 && bar->tx == 0) {
      ++bar->phase;
      bar->pending = int32_t(bar->arrivals);
    }
  }

  // The phases of bar thread t has waited for.
  uint32_t seen_phase(int t, const Mbarrier* bar) const {
    for (const auto& [b, phase] : seen_[size_t(t)])
      if (b == bar) return phase;
    return 0;
  }

  // Fiber t's context, or the worker's when t < 0.
  Context& context_of(int t) { return t < 0 ? main_ : fibers_[t].context; }

#if defined(NVFP4_HOST_ASAN)
  // Tells ASan that the running context switches to t's stack (the worker's when t < 0), saving
  // its fake stack in *fake_stack, or freeing it when fake_stack is null (a context that ends).
  void start_switch(void** fake_stack, int t) const {
    if (t < 0)
      __sanitizer_start_switch_fiber(fake_stack, main_stack_, main_stack_size_);
    else
      __sanitizer_start_switch_fiber(fake_stack, fibers_[t].stack, kStackBytes);
  }
#endif

  // Makes t (the worker when t < 0) the running context.
  void set_current(int t) {
    if (t < 0)
      current_ = -1;
    else
      enter(t);
  }

  // Switches from the current context (a fiber, or the worker when current_ < 0) to fiber `to`,
  // or to the worker when `to` < 0; returns when the current context is resumed.
  void switch_to(int to) {
    const int from = current_;
#if defined(NVFP4_HOST_ASAN)
    void** fake = from < 0 ? &main_fake_stack_ : &fibers_[from].fake_stack;
    start_switch(fake, to);
#endif
    set_current(to);
    switch_context(context_of(from), context_of(to));
#if defined(NVFP4_HOST_ASAN)
    __sanitizer_finish_switch_fiber(*fake, nullptr, nullptr);
#endif
    if (from >= 0) enter(from);  // resumed
  }

  // The current fiber ends (it failed, or ~Block ends a parked one) and `to` runs (the worker when
  // `to` < 0); its state goes to discarded_, never resumed. Does not return.
  void leave(int to) {
#if defined(NVFP4_HOST_ASAN)
    start_switch(nullptr, to);  // ASan frees this fiber's fake stack
#endif
    set_current(to);
    switch_context(discarded_, context_of(to));
  }

  // The current fiber waits: another runnable one runs, or the worker (deadlock check) takes over.
  void yield() { switch_to(next_runnable(current_)); }

  // Completes the exchange of the current lane's mask if every lane it names waits at it.
  bool complete(int warp) {
    Fiber* lanes = &fibers_[warp * kWarpSize];
    const Fiber& me = fibers_[current_];
    if ((arrived_[warp] & me.mask) != me.mask) return false;  // some lane is not at an exchange
    for (int l = 0; l < kWarpSize; ++l) {
      if (!(me.mask >> l & 1u)) continue;
      const Fiber& f = lanes[l];
      if (f.mask != me.mask || f.op != me.op ||
          (f.site != me.site && std::strcmp(f.site, me.site) != 0))
        return false;  // at another exchange: a deadlock, if it stays so
      if (f.width != me.width)
        fail(current_,
             std::string(op_name(me.op)) + " at " + me.site + ": lanes pass different widths");
    }
    uint64_t ballot = 0;
    for (int l = 0; l < kWarpSize; ++l)
      if ((me.mask >> l & 1u) && lanes[l].value != 0) ballot |= uint64_t(1) << l;
    for (int l = 0; l < kWarpSize; ++l) {
      if (!(me.mask >> l & 1u)) continue;
      Fiber& f = lanes[l];
      if (me.op == WarpOp::kBallot) {
        f.result = ballot;
      } else if (me.op != WarpOp::kSync) {
        const int src = source_lane(me.op, l, f.lane_arg, f.width);
        if (!(me.mask >> src & 1u))
          fail(warp * kWarpSize + l, std::string(op_name(me.op)) + " at " + me.site +
                                         " with mask " + hex(me.mask) + ": reads lane " +
                                         std::to_string(src) + ", which the mask leaves out");
        f.result = lanes[src].value;
      }
      f.state = State::kRunnable;
    }
    arrived_[warp] &= ~me.mask;
    return true;
  }

  // The lane whose value `lane` receives, as the CUDA programming guide defines each shuffle
  // (a source outside the lane's width-segment gives the lane its own value).
  static int source_lane(WarpOp op, int lane, int arg, int width) {
    const int base = lane & ~(width - 1), offset = lane & (width - 1);
    switch (op) {
      case WarpOp::kIdx:
        return base + (arg & (width - 1));
      case WarpOp::kUp:
        return offset - arg < 0 || arg < 0 ? lane : lane - arg;
      case WarpOp::kDown:
        return offset + arg >= width || arg < 0 ? lane : lane + arg;
      case WarpOp::kXor: {
        const int src = lane ^ arg;  // a later segment gives the own value, an earlier one is read
        return src >= base + width || src >= kWarpSize ? lane : src;
      }
      default:
        return lane;
    }
  }

  std::string where(int t) const {
    const Fiber& f = fibers_[t];
    switch (f.state) {
      case State::kExited:
        return "it exited";
      case State::kBarrier:
        return std::string("it waits at __syncthreads() at ") + f.site;
      case State::kWarp:
        return std::string("it waits at ") + op_name(f.op) + " at " + f.site + " with mask " +
               hex(f.mask);
      case State::kMbarrier:
        return std::string("it waits on an mbarrier at ") + f.site;
      default:
        return "it runs";
    }
  }

  // No thread can run and some have not exited: fail on the first waiting thread, saying why it
  // waits forever.
  void diagnose_deadlock() {
    for (int t = 0; t < count_; ++t) {
      const Fiber& f = fibers_[t];
      if (f.state == State::kMbarrier)
        return fail(t, "mbarrier wait at " + std::string(f.site) + " for the phase of parity " +
                           std::to_string(f.parity) + " never ends: the mbarrier is in phase " +
                           std::to_string(f.mbar->phase) + " with " +
                           std::to_string(f.mbar->pending) + " arrival(s) and " +
                           std::to_string(f.mbar->tx) + " byte(s) pending");
      if (f.state == State::kBarrier) {
        for (int u = 0; u < count_; ++u)
          if (fibers_[u].state != State::kBarrier)
            return fail(t, std::string("__syncthreads() at ") + f.site +
                               " is never reached by thread " + std::to_string(u) + ": " +
                               where(u));
      }
      if (f.state == State::kWarp) {
        const int warp = t / kWarpSize;
        for (int l = 0; l < kWarpSize; ++l) {
          const Fiber& g = fibers_[warp * kWarpSize + l];
          if ((f.mask >> l & 1u) && (g.state != State::kWarp || g.mask != f.mask || g.op != f.op ||
                                     std::strcmp(g.site, f.site) != 0))
            return fail(t,
                        std::string(op_name(f.op)) + " at " + f.site + " with mask " + hex(f.mask) +
                            ": lane " + std::to_string(l) +
                            " named in the mask does not arrive: " + where(warp * kWarpSize + l));
        }
      }
    }
    fail(0, "no thread can run");
  }

  const char* kernel_;
  dim3 dims_;
  int count_;
  const std::function<void()>& thread_;
  LaunchState& state_;
  std::vector<Fiber> fibers_;
  Context main_;
  // Where a fiber that ends or fails saves its state, never resumed. Not a local: under ASan the
  // fiber's locals live on its fake stack, which ASan frees as the fiber's last switch begins.
  Context discarded_;
  uint3 index_{0, 0, 0};
  int current_ = -1, exited_count_ = 0, barrier_waiting_ = 0;
  // Per warp, the lanes waiting at a warp exchange and the lanes that exited.
  std::vector<unsigned> arrived_, exited_;
  // Bulk copies by destination (in flight, or completed and not yet overwritten), and per thread
  // the phases of each mbarrier it has waited for.
  std::map<const unsigned char*, BulkCopy> copies_;
  std::vector<std::vector<std::pair<const Mbarrier*, uint32_t>>> seen_;
  bool failed_ = false;
#if defined(NVFP4_HOST_ASAN)
  bool finishing_ = false;  // ~Block resumes the parked fibers only to end them
  void* main_fake_stack_ = nullptr;
  void* main_stack_ = nullptr;
  size_t main_stack_size_ = 0;
#endif
};

Block& active_block(const char* what) {
  Block* b = Block::active();
  if (b == nullptr) {
    std::fprintf(stderr, "nvfp4 CUDA host model: %s called outside a kernel\n", what);
    std::abort();
  }
  return *b;
}

cudaError_t check_config(const void* kernel, dim3 grid, dim3 block, size_t shared) {
  const unsigned g[3] = {grid.x, grid.y, grid.z}, b[3] = {block.x, block.y, block.z};
  for (int i = 0; i < 3; ++i)
    if (g[i] == 0 || b[i] == 0 || g[i] > kMaxGridDim[i] || b[i] > kMaxBlockDim[i])
      return cudaErrorInvalidConfiguration;
  if (uint64_t(block.x) * block.y * block.z > kMaxThreadsPerBlock)
    return cudaErrorInvalidConfiguration;
  size_t limit = kDefaultDynamicShared;
  {
    std::lock_guard<std::mutex> lock(shared_limits_mutex);
    if (auto it = shared_limits.find({kernel, emulated_sm()}); it != shared_limits.end())
      limit = it->second;
  }
  return shared > limit ? cudaErrorInvalidValue : cudaSuccess;
}

// A launch or memset on the default stream is a bug here: XLA passes the stream to use.
cudaError_t check_stream(cudaStream_t stream, const std::string& what) {
  if (stream != nullptr) return cudaSuccess;
  last_failure =
      "nvfp4 CUDA host model: " + what + ": on the default stream; use the stream XLA passes";
  return last_error = cudaErrorLaunchFailure;
}

}  // namespace

void set_emulated_sm(int value) { emulated_sm_value.store(value); }
cudaStream_t xla_stream() { return kXlaStream; }

namespace {
// The block's dynamic shared memory: `shared_size` bytes from `shared_base`, 128-byte aligned in
// `shared_storage` as the kernels declare it (cuda/common.cuh; tensor copies land there).
thread_local std::vector<unsigned char> shared_storage;
thread_local unsigned char* shared_base = nullptr;
thread_local size_t shared_size = 0;

void reset_dynamic_shared(size_t bytes) {
  shared_storage.assign(bytes + 128, 0xA5);  // garbage, as a kernel finds it on a GPU
  const uintptr_t at = reinterpret_cast<uintptr_t>(shared_storage.data());
  shared_base = shared_storage.data() + (128 - at % 128) % 128;
  shared_size = bytes;
}
}  // namespace

unsigned char* dynamic_shared() { return shared_base; }
size_t dynamic_shared_size() { return shared_size; }

int blocks_per_multiprocessor(int threads, size_t shared) {
  constexpr size_t kSharedPerMultiprocessor = 228 * 1024, kReserved = 1024, kStatic = 48 * 1024;
  const int by_threads = 2048 / std::max(threads, 1);
  const int by_shared = int(kSharedPerMultiprocessor / (shared + kStatic + kReserved));
  return std::max(0, std::min({32, by_threads, by_shared}));
}

size_t max_shared_per_block() { return emulated_sm() >= 120 ? 99 * 1024 : 227 * 1024; }

// The model does not see a kernel's static shared memory: it holds the dynamic bytes alone to the
// opt-in maximum (the driver: both together; the kernels check that themselves).
cudaError_t set_max_dynamic_shared(const void* kernel, size_t bytes) {
  if (bytes > max_shared_per_block()) return last_error = cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(shared_limits_mutex);
  shared_limits[{kernel, emulated_sm()}] = bytes;
  return cudaSuccess;
}

cudaError_t launch(const std::string& name, const void* kernel, dim3 grid, dim3 block,
                   size_t shared, cudaStream_t stream, const std::function<void()>& thread) {
  const char* kernel_name = name.c_str();
  if (cudaError_t e = check_stream(stream, "kernel " + name); e != cudaSuccess) return e;
  if (cudaError_t e = check_config(kernel, grid, block, shared); e != cudaSuccess)
    return last_error = e;
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  // Workers: NVFP4_CUDA_HOST_THREADS, else one per core; blocks go to them in turn.
  unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  if (const char* env = std::getenv("NVFP4_CUDA_HOST_THREADS"))
    workers = unsigned(std::max(1, std::atoi(env)));
  workers = unsigned(std::min<uint64_t>(workers, blocks));
  std::atomic<uint64_t> next{0};
  LaunchState state;
  LaunchTrace* trace = trace_launch_begin(name);  // null unless tracing (trace.h)
  auto work = [&] {
    const SubnormalGuard
        ieee;  // the GPU kernels keep subnormals (nvcc -ftz=false); fibers inherit it
    block_dim = block;
    grid_dim = grid;
    reset_dynamic_shared(shared);
    Block b(kernel_name, block, thread, state);
    Block::active() = &b;
    trace_worker_begin(trace, int(block.x * block.y * block.z));
    for (uint64_t i; !state.failed && (i = next.fetch_add(1)) < blocks;) {
      const uint3 index{unsigned(i % grid.x), unsigned(i / grid.x % grid.y),
                        unsigned(i / (uint64_t(grid.x) * grid.y))};
      if (!b.run(index)) break;
      trace_block_end();
    }
    trace_worker_end();
    Block::active() = nullptr;
  };
  if (workers == 1) {
    work();
  } else {
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < workers; ++w) pool.emplace_back(work);
    for (std::thread& t : pool) t.join();
  }
  trace_launch_end(trace, !state.failed);
  if (!state.failed) return cudaSuccess;
  last_failure = state.message;
  return last_error = cudaErrorLaunchFailure;
}

uint64_t warp_exchange(const char* site, WarpOp op, unsigned mask, uint64_t value, int lane_arg,
                       int width) {
  return active_block(op_name(op)).warp_exchange(site, op, mask, value, lane_arg, width);
}

void syncthreads(const char* site) { active_block("__syncthreads()").syncthreads(site); }

const char* caller_site(const char* file, int line) {
  static std::mutex mutex;
  static std::set<std::string> sites;  // never erased: the pointers stay valid
  std::lock_guard<std::mutex> lock(mutex);
  return sites.insert(std::string(file) + ":" + std::to_string(line)).first->c_str();
}

void mbarrier_init(Mbarrier* bar, uint32_t arrivals, const char* site) {
  active_block("mbarrier init").mbarrier_init(bar, arrivals, site);
}
void mbarrier_arrive_expect_tx(Mbarrier* bar, uint32_t bytes, const char* site) {
  active_block("mbarrier arrive").arrive_expect_tx(bar, bytes, site);
}
void bulk_load(void* dst, const void* src, uint32_t bytes, Mbarrier* bar, const char* site) {
  active_block("bulk copy").bulk_load(dst, src, bytes, bar, site);
  trace_access(site, Space::kGlobal, Access::kLoad, src, bytes, true);
}
void mbarrier_wait(Mbarrier* bar, uint32_t parity, const char* site) {
  active_block("mbarrier wait").mbarrier_wait(bar, parity, site);
}

namespace {
std::atomic<uint64_t> encodes{0};  // encode_tensor_map's calls
}  // namespace
uint64_t tensor_map_encodes() { return encodes.load(); }

std::string encode_tensor_map(TensorMap* map, const void* base, uint32_t rank,
                              uint32_t element_bytes, const uint64_t* dims, const uint64_t* strides,
                              const uint32_t* box) {
  ++encodes;
  *map = TensorMap{};
  if (rank == 0 || rank > kMaxTensorRank) return "a rank the model does not take";
  if (reinterpret_cast<uintptr_t>(base) % 16) return "the base is not 16-byte aligned";
  map->base = static_cast<const unsigned char*>(base);
  map->rank = rank;
  map->element_bytes = element_bytes;
  map->strides[0] = element_bytes;
  for (uint32_t d = rank; d < kMaxTensorRank; ++d) map->dims[d] = map->box[d] = 1;
  for (uint32_t d = 0; d < rank; ++d) {
    if (dims[d] == 0 || dims[d] > (uint64_t(1) << 32)) return "a dimension outside 1..2^32";
    if (box[d] == 0 || box[d] > 256) return "a box size outside 1..256";
    if (d > 0) {
      const uint64_t stride = strides[d - 1];
      if (stride % 16 || stride >= (uint64_t(1) << 40))
        return "a stride not a multiple of 16 below 2^40";
      if (stride < dims[d - 1] * map->strides[d - 1])
        return "a stride below the extent of the dimension under it";
      map->strides[d] = stride;
    }
    map->dims[d] = dims[d];
    map->box[d] = box[d];
  }
  if (box[0] * element_bytes % 16) return "the box's innermost size is not a multiple of 16 bytes";
  map->encoded = true;
  return "";
}

void tensor_load(void* dst, const TensorMap* map, const int32_t* at, Mbarrier* bar,
                 const char* site) {
  active_block("tensor copy").tensor_load(dst, map, at, bar, site);
  // What the copy reads of the tensor, row by row of the box (the profiler's global sectors).
  for_each_box_row(
      *map, box_origin(*map, at), [&](uint32_t, const unsigned char* row, uint32_t, uint32_t n) {
        if (row != nullptr)
          trace_access(site, Space::kGlobal, Access::kLoad, row, n * map->element_bytes, true);
      });
}

void check_shared_access(const void* p, size_t bytes, bool store, const char* site) {
  if (Block* b = Block::active()) b->check_shared_access(p, bytes, store, site);
}

std::string kernel_name(const char* pretty_function) {
  // GCC: "... [with auto Kernel = name<...>; Args = ...]"; clang: "... [Kernel = &name<...>, Args =
  // ...]".
  const std::string s = pretty_function;
  size_t begin = s.find("Kernel = ");
  if (begin == std::string::npos) return s;
  begin += std::strlen("Kernel = ");
  if (s[begin] == '&') ++begin;
  int depth = 0;
  for (size_t i = begin; i < s.size(); ++i) {
    depth += s[i] == '<' ? 1 : s[i] == '>' ? -1 : 0;
    if (depth == 0 && (s[i] == ';' || s[i] == ',' || s[i] == ']'))
      return s.substr(begin, i - begin);
  }
  return s.substr(begin);
}

}  // namespace nvfp4::host

cudaError_t cudaGetLastError() {
  const cudaError_t e = nvfp4::host::last_error;
  nvfp4::host::last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:  // the model's own text: kernel, block, thread and cause
      return nvfp4::host::last_failure.empty() ? "unspecified launch failure"
                                               : nvfp4::host::last_failure.c_str();
  }
  return "unknown error";
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  if (cudaError_t e = nvfp4::host::check_stream(stream, "cudaMemsetAsync"); e != cudaSuccess)
    return e;
  if (ptr == nullptr && bytes > 0) return nvfp4::host::last_error = cudaErrorInvalidValue;
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidValue;
  if (attr == cudaDevAttrMultiProcessorCount) {
    *value = nvfp4::host::kMultiprocessors;
  } else if (attr == cudaDevAttrMaxSharedMemoryPerBlockOptin) {
    *value = int(nvfp4::host::max_shared_per_block());
  } else if (attr == cudaDevAttrMaxSharedMemoryPerMultiprocessor) {
    *value = int(nvfp4::host::max_shared_per_block() + 1024);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
