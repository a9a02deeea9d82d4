"""The NVFP4 GEMM, its three block sums (emulated, lax.scaled_dot, the fused Pallas GEMM): exact block
products, exact sums, float64 agreement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import random_tensor, tensor_of_codes, values64
from hypothesis import given
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4.ops.gemm import block_values

E4M3_FINITE = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)


def test_every_block_product_is_exact_in_bfloat16():
    """All 16 E2M1 values times every finite E4M3 scale: bf16 holds the product exactly."""
    codes = np.arange(16, dtype=np.uint8)
    data = np.tile(codes[0::2] | (codes[1::2] << 4), (1, E4M3_FINITE.size, 2))  # each row: codes 0..15 twice
    scale = jnp.asarray(E4M3_FINITE.view(ml_dtypes.float8_e4m3fn)[None, :, None].repeat(2, axis=2))
    got = np.asarray(jax.jit(block_values, static_argnums=2)(jnp.asarray(data), scale, 32))
    want = values64(data, scale, 32)
    np.testing.assert_array_equal(got.astype(np.float64), want)
    assert np.array_equal(np.signbit(got.astype(np.float32)), np.signbit(want))  # -0 stays -0


GEMM_IMPLS = pytest.mark.parametrize("impl", ["emulated", "scaled_dot", "cudnn", "fused"])


@GEMM_IMPLS
def test_sums_are_exact_when_float32_can_hold_them(impl):
    """Scales in [1, 2) and amax = 2688 (global scale 1): every partial sum fits in 24 bits."""
    rng = np.random.default_rng(0)
    m, n, k = 24, 40, 64
    codes_a, codes_c = rng.integers(0, 16, (m, k)), rng.integers(0, 16, (n, k))
    scales_a, scales_c = rng.integers(0x38, 0x40, (m, k // 16)), rng.integers(0x38, 0x40, (n, k // 16))
    a, c = tensor_of_codes(codes_a, scales_a, 2688.0), tensor_of_codes(codes_c, scales_c, 2688.0)
    got = np.asarray(jax_nvfp4.gemm(a, c, impl=impl))
    want = values64(a.data, a.scale, k) @ values64(c.data, c.scale, k).T
    np.testing.assert_array_equal(got, want)


@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.integers(1, 100),
    seed=st.integers(0, 2**32 - 1),
    out_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    impl=st.sampled_from(["emulated", "scaled_dot", "cudnn", "fused"]),
)
def test_gemm_is_the_float64_product_up_to_float32_accumulation(m, n, k, seed, out_dtype, impl):
    rng = np.random.default_rng(seed)
    x = random_tensor(rng, (m, k), ml_dtypes.bfloat16, spread=2, specials=("zero",), frac=0.05)
    w = random_tensor(rng, (n, k), ml_dtypes.bfloat16, spread=2, specials=("zero",), frac=0.05)
    a, c = jax_nvfp4.quantize(x), jax_nvfp4.quantize(w, block_2d=True)
    got = np.asarray(jax_nvfp4.gemm(a, c, out_dtype, impl=impl)).astype(np.float64)
    va, vc = values64(a.data, a.scale, k), values64(c.data, c.scale, k)
    gds = np.float32(np.float32(a.amax) / np.float32(2688)) * np.float64(np.float32(c.amax) / np.float32(2688))
    want = va @ vc.T * gds
    # Products are exact; each of k float32 additions, the scale product and the scaling round once.
    magnitude = (np.abs(va) @ np.abs(vc).T) * gds
    bound = (k + 3) * 2.0**-24 * magnitude
    if out_dtype == jnp.bfloat16:
        bound = bound + np.abs(want) * 2.0**-8
    assert (np.abs(got - want) <= bound).all()
    # The dequantized tensors give the same product: the global scales agree.
    deq = np.asarray(jax_nvfp4.dequantize(a)).astype(np.float64) @ np.asarray(jax_nvfp4.dequantize(c)).T
    assert (np.abs(deq - want) <= 2.0**-22 * magnitude).all()


@GEMM_IMPLS
def test_nan_and_inf_propagate(impl):
    x = np.ones((16, 32), np.float32)
    w = np.ones((8, 32), np.float32)
    x[3, 5] = np.nan
    y = np.asarray(jax_nvfp4.gemm(jax_nvfp4.quantize(x), jax_nvfp4.quantize(w), impl=impl))
    assert np.isnan(y).all()  # NaN amax: every scale is NaN
    x[3, 5] = np.inf
    y = np.asarray(jax_nvfp4.gemm(jax_nvfp4.quantize(x), jax_nvfp4.quantize(w), impl=impl))
    assert not np.isfinite(y).any()


def test_gemm_shapes_and_errors():
    x, w = np.ones((2, 3, 32), np.float32), np.ones((5, 32), np.float32)
    assert jax_nvfp4.gemm(jax_nvfp4.quantize(x), jax_nvfp4.quantize(w)).shape == (2, 3, 5)
    with pytest.raises(ValueError, match="contracting sizes differ"):
        jax_nvfp4.gemm(jax_nvfp4.quantize(x), jax_nvfp4.quantize(np.ones((5, 48), np.float32)))
    with pytest.raises(ValueError, match="rowwise copy"):
        jax_nvfp4.gemm(jax_nvfp4.quantize(x, rowwise=False, columnwise=True), jax_nvfp4.quantize(w))
