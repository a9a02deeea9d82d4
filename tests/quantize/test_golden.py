"""Byte-exact agreement with the golden files, for the kernels and the reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import GOLDEN_DIR, IMPLEMENTATIONS, assert_golden, cases, load, one_per_family, option_cases

from jax_nvfp4 import reference


def test_every_plain_and_rht_case_is_present():
    # 1D/2D random, padded and edge cases, and the RHT cases: the options this library covers.
    assert len(cases()) == 20
    assert sum(name.startswith("rht_") for name in cases()) == 2


def test_rht_transform_is_the_golden_one():
    """The reference's transform of x^T is the golden ``x_t_rht``, value for value."""
    from jax_nvfp4.core import bits

    # Jitted: op by op, the bit-level float emulation dispatches thousands of small ops.
    rht_columns = jax.jit(reference.rht_columns, static_argnums=1)
    for name in ("rht_128x256_bf16.npz", "rht_256x512_bf16.npz"):
        g, x, _ = load(name)
        got = rht_columns(bits.to_bits(x[None]), x.dtype)[0]
        np.testing.assert_array_equal(np.asarray(bits.from_bits(got)), g["x_t_rht"])


def test_every_row_scaled_and_4over6_case_is_present():
    names = option_cases()
    assert len(names) == 36
    families = ("rowscaled_", "4o6_1d_", "4o6_2d_", "4o6_rowscaled_", "4o6sel_1d_", "4o6sel_2d_")
    assert [sum(n.startswith(f) for n in names) for f in families] == [2, 8, 8, 2, 8, 8]


# The kernels take every golden file; the reference under XLA one or two of each family (every kind, dtype,
# 4over6 error and math): compiling its bit-level program for each file's shape was a minute of CI on two cores, and
# tests/quantize/test_numpy_eval.py holds the same program, run by NumPy, to every golden file.
GOLDEN_RUNS = [(name, "kernel") for name in cases() + option_cases()] + [
    (name, "reference") for name in one_per_family()
]


@pytest.mark.parametrize(("name", "impl"), GOLDEN_RUNS)
def test_golden(name, impl):
    """Golden files through the public quantize, kernels and reference, row-scaled and 4over6 included."""
    g, x, options = load(name)
    t = jax.jit(lambda x: IMPLEMENTATIONS[impl].quantize(x, **options))(x)
    assert_golden(g, options["columnwise"], t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t)


def test_rht_signs_are_the_golden_ones():
    from jax_nvfp4.core.formats import RHT_SIGNS

    h = np.load(GOLDEN_DIR / "hadamard16.npz")
    np.testing.assert_array_equal(h["sign"], np.array(RHT_SIGNS, np.float32))
    sylvester = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], np.float32)
    np.testing.assert_array_equal(h["transform"], np.diag(h["sign"]) @ sylvester / 4)
