"""benchmarks.residuals: what one NVFP4 linear layer keeps for its backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import jax_nvfp4
from benchmarks.residuals import DENSE, columnwise_weight_copy, nbytes, residuals


def test_the_backward_pass_keeps_x_and_one_copy_of_w_quantized():
    """The residuals are x's columnwise copy (for wgrad) and W's rowwise 16x16-block copy (the forward GEMM's,
    transposed for dgrad), codes and E4M3 scales, with float32 global amaxes: no high-precision x or W, and no
    columnwise copy of W (issue 51), so 0.5625 bytes a value of x and W against bf16's 2."""
    m, k, n = shape = (64, 128, 96)
    key = jax.random.key(0)
    held = residuals(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, rng_key=key), shape)
    assert {str(a.dtype) for a in held} == {"uint8", "float8_e4m3fn", "float32"}, held
    codes = sorted(a.size for a in held if a.dtype == jnp.uint8)
    assert codes == sorted([m * k // 2, k * n // 2]), held  # one copy of each
    assert sorted(a.size for a in held if a.dtype == jnp.float8_e4m3fn) == sorted([m * k // 16, k * n // 16])
    assert all(a.size == 1 for a in held if a.dtype == jnp.float32)
    bf16 = residuals(lambda x, w: lax.dot_general(x, w, DENSE), shape)
    assert nbytes(bf16) == 2 * (m * k + k * n)
    assert nbytes(held) < 0.3 * nbytes(bf16)
    assert columnwise_weight_copy(shape) == k * n // 2 + k * n // 16  # what a second copy of W would add


def test_under_jax_checkpoint_the_backward_pass_keeps_x_and_w_quantized():
    """Rematerialized, the backward pass keeps the layer's input x (its quantizes are recomputed) and W's quantized
    copy, saved under every policy, in place of W itself: no weight quantize is recomputed."""
    m, k, n = shape = (64, 128, 96)
    key = jax.random.key(0)
    held = residuals(jax.checkpoint(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, rng_key=key)), shape)
    assert sorted((tuple(a.shape), str(a.dtype)) for a in held if a.size > 1) == sorted(
        [((m, k), "bfloat16"), ((1, n, k // 2), "uint8"), ((1, n, k // 16), "float8_e4m3fn")]
    ), held
