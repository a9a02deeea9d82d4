"""The GEMM's oracles (float64 values of codes and scales, hand-built operands) and the dense problem whose
forward and backward GEMMs the dot_general tests check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_nvfp4

from .core import random_normal, unpack

# The 16 E2M1 code values (code 8 is -0).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def values64(data, scale, length: int) -> np.ndarray:
    """E2M1 * E4M3 of packed operands, in float64 (independent of the library)."""
    codes = unpack(data)[..., :length]
    scales = np.repeat(np.asarray(scale).view(np.uint8).view(ml_dtypes.float8_e4m3fn), 16, axis=-1)[..., :length]
    return E2M1[codes] * scales.astype(np.float64)


def tensor_of_codes(codes, scale_codes, amax, *, row_scaled=False, e4m3_max=448) -> jax_nvfp4.NVFP4Tensor:
    """A hand-built rowwise NVFP4Tensor from codes [R, K] and scale codes [R, K/16]: one amax, or one a row
    (``row_scaled``); E = ``e4m3_max`` (256: with 4over6)."""
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = jnp.asarray(scale_codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn))
    return jax_nvfp4.NVFP4Tensor(
        jnp.asarray(data), scale, jnp.asarray(amax, jnp.float32), None, None, None, codes.shape,
        jnp.dtype(jnp.bfloat16),
        spec=jax_nvfp4.QuantizeSpec(row_scaled=row_scaled, four_over_six_error="mse" if e4m3_max != 448 else None,
                                    e4m3_max=e4m3_max),
    )  # fmt: skip


# ---- dot_general on a dense layer's problem ----

DENSE = (((1,), (0,)), ((), ()))  # x [M, K] . W [K, N], as nn.Dense calls it


def dense_problem(m=48, k=64, n=32, dtype=jnp.bfloat16):
    """x [M, K], W [K, N] and dy [M, N]."""
    return random_normal((m, k), 0, dtype), random_normal((k, n), 1, dtype) * 0.1, random_normal((m, n), 2, dtype)


def dense_grads(dot, x, w, dy):
    """(y, dx, dW) of ``dot(x, w, DENSE)`` with the output gradient dy."""
    y, vjp = jax.vjp(lambda x, w: dot(x, w, DENSE), x, w)
    return (y, *vjp(dy.astype(y.dtype)))


def rel_err(got, want) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
