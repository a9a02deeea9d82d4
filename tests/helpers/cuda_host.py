"""The CUDA kernels on the CPU: a backend over ``_nvfp4_cuda_host``, the test-only build of the
CUDA FFI handlers over the host execution model (ffi/cuda/host; CMake option NVFP4_CUDA_HOST).

The handlers are registered for the CPU platform under ``cuda_host_<target>`` and called with the
operands and attributes the primitives pass the CPU and GPU kernels (each op's abstract evaluation and
FFI attributes, from its file in ``jax_nvfp4.ops``), so ``quantize``,
``dequantize`` and ``amax`` here are the public API running the CUDA kernels; ``grouped_amax`` and
``grouped_quantize`` call the grouped kernels as ``jax_nvfp4.ops.grouped``'s do.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import pytest

from jax_nvfp4.core import pipeline
from jax_nvfp4.core.backend import Backend, amax_on_rows, quantize_on_rows
from jax_nvfp4.ops import amax as amax_op
from jax_nvfp4.ops import dequantize as dequantize_op
from jax_nvfp4.ops import grouped as grouped_op
from jax_nvfp4.ops import quantize as quantize_op

try:
    from jax_nvfp4_kernels import _nvfp4_cuda_host as module
except ImportError:
    module = None

PREFIX = "cuda_host_"
# The model runs a launch's blocks on NVFP4_CUDA_HOST_THREADS threads (default: one per core).
# Under pytest-xdist every core already runs a test process, so one thread a launch; the tests of
# atomics across blocks ask for more (``threads``).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("NVFP4_CUDA_HOST_THREADS", "1")
# CI builds the module and sets this, so that a build without it fails instead of skipping.
REQUIRED = os.environ.get("NVFP4_EXPECT_CUDA_HOST_MODULE") == "1"
needs_module = pytest.mark.skipif(
    module is None and not REQUIRED, reason="built without the CUDA host model (-C cmake.define.NVFP4_CUDA_HOST=ON)"
)


@functools.cache
def _registered() -> None:
    if module is None:
        raise ImportError("jax_nvfp4_kernels._nvfp4_cuda_host is missing: build with NVFP4_CUDA_HOST=ON")
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(PREFIX + name, capsule, platform="cpu")


def _call(target: str, results, *operands, **attrs):
    _registered()
    types = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results]
    return jax.ffi.ffi_call(PREFIX + target, types)(*operands, **attrs)


def _amax(x, **params) -> tuple:
    def bind(x3, **params):
        results = amax_op.abstract(x3, **params)
        return _call("nvfp4_amax", results, x3, **amax_op.amax_p.ffi_attrs(**params))

    return amax_on_rows(bind)(x, **params)


def _quantize(x, amax, amax_t, seed, *, spec) -> tuple:
    def bind(x3, amax, amax_t, seed, *, spec):
        results = quantize_op.abstract(x3, amax, amax_t, seed, spec=spec)
        return _call("nvfp4_quantize", results, x3, amax, amax_t, seed, **spec.kernel_attrs())

    return quantize_on_rows(bind)(x, amax, amax_t, seed, spec=spec)


def _dequantize(data, scale, amax, **params):
    results = dequantize_op.abstract(data, scale, amax, **params)
    return _call("nvfp4_dequantize", results, data, scale, amax, **dequantize_op.dequantize_p.ffi_attrs(**params))[0]


def grouped_amax(x, group_sizes, *, rht_amax: bool = False, per_row: bool = False) -> tuple:
    """The CUDA kernel of ``ops.grouped.grouped_amax``: (amax, amax_t) of x [B, M, N] in groups [B, G]."""
    params = dict(rht_amax=rht_amax, per_row=per_row)
    results = grouped_op.amax_abstract(x, group_sizes, **params)
    return tuple(_call("nvfp4_grouped_amax", results, x, group_sizes, **grouped_op.grouped_amax_p.ffi_attrs(**params)))


def grouped_quantize(x, group_sizes, amax, amax_t, seed, group_seeds, *, spec) -> tuple:
    """The CUDA kernel of ``ops.grouped.grouped_quantize``: the rowwise copy (if ``spec.rowwise``), the grouped one."""
    operands = (x, group_sizes, amax, amax_t, seed, group_seeds)
    results = grouped_op.quantize_abstract(*operands, spec=spec)
    return tuple(
        _call("nvfp4_grouped_quantize", results, *operands, **grouped_op.grouped_quantize_p.ffi_attrs(spec=spec))
    )


BACKEND = Backend(amax=_amax, quantize=_quantize, dequantize=_dequantize)
amax = pipeline.amax_fn(BACKEND)
quantize = pipeline.quantize_fn(BACKEND)
dequantize = pipeline.dequantize_fn(BACKEND)


@contextlib.contextmanager
def threads(n: int):
    """Launches run their blocks on ``n`` threads (atomics across blocks then race for real)."""
    before = os.environ.get("NVFP4_CUDA_HOST_THREADS")
    os.environ["NVFP4_CUDA_HOST_THREADS"] = str(n)
    try:
        yield
    finally:
        if before is None:
            del os.environ["NVFP4_CUDA_HOST_THREADS"]
        else:
            os.environ["NVFP4_CUDA_HOST_THREADS"] = before


@contextlib.contextmanager
def emulating(sm: int):
    """Runs the sm-specific code paths and shared-memory limit of GPU ``sm`` (90: Hopper; 100: sm_100a's
    FP4 convert; 120: consumer Blackwell's convert and 99 KB a block)."""
    _registered()
    before = module.emulated_sm()
    module.set_emulated_sm(sm)
    try:
        yield
    finally:
        module.set_emulated_sm(before)
