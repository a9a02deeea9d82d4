// Fiber context switches for the host model (context.h).
#include "cuda/host/context.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
// nvfp4_host_switch(void** from_sp, void* to_sp): pushes the callee-saved registers and the FP
// control words, stores the stack pointer in *from_sp, loads to_sp and pops the same layout.
extern "C" void nvfp4_host_switch(void** from_sp, void* to_sp);
asm(R"(
  .text
  .globl nvfp4_host_switch
  .hidden nvfp4_host_switch
  .type nvfp4_host_switch, @function
nvfp4_host_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size nvfp4_host_switch, .-nvfp4_host_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace nvfp4::host {

#if defined(__x86_64__)

void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  // The frame nvfp4_host_switch pops, below a null return address that ends stack walks: the
  // FP control words, r15, r14, r13, r12, rbx, rbp (0), then `entry` as the return address, so
  // that entry starts with the stack aligned as after a call.
  auto top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;                                  // entry's own return address: none
  *--slot = reinterpret_cast<uint64_t>(entry);  // where nvfp4_host_switch returns to
  for (int i = 0; i < 6; ++i) *--slot = 0;      // rbp, rbx, r12-r15
  uint32_t mxcsr;
  uint16_t fpcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  uint64_t control = mxcsr | (uint64_t(fpcw) << 32);
  *--slot = control;
  c.sp = slot;
}

void switch_context(Context& from, const Context& to) { nvfp4_host_switch(&from.sp, to.sp); }

#else

void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
#if defined(__SANITIZE_ADDRESS__)
  // ASan's swapcontext clears the shadow of the target's uc_stack on every switch; the fiber
  // annotations tell it about each switch instead, and makecontext no longer needs the stack.
  c.uc.uc_stack.ss_sp = nullptr;
  c.uc.uc_stack.ss_size = 0;
#endif
}

void switch_context(Context& from, const Context& to) { swapcontext(&from.uc, &to.uc); }

#endif

}  // namespace nvfp4::host
