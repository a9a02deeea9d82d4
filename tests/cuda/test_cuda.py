"""CUDA kernels: the bytes of the CPU kernels, on every shape (runs only where JAX sees a GPU).

The rest of the suite also runs on a GPU backend (kernel == reference == golden
files there); these tests compare GPU and CPU results directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    COMBINATIONS,
    DTYPES,
    RECIPE_OPTIONS,
    assert_same_bytes,
    assert_same_tensor,
    assert_same_tree,
    kernel_options,
    option_quantize_cases,
    quantize_options,
    quantize_with_options,
    random_tensor,
    tensors,
)
from hypothesis import given
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.ops import KERNELS, ffi, grouped


def _devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


GPUS, CPU = _devices("gpu"), jax.devices("cpu")[0]
pytestmark = pytest.mark.skipif(not GPUS, reason="needs a GPU")


def on(device, fn, *args):
    """fn(*args) jitted and run on `device`, results fetched to the host."""
    args = jax.device_put(args, device)
    with jax.default_device(device):
        return jax.device_get(jax.jit(fn)(*args))


def test_the_cuda_kernels_are_registered():
    for op in ("amax", "quantize", "dequantize"):
        assert "cuda" in ffi.platforms_with(f"nvfp4_{op}")


@given(x=tensors(), opts=quantize_options)
def test_quantize_gpu_equals_cpu(x, opts):
    def quantize(x):
        return jax_nvfp4.quantize(x, **opts)

    assert_same_tensor(on(GPUS[0], quantize, x), on(CPU, quantize, x))


@given(x=tensors(), amax=st.sampled_from([0.0, 1e-30, 3.0, 1e30, np.inf, np.nan]), block_2d=st.booleans())
def test_quantize_with_given_amax_gpu_equals_cpu(x, amax, block_2d):
    def quantize(x, a):  # a traced amax: a NaN one is not refused (a concrete one would be)
        return jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d, amax=a)

    a = np.float32(amax)
    assert_same_tensor(on(GPUS[0], quantize, x, a), on(CPU, quantize, x, a))


@given(x=tensors(), out_dtype=st.sampled_from(DTYPES), block_2d=st.booleans())
def test_dequantize_and_amax_gpu_equal_cpu(x, out_dtype, block_2d):
    t = on(CPU, lambda x: jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d), x)

    def dequantize(t):
        return jax_nvfp4.dequantize(t, out_dtype), jax_nvfp4.dequantize(t, out_dtype, columnwise=True)

    for got, want in zip(on(GPUS[0], dequantize, t), on(CPU, dequantize, t), strict=True):
        assert_same_bytes(got, want)
    assert_same_bytes(on(GPUS[0], jax_nvfp4.amax, x), on(CPU, jax_nvfp4.amax, x))


@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 4100), (3, 17, 33), (16, 1), (1, 16), (2049, 7)])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_large_and_ragged_shapes(shape, dtype):
    x = random_tensor(np.random.default_rng(0), shape, dtype, spread=2.0, specials=("zero",), frac=0.01)
    for block_2d in (False, True):

        def quantize(x, block_2d=block_2d):
            return jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d)

        assert_same_tensor(on(GPUS[0], quantize, x), on(CPU, quantize, x))


@pytest.mark.parametrize("shape", [(64, 80), (2, 48, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", RECIPE_OPTIONS)
def test_rht_and_stochastic_rounding_gpu_equals_cpu(shape, dtype, name):
    """The same key and input give the same bytes on both (the transform's amax pass included)."""
    opts = dict(RECIPE_OPTIONS[name])
    stochastic = opts.pop("stochastic_rounding", False)
    rng = np.random.default_rng(3)
    x = jnp.asarray(random_tensor(rng, shape, dtype, spread=3, specials=("zero", "subnormal"), frac=0.05))

    def quantize(x):
        key = jax.random.key(11) if stochastic else None
        return jax_nvfp4.quantize(x, columnwise=True, rng_key=key, **opts)

    assert_same_tensor(on(GPUS[0], quantize, x), on(CPU, quantize, x))


def _kernel_quantize_with_options(opts: dict, scale=None):
    """x [B, M, N] -> (amax, amax_t, *quantize outputs) through the kernel backend, with these options."""
    return functools.partial(quantize_with_options(opts, scale), KERNELS)


@given(case=option_quantize_cases())
def test_row_scaled_and_4over6_gpu_equal_cpu(case):
    x, opts, scale = case
    run = _kernel_quantize_with_options(opts, scale)
    assert_same_tree(on(GPUS[0], run, x), on(CPU, run, x))


@pytest.mark.parametrize("layout,fos", COMBINATIONS)
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (2, 1000, 4100), (3, 17, 33), (1, 2049, 7), (1, 16, 1)])
def test_row_scaled_and_4over6_large_and_ragged_shapes(shape, layout, fos):
    x = random_tensor(np.random.default_rng(0), shape, ml_dtypes.bfloat16, spread=3.0, specials=("zero",), frac=0.01)
    run = _kernel_quantize_with_options(kernel_options(layout, fos))
    assert_same_tree(on(GPUS[0], run, x), on(CPU, run, x))


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (2, 1008, 4100), (3, 32, 33), (1, 16, 1)])
def test_row_scaled_amax_gpu_equals_cpu(shape, rht):
    x = random_tensor(np.random.default_rng(1), shape, np.float32, spread=6.0, specials=("nan", "inf"), frac=1e-4)

    def amax(x):
        return KERNELS.amax(x, amax_mesh_axes=None, rht_amax=rht, per_row=True)

    assert_same_tree(on(GPUS[0], amax, x), on(CPU, amax, x))


@pytest.mark.parametrize("e4m3_max", [448, 256])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_row_scaled_dequantize_gpu_equals_cpu(out_dtype, e4m3_max):
    x = random_tensor(np.random.default_rng(2), (2, 45, 67), np.float32, spread=4.0, specials=("zero",), frac=0.05)
    fos = ("mse", True, e4m3_max) if e4m3_max != 448 else None
    amax, amax_t, data, scale, data_t, scale_t = on(
        CPU, _kernel_quantize_with_options(kernel_options("row_scaled", fos)), x
    )

    def dequantize(data, scale, amax, data_t, scale_t, amax_t):
        return (
            KERNELS.dequantize(data, scale, amax, cols=67, dtype=out_dtype, e4m3_max=e4m3_max),
            KERNELS.dequantize(data_t, scale_t, amax_t, cols=45, dtype=out_dtype, e4m3_max=e4m3_max),
        )

    args = (data, scale, amax, data_t, scale_t, amax_t)
    assert_same_tree(on(GPUS[0], dequantize, *args), on(CPU, dequantize, *args))


GROUPED_SPECS = {
    "nearest": QuantizeSpec(columnwise=True),
    "stochastic row-scaled": QuantizeSpec(columnwise=True, stochastic_rounding=True, row_scaled=True),
    "4over6 fast": QuantizeSpec(columnwise=True, four_over_six_error="mse", four_over_six_fast_math=True, e4m3_max=256),
    "rht stochastic": QuantizeSpec(rowwise=False, columnwise=True, rht=True, stochastic_rounding=True),
}


@pytest.mark.parametrize("load", ["direct", "ring"])
@pytest.mark.parametrize("name", list(GROUPED_SPECS))
@pytest.mark.parametrize(
    ("shape", "dtype"), [((2, 48, 136), jnp.bfloat16), ((1, 304, 264), jnp.float16), ((1, 96, 600), jnp.float32)]
)
def test_grouped_quantize_gpu_equals_cpu(shape, dtype, name, load, monkeypatch):
    """The MoE grouped quantize (both kernels: element loads, and NVFP4_QUANTIZE_LOAD=ring's bulk copies, whose
    rows of whole 16-byte chunks these shapes have) on groups that cut blocks, leave blocks unowned and rows
    past the groups."""
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", load)
    spec = GROUPED_SPECS[name]
    rng = np.random.default_rng(len(name))
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    sizes = rng.integers(0, shape[1] // 3, (shape[0], 5)).astype(np.int32)

    def quantize(x, sizes):
        amax, amax_t = grouped.grouped_amax(x, sizes, rht_amax=spec.rht, per_row=spec.row_scaled)
        seeds = (jnp.array([7, 9], jnp.uint32), jnp.arange(10, dtype=jnp.uint32).reshape(5, 2))
        return grouped.grouped_quantize(x, sizes, amax, amax_t, *seeds, spec=spec)

    assert_same_tree(on(GPUS[0], quantize, x, sizes), on(CPU, quantize, x, sizes))


RING_SPECS = {
    "row+col": dict(columnwise=True),
    "16x16": dict(columnwise=True, block_2d=True),
    "row-scaled": dict(columnwise=True, row_scaled=True),
    "rht": dict(columnwise=True, rht=True),
    "stochastic": dict(columnwise=True, rng_key=jax.random.key(5)),
    "stochastic rht": dict(rowwise=False, columnwise=True, rht=True, rng_key=jax.random.key(6)),
    "4over6": dict(columnwise=True, four_over_six_error="mse", e4m3_max=256),
}


@pytest.mark.parametrize("name", list(RING_SPECS))
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((4096, 4096), jnp.bfloat16),
        ((3, 208, 520), jnp.float16),
        ((1008, 4104), jnp.bfloat16),
        ((1008, 2056), jnp.float32),  # its values read from the stage itself
    ],
)
@pytest.mark.parametrize("fill", ["ring", "ring-rows"])
def test_the_quantize_ring_gpu_equals_cpu(fill, shape, dtype, name, monkeypatch):
    """NVFP4_QUANTIZE_LOAD=ring's pipelined quantize (its stages filled by a tensor copy a tile through the input's
    tensor map, zeros past its edges; ring-rows: by a bulk copy a row; rows of whole 16-byte chunks, as these shapes
    have) on the GPU: the CPU kernels' bytes, on many tiles a block (the ring turns over), ragged tiles and batch
    entries. The host model checks its copies and waits on the CPU (tests/cuda/test_cuda_host_ring.py); this is
    the same check on a GPU's own tensor maps, copies and barriers."""
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", fill)
    options = RING_SPECS[name]
    x = (np.random.default_rng(len(name)).standard_normal(shape) * 3).astype(dtype)
    if fill == "ring":  # the tensor copies run: the driver encodes this input's map (else rows are copied)
        from jax_nvfp4_kernels import _nvfp4_cuda

        on_gpu = jax.device_put(x, GPUS[0])
        batch = int(np.prod(shape[:-2]))
        assert _nvfp4_cuda.quantize_tensor_map_encodes(
            on_gpu.unsafe_buffer_pointer(), batch, shape[-2], shape[-1], x.dtype.itemsize
        )
    quantize = functools.partial(jax_nvfp4.quantize, **options)
    assert_same_tree(on(GPUS[0], quantize, x), on(CPU, quantize, x))


def test_the_training_step_runs_on_the_gpu():
    x = jnp.asarray(
        random_tensor(np.random.default_rng(1), (256, 128), ml_dtypes.bfloat16, spread=1, specials=(), frac=0)
    )
    w = jnp.asarray(random_tensor(np.random.default_rng(2), (128, 64), np.float32, spread=1, specials=(), frac=0))

    def grads(x, w):
        # The full recipe: RHT on the wgrad operands and stochastic rounding of dy, the same bits on both.
        dot = functools.partial(jax_nvfp4.dot_general, rng_key=jax.random.key(7))
        return jax.grad(lambda x, w: jnp.sum(dot(x, w, (((1,), (0,)), ((), ())))), (0, 1))(x, w)

    for got, want in zip(on(GPUS[0], grads, x, w), on(CPU, grads, x, w), strict=True):
        # Quantized operands are identical; only the float32 accumulation order may differ.
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-3)
