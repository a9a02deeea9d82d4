"""The FFI kernels give the reference's bytes on random shapes, dtypes and values (the reference run by NumPy,
helpers.numpy_eval, where a drawn shape would otherwise compile it; under XLA on the large tensor)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from helpers import DTYPES, assert_same_bytes, assert_same_tensor, quantize_options, random_tensor, tensors
from helpers.numpy_eval import evaluate
from hypothesis import given
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import reference
from jax_nvfp4_kernels import _nvfp4_cpu


def quantize_both(x, **opts):
    """The kernels' quantize and the reference's (run by NumPy)."""
    got = jax.jit(lambda x: jax_nvfp4.quantize(x, **opts))(x)
    return got, evaluate(reference.quantize, x, **opts)


@given(tensors(), quantize_options)
def test_quantize_matches_reference(x, opts):
    got, want = quantize_both(x, **opts)
    assert_same_tensor(got, want)


@given(
    tensors(max_dim=40), quantize_options, st.sampled_from([0.0, 1e-3, 3.0, 1e30, 1e-38, np.inf, np.nan, -0.0, -2.0])
)
def test_quantize_with_given_amax_matches_reference(x, opts, amax):
    # An external amax (e.g. reduced over a mesh) may be smaller or larger than max|x|; a traced one is not
    # checked (a concrete NaN or negative one is refused: test_bad_input), and even a meaningless one gives the
    # same bytes.
    got = jax.jit(lambda x, a: jax_nvfp4.quantize(x, amax=a, **opts))(x, jnp.float32(amax))
    want = evaluate(lambda x, a: reference.quantize(x, amax=a, **opts), x, jnp.float32(amax))
    assert_same_tensor(got, want)


@given(tensors(), st.sampled_from(DTYPES), st.booleans())
def test_dequantize_matches_reference(x, out_dtype, block_2d):
    t = jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d)
    for columnwise in (False, True):
        got = jax.jit(lambda t, c=columnwise: jax_nvfp4.dequantize(t, out_dtype, columnwise=c))(t)
        want = evaluate(lambda t, c=columnwise: reference.dequantize(t, out_dtype, columnwise=c), t)
        assert_same_bytes(got, want)
        assert got.shape == x.shape


@given(tensors())
def test_amax_matches_reference(x):
    assert_same_bytes(jax.jit(jax_nvfp4.amax)(x), evaluate(reference.amax, x))


def test_kernels_run_as_custom_calls():
    x = jnp.ones((32, 48), jnp.bfloat16)
    hlo = jax.jit(lambda x: jax_nvfp4.dequantize(jax_nvfp4.quantize(x, columnwise=True))).lower(x).as_text()
    for target in ("nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize"):
        assert f'"{target}"' in hlo or f"@{target}" in hlo, target


def test_eager_matches_jit():
    x = random_tensor(np.random.default_rng(0), (48, 80), ml_dtypes.bfloat16, spread=3, specials=("zero",), frac=0.1)
    assert_same_tensor(jax_nvfp4.quantize(x, columnwise=True), quantize_both(x, columnwise=True)[0])


def test_large_tensor_uses_threads_and_matches_reference():
    # Big enough for the kernels' thread split; non-multiple-of-16 dims on both axes.
    x = random_tensor(np.random.default_rng(1), (1030, 1041), ml_dtypes.bfloat16, spread=4, specials=(), frac=0)
    for block_2d in (False, True):
        opts = dict(columnwise=True, block_2d=block_2d)
        got = jax.jit(lambda x, o=opts: jax_nvfp4.quantize(x, **o))(x)
        assert_same_tensor(got, jax.jit(lambda x, o=opts: reference.quantize(x, **o))(x))
    t = got
    assert_same_bytes(jax.jit(jax_nvfp4.dequantize)(t), jax.jit(reference.dequantize)(t))


def test_cpu_e2m1_encode_is_exhaustively_right():
    """The CPU loops' E2M1 encode (cpu/e2m1.h: three roundings, no compare chain) gives float_to_e2m1's code
    for every float32 bit pattern."""
    assert _nvfp4_cpu.e2m1_code_mismatches() == 0
