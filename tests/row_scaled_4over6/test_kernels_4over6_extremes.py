"""The CPU kernels' 4over6 choice at extreme magnitudes gives the reference's bytes.

The CPU 1x16 choice computes the exact error's dequantized values fp32(fp32(q s amax) / 6E) from two
quotients per block and candidate, scaled by powers of two (cpu/four_over_six.h: exact_units), which is
exact only while every such value is a finite normal float; blocks outside that range take the
per-element formula. Values spread over many octaves and scaled to amaxes near float32's top (products
that overflow to an infinite error) and bottom (quotients that are subnormal) put blocks on both sides of
that range within one tensor, and on the per-element side the two formulas choose differently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SEED, assert_same_bytes, kernel_options, reference_quantize

from jax_nvfp4 import QuantizeSpec
from jax_nvfp4.ops import KERNELS

# Each batch entry's amax: near the top and the bottom of float32's normal range, and 1 (all blocks in range).
_AMAXES = [3e38, 1e37, 1e-30, 2e-36, 1.0]


def _entries(dtype) -> jax.Array:
    """One [64, 64] entry per amax of _AMAXES: values over +-8 octaves, scaled so that the entry's amax is it."""
    rng = np.random.default_rng(2024)
    wide = rng.standard_normal((len(_AMAXES), 64, 64)) * np.exp(rng.uniform(-8, 8, (len(_AMAXES), 64, 64)))
    wide *= np.asarray(_AMAXES)[:, None, None] / np.abs(wide).max(axis=(1, 2), keepdims=True)
    return jnp.asarray(wide.astype(np.float32), dtype)


@pytest.mark.parametrize("layout", ["1x16", "row_scaled"])
@pytest.mark.parametrize("fos", [("mae", False, 448), ("mse", False, 256), ("mse", True, 448)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_4over6_at_extreme_magnitudes(layout, fos, dtype):
    x = _entries(dtype)
    opts = kernel_options(layout, fos)
    amax, amax_t = jax.jit(lambda x: KERNELS.amax(x, amax_mesh_axes=None, rht_amax=False, per_row=True))(x)
    if layout != "row_scaled":  # one amax per entry, for both copies
        amax = amax_t = amax.max(axis=1)
    got = jax.jit(lambda x, a, at: KERNELS.quantize(x, a, at, SEED, spec=QuantizeSpec(**opts)))(x, amax, amax_t)
    want = reference_quantize(x, amax, amax_t, SEED, **opts)
    for name, g, w in zip(("data", "scale", "data_t", "scale_t"), got, want, strict=True):
        assert_same_bytes(g, w, name)
