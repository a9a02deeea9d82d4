// Execution contexts of the host model's fibers: a stack and the registers to resume it with.
// On x86-64 a switch saves and restores only what the ABI requires a callee to keep (rbx, rbp,
// r12-r15, the stack pointer, MXCSR and the x87 control word), with no system call; elsewhere it
// falls back to ucontext, whose swapcontext also makes a signal-mask system call per switch.
#pragma once

#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace nvfp4::host {

struct Context {
  void* sp = nullptr;  // x86-64: the saved stack pointer, the registers above it
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
};

// Prepares `c` to start `entry` (which must never return) on the `size` bytes at `stack`, with
// the calling thread's floating-point control state.
void make_context(Context& c, char* stack, size_t size, void (*entry)());

// Saves the running context into `from` and resumes `to`; returns when `from` is resumed.
void switch_context(Context& from, const Context& to);

}  // namespace nvfp4::host
