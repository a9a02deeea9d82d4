"""The FFI kernels give the reference's bytes on random shapes, dtypes and values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from conftest import SPECIAL_VALUES, random_tensor
from hypothesis import given
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import reference

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
FIELDS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t")


@st.composite
def tensors(draw, max_dim: int = 70):
    rank = draw(st.integers(2, 4))
    lead = [draw(st.integers(1, 5)) for _ in range(rank - 2)]
    shape = (*lead, draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim)))
    dtype = draw(st.sampled_from(DTYPES))
    specials = tuple(draw(st.sets(st.sampled_from(sorted(SPECIAL_VALUES)))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 2.0, 12.0]))
    return random_tensor(rng, shape, dtype, spread=spread, specials=specials, frac=draw(st.sampled_from([0.01, 0.3])))


options = st.fixed_dictionaries(
    {
        "rowwise": st.booleans(),
        "columnwise": st.booleans(),
        "block_2d": st.booleans(),
    }
).filter(lambda o: o["rowwise"] or o["columnwise"])


def assert_same_bytes(a, b):
    """Exact equality of the tensors' raw bytes (NaN bit patterns included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes(), f"{np.sum(a.view(np.uint8) != b.view(np.uint8))} bytes differ"


def assert_same_tensor(t, u):
    meta = ("shape", "dtype", "block_2d", "rht", "row_scaled", "e4m3_max")
    assert [getattr(t, k) for k in meta] == [getattr(u, k) for k in meta]
    for name in FIELDS:
        a, b = getattr(t, name), getattr(u, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert_same_bytes(a, b)


def quantize_both(x, **opts):
    got = jax.jit(lambda x: jax_nvfp4.quantize(x, **opts))(x)
    want = jax.jit(lambda x: reference.quantize(x, **opts))(x)
    return got, want


@given(tensors(), options)
def test_quantize_matches_reference(x, opts):
    got, want = quantize_both(x, **opts)
    assert_same_tensor(got, want)


@given(tensors(max_dim=40), options, st.sampled_from([0.0, 1e-3, 3.0, 1e30, 1e-38, np.inf, np.nan, -0.0, -2.0]))
def test_quantize_with_given_amax_matches_reference(x, opts, amax):
    # An external amax (e.g. reduced over a mesh) may be smaller or larger than max|x|;
    # even a meaningless negative one gives the same bytes.
    got = jax.jit(lambda x: jax_nvfp4.quantize(x, amax=jnp.float32(amax), **opts))(x)
    want = jax.jit(lambda x: reference.quantize(x, amax=jnp.float32(amax), **opts))(x)
    assert_same_tensor(got, want)


@given(tensors(), st.sampled_from(DTYPES), st.booleans())
def test_dequantize_matches_reference(x, out_dtype, block_2d):
    t = jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d)
    for columnwise in (False, True):
        got = jax.jit(lambda t, c=columnwise: jax_nvfp4.dequantize(t, out_dtype, columnwise=c))(t)
        want = jax.jit(lambda t, c=columnwise: reference.dequantize(t, out_dtype, columnwise=c))(t)
        assert_same_bytes(got, want)
        assert got.shape == x.shape


@given(tensors())
def test_amax_matches_reference(x):
    assert_same_bytes(jax.jit(jax_nvfp4.amax)(x), jax.jit(reference.amax)(x))


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
        got, want = quantize_both(x, columnwise=True, block_2d=block_2d)
        assert_same_tensor(got, want)
    t = got
    assert_same_bytes(jax.jit(jax_nvfp4.dequantize)(t), jax.jit(reference.dequantize)(t))
