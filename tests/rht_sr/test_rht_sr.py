"""The recipe's quantization options: Random Hadamard Transform, its amax estimate, stochastic rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    IMPLEMENTATIONS,
    SPECIAL_VALUES,
    assert_same_tensor,
    columnwise_as_rowwise,
    examples,
    random_tensor,
)
from helpers.numpy_eval import evaluate
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import reference


@settings(max_examples=examples(15))
@given(
    rows=st.sampled_from([16, 32, 48]),
    cols=st.integers(1, 40),
    dtype=st.sampled_from([ml_dtypes.bfloat16, np.float16, np.float32]),
    seed=st.integers(0, 2**31 - 1),
    estimate=st.sampled_from([None, 2.0]),
    stochastic=st.booleans(),
)
def test_kernels_give_the_reference_bytes(rows, cols, dtype, seed, estimate, stochastic):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(random_tensor(rng, (rows, cols), dtype, spread=3, specials=tuple(SPECIAL_VALUES), frac=0.05))
    key = jax.random.key(seed) if stochastic else None
    opts = dict(columnwise=True, rht=True, rht_amax_factor=estimate, rng_key=key)
    # The reference run by NumPy (helpers.numpy_eval): compiling it for each drawn shape took seconds.
    assert_same_tensor(jax_nvfp4.quantize(x, **opts), evaluate(reference.quantize, x, **opts))
    # Stochastic rounding alone, 1x16 and 16x16 blocks.
    for block_2d in (False, True):
        opts = dict(columnwise=True, block_2d=block_2d, rng_key=jax.random.key(seed))
        assert_same_tensor(jax_nvfp4.quantize(x, **opts), evaluate(reference.quantize, x, **opts))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_rht_copy_keeps_the_weight_gradient(impl):
    """The transform is orthogonal: dy^T x from two transformed copies is the plain product, to NVFP4 error."""
    q = IMPLEMENTATIONS[impl].quantize
    x = jax.random.normal(jax.random.key(0), (256, 64), jnp.float32)
    dy = jax.random.normal(jax.random.key(1), (256, 32), jnp.float32)
    x = x.at[3, 5].set(40.0)  # an outlier the transform spreads over its 16 rows
    tx, tdy = q(x, columnwise=True, rht=True), q(dy, columnwise=True, rht=True)
    assert tx.spec.rht and float(tx.amax_t) < float(tx.amax)

    got = np.asarray(jax_nvfp4.gemm(columnwise_as_rowwise(tdy), columnwise_as_rowwise(tx)))
    want = np.asarray(dy.T @ x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.15
    with pytest.raises(ValueError, match="Random Hadamard"):
        IMPLEMENTATIONS[impl].dequantize(tx, columnwise=True)


def test_rht_amax_estimate_is_the_amax_times_the_factor():
    x = jax.random.normal(jax.random.key(0), (64, 48), jnp.bfloat16)
    exact = jax_nvfp4.quantize(x, columnwise=True, rht=True)
    for factor in (1.0, 2.0, 4.0, 0.3):
        t = jax_nvfp4.quantize(x, columnwise=True, rht=True, rht_amax_factor=factor)
        assert np.float32(t.amax_t) == np.float32(t.amax) * np.float32(factor)
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(exact.data))  # the rowwise copy is unchanged
    # A chunk's transform is at most 4x its max, so the factor 4 never undershoots.
    assert float(exact.amax_t) <= 4 * float(exact.amax)


def test_rht_and_estimate_errors():
    x = jnp.ones((32, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="columnwise"):
        jax_nvfp4.quantize(x, rht=True)
    with pytest.raises(ValueError, match="1x16"):
        jax_nvfp4.quantize(x, columnwise=True, block_2d=True, rht=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        jax_nvfp4.quantize(jnp.ones((24, 32)), columnwise=True, rht=True)
    with pytest.raises(ValueError, match="only with rht"):
        jax_nvfp4.quantize(x, columnwise=True, rht_amax_factor=2.0)
    for bad in (0.0, -1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match="positive finite"):
            jax_nvfp4.quantize(x, columnwise=True, rht=True, rht_amax_factor=bad)
    with pytest.raises(TypeError, match="PRNG key"):
        jax_nvfp4.quantize(x, rng_key=jnp.zeros(3, jnp.uint32))


# Values between E2M1 grid points once scaled (amax 6 gives a unit block scale for blocks with max 6).
_BETWEEN = np.array([0.1, 0.3, 0.6, 0.9, 1.2, 1.4, 1.7, 2.2, 2.7, 3.3, 3.8, 4.5, 5.5, -0.7, -2.6, 6.0], np.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_stochastic_rounding_is_unbiased(impl):
    """The mean over many keys tends to the input; round-to-nearest stays off by its rounding error."""
    q = IMPLEMENTATIONS[impl]
    x = jnp.asarray(np.tile(_BETWEEN, (256, 1)))  # 256 rows, one block each
    keys = jax.random.split(jax.random.key(0), 16)
    # 16 keys x 256 rows = 4096 draws of each value; amax fixed so every draw has the same scales.
    deq = jax.vmap(lambda k: q.dequantize(q.quantize(x, amax=6.0, rng_key=k)))(keys)
    mean = np.asarray(deq).reshape(-1, 16).mean(axis=0)
    nearest = np.asarray(q.dequantize(q.quantize(x, amax=6.0)))[0]
    unit = np.float32(nearest[-1]) / 6.0  # the dequantized value of code step 1 (6.0 is on the grid)
    # A draw is one of the two neighbours `step` apart: its standard deviation is at most step / 2.
    step = np.select([np.abs(_BETWEEN) < 2, np.abs(_BETWEEN) < 4], [0.5, 1.0], 2.0) * unit
    bound = 5 * (step / 2) / np.sqrt(4096)
    assert np.all(np.abs(mean - _BETWEEN * unit) < bound), (mean, _BETWEEN * unit)
    assert np.all(np.abs(nearest - _BETWEEN * unit)[:-1] > bound[:-1])  # round-to-nearest misses every one


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_stochastic_rounding_is_a_function_of_the_key(impl):
    q = IMPLEMENTATIONS[impl].quantize
    x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)
    a = q(x, columnwise=True, rng_key=jax.random.key(1))
    b = q(x, columnwise=True, rng_key=jax.random.key(1))
    c = q(x, columnwise=True, rng_key=jax.random.key(2))
    assert_same_tensor(a, b)
    assert not np.array_equal(np.asarray(a.data), np.asarray(c.data))
    # Only codes move, by at most one grid step; scales and amax are round-to-nearest's.
    rtn = q(x, columnwise=True)
    np.testing.assert_array_equal(np.asarray(a.scale).view(np.uint8), np.asarray(rtn.scale).view(np.uint8))
    # Specials: values on the grid (0, +-6 after scaling, inf clamped to 6) never move; NaN gives code 0.
    special = jnp.asarray(np.array([[0.0, -0.0, 6.0, -6.0, np.inf, -np.inf, np.nan, 3.0] * 2], np.float32))
    for key in range(4):
        got = q(special, amax=6.0, rng_key=jax.random.key(key))
        want = q(special, amax=6.0)
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
