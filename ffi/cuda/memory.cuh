// Memory accesses and code paths that the host model's profiler counts (cuda/host/trace.h): on
// the GPU plain loads and stores (and nothing for a path); in the host model each also records
// its site, address and size, so a test can read the coalescing, bank conflicts, bytes and paths
// of a launch. Global (G) or shared (S); the _IF forms are predicated accesses (a lane with
// `ok` false issues the instruction but touches nothing; a load gives `fallback`).
#pragma once

#if defined(NVFP4_CUDA_HOST)
#include "cuda/host/runtime.h"
#include "cuda/host/trace.h"

#define NVFP4_TRACED_LOAD(space, p) \
  ::nvfp4::host::traced_load(NVFP4_HOST_SITE, ::nvfp4::host::Space::space, (p))
#define NVFP4_TRACED_LOAD_IF(space, ok, p, fallback) \
  ::nvfp4::host::traced_load_if(NVFP4_HOST_SITE, ::nvfp4::host::Space::space, (ok), (p), (fallback))
#define NVFP4_TRACED_STORE_IF(space, ok, p, v) \
  ::nvfp4::host::traced_store_if(NVFP4_HOST_SITE, ::nvfp4::host::Space::space, (ok), (p), (v))

// NVFP4_HERE names the call site for a helper that accesses memory for several callers (the
// _AT forms): the host model then counts each caller's accesses apart.
#define NVFP4_HERE NVFP4_HOST_SITE
#define NVFP4_LDS_AT(site, p) ::nvfp4::host::traced_load((site), ::nvfp4::host::Space::kShared, (p))
#define NVFP4_STG_IF_AT(site, ok, p, v) \
  ::nvfp4::host::traced_store_if((site), ::nvfp4::host::Space::kGlobal, (ok), (p), (v))

#define NVFP4_LDG(p) NVFP4_TRACED_LOAD(kGlobal, p)
#define NVFP4_LDS(p) NVFP4_TRACED_LOAD(kShared, p)
#define NVFP4_LDG_IF(ok, p, fallback) NVFP4_TRACED_LOAD_IF(kGlobal, ok, p, fallback)
#define NVFP4_LDS_IF(ok, p, fallback) NVFP4_TRACED_LOAD_IF(kShared, ok, p, fallback)
#define NVFP4_STG(p, v) NVFP4_TRACED_STORE_IF(kGlobal, true, p, v)
#define NVFP4_STS(p, v) NVFP4_TRACED_STORE_IF(kShared, true, p, v)
#define NVFP4_STG_IF(ok, p, v) NVFP4_TRACED_STORE_IF(kGlobal, ok, p, v)
// A named code path taken (counted per thread that takes it).
#define NVFP4_PATH(name) ::nvfp4::host::trace_path(name)

#else

#define NVFP4_HERE nullptr
#define NVFP4_LDS_AT(site, p) (*(p))
#define NVFP4_STG_IF_AT(site, ok, p, v) \
  do {                                  \
    if (ok) *(p) = (v);                 \
  } while (0)

#define NVFP4_LDG(p) (*(p))
#define NVFP4_LDS(p) (*(p))
#define NVFP4_LDG_IF(ok, p, fallback) ((ok) ? *(p) : (fallback))
#define NVFP4_LDS_IF(ok, p, fallback) ((ok) ? *(p) : (fallback))
#define NVFP4_STG(p, v) (void)(*(p) = (v))
#define NVFP4_STS(p, v) (void)(*(p) = (v))
#define NVFP4_STG_IF(ok, p, v) \
  do {                         \
    if (ok) *(p) = (v);        \
  } while (0)
#define NVFP4_PATH(name) ((void)0)

#endif
