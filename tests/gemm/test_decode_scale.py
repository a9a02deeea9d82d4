"""The GEMMs' global decode scales (``ops.gemm.decode_scale``, from the dequantize op) against the reference's
exact division, and their product against the reference's exact multiply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes

from jax_nvfp4.core import bits
from jax_nvfp4.core.spec import GlobalScale
from jax_nvfp4.ops import gemm
from jax_nvfp4.reference import kernels

# Zero, the smallest subnormal, a subnormal scale's amax (below 2688 * 2^-126), normal, huge, inf, NaN.
SPECIAL_AMAX = np.array([0.0, 1e-45, 1e-40, 2e-35, 3e-30, 1.0, 2688.0, 1e30, 3.4e38, np.inf, np.nan], np.float32)


def _special_and_random_amaxes(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (np.exp(rng.uniform(-100, 88, shape)) * rng.uniform(1, 2, shape)).astype(np.float32)
    return np.where(rng.random(shape) < 0.3, rng.choice(SPECIAL_AMAX, shape), x)


@pytest.mark.parametrize("e4m3_max", [448, 256])
@pytest.mark.parametrize("shape", [(), (11,), (3, 11), (2, 3, 5)])
def test_decode_scale_is_the_exact_division(shape, e4m3_max):
    amax = _special_and_random_amaxes(shape) if shape != (11,) else SPECIAL_AMAX
    got = jax.jit(lambda a: gemm.decode_scale(a, GlobalScale(False, e4m3_max)))(amax)
    want = bits.from_bits(kernels.dequantize_scale(bits.to_bits(jnp.asarray(amax)), e4m3_max))
    assert got.shape == amax.shape
    assert_same_bytes(got, want)


def test_global_decode_scale_is_the_exact_product():
    a, c = _special_and_random_amaxes((64,), seed=1), _special_and_random_amaxes((64,), seed=2)
    a[:11], c[11:22] = SPECIAL_AMAX, SPECIAL_AMAX
    a[22:33], c[22:33] = 1e-17, 3e-18  # a product below float32's normal range
    got = jax.jit(gemm.global_decode_scale)(a, c)
    da, dc = (kernels.dequantize_scale(bits.to_bits(jnp.asarray(v)), 448) for v in (a, c))
    assert_same_bytes(got, bits.from_bits(bits.mul(da, dc)))
