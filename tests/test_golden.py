"""Byte-exact agreement with the golden files, for the kernels and the reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from golden_files import GOLDEN_DIR, cases, load

import jax_nvfp4
from jax_nvfp4 import reference

IMPLEMENTATIONS = {"kernel": jax_nvfp4, "reference": reference}


def test_every_plain_and_rht_case_is_present():
    # 1D/2D random, padded and edge cases, and the RHT cases: the options this library covers.
    assert len(cases()) == 20
    assert sum(name.startswith("rht_") for name in cases()) == 2


def test_rht_transform_is_the_golden_one():
    """The reference's transform of x^T is the golden ``x_t_rht``, value for value."""
    from jax_nvfp4 import _bits

    for name in ("rht_128x256_bf16.npz", "rht_256x512_bf16.npz"):
        g, x, _ = load(name)
        got = reference.rht_columns(_bits.to_bits(x[None]), x.dtype)[0]
        np.testing.assert_array_equal(np.asarray(_bits.from_bits(got)), g["x_t_rht"])


def _bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", cases())
def test_golden(name, impl):
    g, x, options = load(name)
    t = jax.jit(lambda x: IMPLEMENTATIONS[impl].quantize(x, **options))(x)
    m, n = x.shape
    # The reference crops data to N//2 bytes and keeps padded scale rows; the
    # goldens all have even N, and padded 2D scale rows repeat the last block.
    np.testing.assert_array_equal(_bytes(t.data), g["data"])
    np.testing.assert_array_equal(_bytes(t.scale), g["scale"][:m])
    assert np.asarray(t.amax, np.float32).tobytes() == g["amax_row"].astype(np.float32).tobytes()
    if options["columnwise"]:
        np.testing.assert_array_equal(_bytes(t.data_t), g["data_t"])
        np.testing.assert_array_equal(_bytes(t.scale_t), g["scale_t"][:n])
        assert np.asarray(t.amax_t, np.float32).tobytes() == g["amax_col"].astype(np.float32).tobytes()


def test_rht_signs_are_the_golden_ones():
    from jax_nvfp4.formats import RHT_SIGNS

    h = np.load(GOLDEN_DIR / "hadamard16.npz")
    np.testing.assert_array_equal(h["sign"], np.array(RHT_SIGNS, np.float32))
    sylvester = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], np.float32)
    np.testing.assert_array_equal(h["transform"], np.diag(h["sign"]) @ sylvester / 4)
