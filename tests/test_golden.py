"""Byte-exact agreement with the golden files, for the kernels and the reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from golden_files import cases, load

import jax_nvfp4
from jax_nvfp4 import reference

IMPLEMENTATIONS = {"kernel": jax_nvfp4, "reference": reference}


def test_every_plain_case_is_present():
    # 1D/2D random, padded and edge cases: the options this library covers.
    assert len(cases()) == 18


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
