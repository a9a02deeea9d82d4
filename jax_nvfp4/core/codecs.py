"""The NVFP4 element and scale formats on float32 bit patterns: E2M1 codes and E4M3 block scales.

Round to nearest even with integer ops only (see ``core.bits``), so the codes do not
depend on how a backend treats subnormals, signed zeros or NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_nvfp4.core import bits as b

# E2M1 decision thresholds (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5); `True` where a
# value equal to the threshold rounds up (ties to even).
_E2M1_STEPS = (
    (0x3E800000, False),
    (0x3F400000, True),
    (0x3FA00000, False),
    (0x3FE00000, True),
    (0x40200000, False),
    (0x40600000, True),
    (0x40A00000, False),
)
_E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e2m1_encode(u: jnp.ndarray) -> jnp.ndarray:
    """E2M1 code (uint8) of float32 bits: clamp to +-6, round to nearest even.

    -0.0 gives 0, negative values that round to zero give 8, NaN gives 0.
    """
    mag = b.magnitude(u)
    code = jnp.zeros(u.shape, jnp.uint8)
    for threshold, inclusive in _E2M1_STEPS:
        code = code + (mag >= threshold if inclusive else mag > threshold).astype(jnp.uint8)
    negative = ((u >> 31) == 1) & (mag != 0)
    code = jnp.where(negative, code | 8, code)
    return jnp.where(b.is_nan(u), jnp.uint8(0), code)


def e2m1_decode(code: jnp.ndarray) -> jnp.ndarray:
    """float32 bits of an E2M1 code."""
    return b.u32(_E2M1_VALUES.view(np.uint32))[code.astype(jnp.int32)]


def e4m3_encode(u: jnp.ndarray) -> jnp.ndarray:
    """E4M3 code of float32 bits already clamped to +-448, RNE; NaN -> 0xFF."""
    sign = ((u >> 24) & 0x80).astype(jnp.uint8)
    mag = b.magnitude(u)
    exp = (mag >> 23).astype(jnp.int32) - 127
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = jnp.clip(14 - exp, 21, 31).astype(jnp.uint32)
    q = sig >> shift
    rem = sig & ((b.u32(1) << shift) - 1)
    half = b.u32(1) << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.uint32)
    code = jnp.where(exp >= -6, normal, jnp.where(exp < -11, 0, sub))
    code = sign | code.astype(jnp.uint8)
    return jnp.where(b.is_nan(u), jnp.uint8(0xFF), code)


def e4m3_decode(code: jnp.ndarray) -> jnp.ndarray:
    """float32 bits of E4M3 codes (uint8)."""
    c = code.astype(jnp.uint32)
    sign = (c & 0x80) << 24
    exp = (c >> 3) & 0xF
    mant = c & 0x7
    normal = ((exp + 120) << 23) | (mant << 20)
    # Subnormal: mant * 2^-9 is a float32 normal with the leading one of mant on top.
    lead = jnp.where(mant >= 4, 2, jnp.where(mant >= 2, 1, 0)).astype(jnp.uint32)
    sub = ((lead + 118) << 23) | (((mant << (3 - lead)) & 0x7) << 20)
    out = jnp.where(exp == 0, jnp.where(mant == 0, 0, sub), normal)
    out = sign | out
    return jnp.where((c & 0x7F) == 0x7F, b.u32(b.NAN) | sign, out)
