"""The CUDA kernels on the CPU: a backend over ``_nvfp4_cuda_host``, the test-only build of the
CUDA FFI handlers over the host execution model (ffi/cuda/host; CMake option NVFP4_CUDA_HOST).

The handlers are registered for the CPU platform under ``cuda_host_<target>`` and called with the
operands and attributes the primitives pass the CPU and GPU kernels, so ``quantize``,
``dequantize`` and ``amax`` here are the public API running the CUDA kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import numpy as np
import pytest

from jax_nvfp4 import _frontend, primitives

try:
    from jax_nvfp4 import _nvfp4_cuda_host as module
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
        raise ImportError("jax_nvfp4._nvfp4_cuda_host is missing: build with -C cmake.define.NVFP4_CUDA_HOST=ON")
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(PREFIX + name, capsule, platform="cpu")


def _call(target: str, results, *operands, **attrs):
    _registered()
    types = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results]
    return jax.ffi.ffi_call(PREFIX + target, types)(*operands, **attrs)


def _amax(x, mesh_axes=None, rht: bool = False, row_scaled: bool = False) -> tuple:
    def bind(x3):
        results = primitives._amax_abstract(x3, mesh_axes=None, rht=rht, row_scaled=row_scaled)
        return _call("nvfp4_amax", results, x3, rht=rht, row_scaled=row_scaled)

    outs = primitives._amax_on_rows(bind, x, mesh_axes=mesh_axes, rht=rht, row_scaled=row_scaled)
    if row_scaled:
        return outs[0].reshape(x.shape[0], -1), outs[1]
    return tuple(outs)


def _quantize(x, amax, amax_t, seed, **params) -> tuple:
    params = primitives.quantize_p.defaults | params  # the options a caller may leave out
    if params["row_scaled"] and amax.ndim == 2:
        amax = amax.reshape(x.shape[:-1])

    def bind(x3, amax, amax_t, seed):
        results = primitives._quantize_abstract(x3, amax, amax_t, seed, **params)
        attrs = dict(params, four_over_six=np.int32(primitives.FOUR_OVER_SIX_CODES[params["four_over_six"]]))
        attrs["e4m3_max"] = np.int32(params["e4m3_max"])
        return _call("nvfp4_quantize", results, x3, amax, amax_t, seed, **attrs)

    return tuple(primitives._quantize_on_rows(bind, x, amax, amax_t, seed, **params))


def _dequantize(data, scale, amax, *, cols, dtype, e4m3_max=448):
    results = primitives._dequantize_abstract(data, scale, amax, cols=cols, dtype=dtype, e4m3_max=e4m3_max)
    return _call("nvfp4_dequantize", results, data, scale, amax, e4m3_max=np.int32(e4m3_max))[0]


BACKEND = _frontend.Backend(amax=_amax, quantize=_quantize, dequantize=_dequantize)
amax = _frontend.amax_fn(BACKEND)
quantize = _frontend.quantize_fn(BACKEND)
dequantize = _frontend.dequantize_fn(BACKEND)


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
    """Runs the sm-specific code paths of GPU ``sm`` (90: Hopper; 100: sm_100a's FP4 convert)."""
    _registered()
    before = module.emulated_sm()
    module.set_emulated_sm(sm)
    try:
        yield
    finally:
        module.set_emulated_sm(before)
