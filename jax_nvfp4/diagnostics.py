"""How well NVFP4 represents a GEMM operand: the statistics the diagnostics collect per layer and operand.

``quantization_stats(rows, spec)`` quantizes a 2-D operand (rows x the contracted axis, as the GEMM
sees it) with ``spec`` and measures, as float32 scalars::

  rel_error   ||dequantize(quantize(x)) - x|| / ||x|| (Frobenius; 0 for an all-zero x)
  underflow   the share of nonzero blocks whose decode scale, amax_block * E / amax (E the E4M3 range the
              spec aims at), is at most half the smallest E4M3 subnormal (2^-10): it rounds to 0, and
              the whole block with it
  saturated   the share of blocks whose decode scale exceeds E, i.e. whose amax exceeds the global one: only
              with a given amax (``amax=``) below max |x|; their largest values are clipped
  amax        max |x|
  zero        the share of nonzero values that quantize to 0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nvfp4.core.spec import QuantizeSpec

STATS = ("rel_error", "underflow", "saturated", "amax", "zero")
_E4M3_ZERO_BELOW = 2.0**-10  # half the smallest E4M3 subnormal (2^-9): scales up to it round to 0


def _block_amax(a: jax.Array, block_shape: tuple[int, int]) -> jax.Array:
    """|x| [M, K] -> the amax of each block of ``block_shape`` (r, c): [M/r, K/c] (1x16: [M, K/16]), zero-padded."""
    (r, c), (m, k) = block_shape, a.shape
    a = jnp.pad(a, ((0, -m % r), (0, -k % c)))
    return a.reshape(a.shape[0] // r, r, -1, c).max(axis=(1, 3))


def quantization_stats(
    rows: jax.Array, spec: QuantizeSpec, *, amax: jax.Array | None = None, rng_key: jax.Array | None = None
) -> dict[str, jax.Array]:
    """The statistics of quantizing ``rows`` [M, K] (its rowwise copy) with ``spec``; see the module docstring.

    ``amax``: a given global amax, as ``quantize`` takes one (by default ``max |rows|``, with which no block
    saturates)."""
    from jax_nvfp4 import dequantize, quantize  # the public pipeline (imported here: it imports this module's users)

    spec = spec.rowwise_only()
    if not spec.draws_random:
        rng_key = None
    elif rng_key is None:
        rng_key = jax.random.key(0)
    x = rows.astype(jnp.float32)
    t = quantize(rows, spec, amax=amax, rng_key=rng_key)
    back = dequantize(t)
    norm = jnp.linalg.norm(x)
    a = jnp.abs(x)
    amax = t.amax[..., None]  # the amax each block's scale was made from: [1], or [M, 1] per row
    blocks = _block_amax(a, spec.block_shape)
    scales = blocks * spec.e4m3_max / jnp.where(amax > 0, amax, 1.0)
    nonzero_blocks = blocks > 0
    share = lambda hits, among: jnp.sum(hits & among) / jnp.maximum(jnp.sum(among), 1)  # noqa: E731
    return {
        "rel_error": jnp.where(norm > 0, jnp.linalg.norm(back - x) / jnp.where(norm > 0, norm, 1.0), 0.0),
        "underflow": share(scales <= _E4M3_ZERO_BELOW, nonzero_blocks).astype(jnp.float32),
        "saturated": share(blocks > amax, nonzero_blocks).astype(jnp.float32),  # scale > E, without rounding
        "amax": jnp.max(a),
        "zero": share(back == 0, x != 0).astype(jnp.float32),
    }


__all__ = ["STATS", "quantization_stats"]
