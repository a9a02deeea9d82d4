"""MXFP8 (OCP Microscaling, as TransformerEngine's MXFP8 recipe uses it): E4M3 values, one E8M0 scale, a power of
two, per 32 consecutive values along the contracted axis.

**The scale.** A block with max magnitude a gets the exponent e = ceil(log2(a / 448)): the smallest power of two
with 2^e * 448 >= a, so that no value saturates. It is computed exactly from a's bits (a = 1.m * 2^E: e = E - 8, one
more where 1.m > 1.75), clamped below at -127 (a = 0, and a below 448 * 2^-127); its E8M0 byte is e + 127, and 0xFF
(NaN) for a block that holds NaN or inf. TransformerEngine computes the exponent of fp32(a / 448) rounded up where
its mantissa is nonzero: the same e, since no float32 a lies close enough above 448 * 2^j for the quotient to round
down to 2^j (the next float above 448 * 2^j is 2^-21 / 7 above it, the quotient's half step 2^-24).

**The values.** fp32(x * 2^-e), exact (a power of two, never above 448), rounded to E4M3 by XLA's convert (to
nearest, ties to even). A block with NaN or inf holds NaN scale and dequantizes to NaN. XLA on the CPU treats
float32 subnormals as zero (inputs below 2^-126 and products below it): a block whose amax is below 2^-126 then
quantizes to zero there, where a GPU keeps its values.

**Dequantized** values v * 2^e are exact in bfloat16 wherever 2^e >= 2^-117 (every E4M3 value times it a normal
bfloat16: at most 4 significant bits), which the GEMM multiplies with float32 accumulation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

MX_BLOCK = 32
"""Values per MXFP8 block (one E8M0 scale)."""

E4M3_MAX = 448.0
_E8M0_BIAS = 127
_E8M0_NAN = 0xFF


class MXArray(NamedTuple):
    """A tensor in MXFP8 along one axis: ``values`` float8_e4m3fn in the tensor's layout (that axis padded with
    zeros to whole blocks of 32) and ``scales`` uint8 of the same shape but that axis divided by 32 (E8M0 bytes:
    the exponent plus 127, 0xFF NaN)."""

    values: jax.Array
    scales: jax.Array


def scale_exponents(amax: jax.Array) -> jax.Array:
    """The E8M0 bytes (uint8) of blocks with max magnitudes ``amax`` (float32, >= 0 or NaN): see the module."""
    bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
    field = (bits >> 23).astype(jnp.int32)
    up = ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)  # 1.m > 1.75 = 448 / 2^8
    e = jnp.where(field == 0, -_E8M0_BIAS, jnp.maximum(field - _E8M0_BIAS - 8 + up, -_E8M0_BIAS))
    return jnp.where(field == 0xFF, _E8M0_NAN, e + _E8M0_BIAS).astype(jnp.uint8)


def _pow2(biased: jax.Array) -> jax.Array:
    """2^(b - 127) as float32 for biased exponents b in [1, 254] (normal floats)."""
    return lax.bitcast_convert_type(biased.astype(jnp.uint32) << 23, jnp.float32)


def _blocked(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """``shape`` with ``axis`` split into (blocks, 32)."""
    return (*shape[:axis], shape[axis] // MX_BLOCK, MX_BLOCK, *shape[axis + 1 :])


def quantize(x: jax.Array, axis: int = -1) -> MXArray:
    """``x`` (bfloat16, float16 or float32) in MXFP8 along ``axis`` (zero-padded to whole blocks there), in its own
    layout: blocks along any axis without a transpose."""
    axis = axis % x.ndim
    pad = -x.shape[axis] % MX_BLOCK
    if pad:
        x = jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)])
    blocks = x.reshape(_blocked(x.shape, axis))
    # |x| and its max are exact in the input's dtype (XLA's max keeps NaN).
    scales = scale_exponents(jnp.max(jnp.abs(blocks), axis=axis + 1).astype(jnp.float32))
    # 2^-e = 2^(127 - b) for b = e + 127 in [0, 247], biased 254 - b; the NaN scale's block dequantizes to NaN
    # whatever its values.
    inverse = _pow2(254 - jnp.minimum(scales, 253).astype(jnp.int32))
    values = (blocks.astype(jnp.float32) * jnp.expand_dims(inverse, axis + 1)).astype(jnp.float8_e4m3fn)
    return MXArray(values.reshape(x.shape), scales)


def dequantize(t: MXArray, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """The values of an ``MXArray`` quantized along ``axis`` in ``dtype``: v * 2^e, NaN where the scale is NaN.

    Computed as (v / 2) * 2^(e + 1), both factors exact and 2^(e + 1) a normal float32 for every e."""
    axis = axis % t.values.ndim
    v = t.values.astype(jnp.float32).reshape(_blocked(t.values.shape, axis))
    scale = jnp.expand_dims(_pow2(jnp.minimum(t.scales, 253).astype(jnp.int32) + 1), axis + 1)
    out = jnp.where(jnp.expand_dims(t.scales == _E8M0_NAN, axis + 1), jnp.nan, (v * 0.5) * scale)
    return out.reshape(t.values.shape).astype(dtype)


__all__ = ["E4M3_MAX", "MX_BLOCK", "MXArray", "dequantize", "quantize", "scale_exponents"]
