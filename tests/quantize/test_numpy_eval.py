"""The reference run by NumPy (helpers.numpy_eval, which the property tests compare the kernels with) gives the
reference's bytes: every golden file (TransformerEngine's quantizer) and every stochastic-rounding vector, the
reference under XLA on fixed cases of every option, and XLA's semantics in the operations where NumPy's differ."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    SPECIAL_VALUES,
    assert_golden,
    assert_same_tree,
    assert_sr_vector,
    cases,
    load,
    load_sr,
    option_cases,
    random_tensor,
    sr_cases,
    sr_vector_run,
)
from helpers.numpy_eval import evaluate

from jax_nvfp4 import reference
from jax_nvfp4.reference.kernels import REFERENCE


@pytest.mark.parametrize("name", cases() + option_cases())
def test_golden_files(name):
    """Every golden file (test_golden runs the reference under XLA on one or two of each family)."""
    g, x, options = load(name)
    t = evaluate(reference.quantize, x, **options)
    assert_golden(g, options["columnwise"], t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t)


@pytest.mark.parametrize("name", sr_cases())
def test_stochastic_rounding_vectors(name):
    g, x, amax, amax_t, seed, spec = load_sr(name)
    assert_sr_vector(g, *evaluate(sr_vector_run(REFERENCE, spec), x, amax, amax_t, seed))


# One case of each option family the golden files lack or cover thinly, on values with every special.
OPTIONS = {
    "stochastic rht": dict(columnwise=True, rht=True, rng_key=jax.random.key(1)),
    "stochastic 16x16": dict(columnwise=True, block_2d=True, rng_key=jax.random.key(2)),
    "rht estimate": dict(columnwise=True, rht=True, rht_amax_factor=2.0),
    "4over6 fast row-scaled": dict(
        columnwise=True, row_scaled=True, four_over_six_error="mae", four_over_six_fast_math=True, e4m3_max=256
    ),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_reference_under_xla_gives_the_same_bytes(name):
    rng = np.random.default_rng(5)
    x = jnp.asarray(random_tensor(rng, (2, 32, 40), jnp.bfloat16, spread=6, specials=tuple(SPECIAL_VALUES), frac=0.1))
    options = OPTIONS[name]
    assert_same_tree(evaluate(reference.quantize, x, **options), jax.jit(lambda x: reference.quantize(x, **options))(x))


def test_where_numpy_and_xla_differ():
    """Shifts by the bit width or more, unsigned division by zero, leading zeros of 0, a gather's clamped index,
    a scan: as XLA computes them."""
    x = jnp.array([1, 0x80000000, 0xFFFFFFFF, 7], jnp.uint32)
    s = jnp.array([0, 31, 32, 200], jnp.uint32)
    table = jnp.arange(16, dtype=jnp.uint32) * 3
    index = jnp.array([-3, 0, 15, 40], jnp.int32)

    def ops(x, s, table, index):
        return (
            jax.lax.shift_left(x, s),
            jax.lax.shift_right_logical(x, s),
            jax.lax.div(x, s),
            jax.lax.clz(x >> s),
            jax.lax.clz(jax.lax.bitcast_convert_type(x, jnp.int32)),
            jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(x, jnp.int32), s.astype(jnp.int32)),
            table[jnp.clip(index, 0, 15)],
            jax.lax.scan(lambda c, v: (c * 3 + v, c ^ v), x[0], x)[1],
            jax.lax.cumsum(x),
        )

    assert_same_tree(evaluate(ops, x, s, table, index), jax.jit(ops)(x, s, table, index))
