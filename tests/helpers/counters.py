"""The host model's profiler (ffi/cuda/host/trace.h) from Python: what a GPU profiler would count for
each kernel launch of the CUDA kernels run on the CPU, read without a GPU.

``traced()`` collects the launches of the calls made inside it. Each launch has its code paths (how many
threads took each named path) and its memory access sites (``file:line``, global or shared, load or store)
with their warp-wide requests and the sectors (global) or wavefronts (shared) those requests took, against
the fewest the same bytes need: ``transactions / ideal`` is 1 for perfectly coalesced global accesses and
for shared accesses without bank conflicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator

import jax
import numpy as np

import jax_nvfp4
from helpers import cuda_host
from helpers.cuda_host import module


@dataclasses.dataclass(frozen=True)
class Site:
    """One access site's counters over a launch."""

    site: str  # file:line
    space: str  # "global" or "shared"
    access: str  # "load" or "store"
    size: int  # bytes a lane accesses
    requests: int  # warp-wide requests with an active lane
    transactions: int  # sectors (global) or wavefronts (shared)
    ideal: int  # the fewest sectors or wavefronts the same bytes need
    bytes: int  # bytes the active lanes accessed

    @property
    def file(self) -> str:
        return os.path.basename(self.site.rsplit(":", 1)[0])

    @property
    def per_request(self) -> float:
        return self.transactions / self.requests

    @property
    def excess(self) -> float:
        """Transactions over the fewest possible: 1.0 is coalesced (global) or conflict-free (shared)."""
        return self.transactions / self.ideal


@dataclasses.dataclass(frozen=True)
class Launch:
    """A traced kernel launch."""

    kernel: str
    paths: dict[str, int]
    sites: list[Site]

    def select(self, space: str, access: str | None = None, file: str | None = None, size: int | None = None):
        """The sites in ``space`` (of ``access``, in ``file``, of lane ``size`` bytes, where given)."""
        return [
            s
            for s in self.sites
            if s.space == space
            and (access is None or s.access == access)
            and (file is None or s.file == file)
            and (size is None or s.size == size)
        ]

    @staticmethod
    def total(sites: list[Site]) -> Site:
        """The sites' counters summed (as one site)."""
        return Site(
            "total",
            sites[0].space if sites else "",
            sites[0].access if sites else "",
            0,
            *(sum(getattr(s, f) for s in sites) for f in ("requests", "transactions", "ideal", "bytes")),
        )


@contextlib.contextmanager
def traced() -> Iterator[list[Launch]]:
    """Traces the CUDA host model's launches made inside; the list fills when the block ends."""
    launches: list[Launch] = []
    module.trace_start()
    try:
        yield launches
    finally:
        for t in module.trace_stop():
            launches.append(Launch(t["kernel"], dict(t["paths"]), [Site(**s) for s in t["sites"]]))


def run_traced(fn, *args) -> tuple:
    """``fn`` jitted and run on ``args``: (its result, the launches of the run; compiling happens before the
    trace, so kernels run at trace time, such as amax passes, are not in it)."""
    jitted = jax.jit(fn)
    jitted.lower(*args).compile()
    with traced() as launches:
        got = jax.block_until_ready(jitted(*args))
    return got, launches


def quantize_launches(x, sm: int = 90, **options) -> tuple:
    """``cuda_host.quantize(x, **options)`` run_traced on the emulated GPU ``sm``."""
    with cuda_host.emulating(sm):
        return run_traced(lambda x: cuda_host.quantize(x, **options), x)


def dequantize_launches(t, dtype) -> tuple:
    """``cuda_host.dequantize(t, dtype)`` run_traced."""
    return run_traced(lambda t: cuda_host.dequantize(t, dtype), t)


def grouped_quantize_launches(x, sizes, spec) -> tuple:
    """The grouped quantize kernels (``cuda_host.grouped_quantize``) of x [B, M, N] in groups ``sizes`` [B, G]
    run_traced, with the grouped amaxes of the CUDA kernel and fixed seeds."""
    amax, amax_t = cuda_host.grouped_amax(x, sizes)
    seeds = (np.array([7, 9], np.uint32), np.arange(2 * sizes.shape[1], dtype=np.uint32).reshape(-1, 2))
    return run_traced(functools.partial(cuda_host.grouped_quantize, spec=spec), x, sizes, amax, amax_t, *seeds)


def quantized_bytes(x, **options) -> int:
    """Bytes of the codes and scales ``jax_nvfp4.quantize(x, **options)`` gives (the quantize kernel's
    outputs: every byte it must write once)."""
    t = jax_nvfp4.quantize(x, **options)
    return sum(a.nbytes for a in (t.data, t.scale, t.data_t, t.scale_t) if a is not None)


def only(launches: list[Launch], kernel: str) -> Launch:
    """The one launch whose kernel name contains ``kernel``."""
    found = [launch for launch in launches if kernel in launch.kernel]
    assert len(found) == 1, [launch.kernel for launch in launches]
    return found[0]
