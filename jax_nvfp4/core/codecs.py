"""The NVFP4 element and scale formats on float32 bit patterns: E2M1 codes and E4M3 block scales.

Round to nearest even with integer ops only (see ``core.bits``), so the codes do not
depend on how a backend treats subnormals, signed zeros or NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.core import bits as b

# lax calls on one dtype, numpy scalar constants (see core/bits.py's docstring).
_and, _or, _shr, _shl = lax.bitwise_and, lax.bitwise_or, lax.shift_right_logical, lax.shift_left
_u32 = np.uint32

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
    code = lax.full(u.shape, 0, jnp.uint8)
    for threshold, inclusive in _E2M1_STEPS:
        above = (lax.ge if inclusive else lax.gt)(mag, _u32(threshold))
        code = lax.add(code, lax.convert_element_type(above, jnp.uint8))
    code = b.where(negative(u, mag), _or(code, np.uint8(8)), code)
    return b.where(b.is_nan(u), np.uint8(0), code)


def negative(u: jnp.ndarray, mag: jnp.ndarray) -> jnp.ndarray:
    """Whether float32 bits ``u`` (magnitude bits ``mag``) are a negative value other than -0.0: its E2M1 code
    takes the sign bit even where the value rounds to zero (nearest and stochastic rounding alike)."""
    return _and(lax.eq(_shr(u, _u32(31)), _u32(1)), lax.ne(mag, _u32(0)))


def e2m1_decode(code: jnp.ndarray) -> jnp.ndarray:
    """float32 bits of an E2M1 code."""
    return b.u32(_E2M1_VALUES.view(np.uint32))[code.astype(jnp.int32)]


def e4m3_encode(u: jnp.ndarray) -> jnp.ndarray:
    """E4M3 code of float32 bits already clamped to +-448, RNE; NaN -> 0xFF."""
    sign = lax.convert_element_type(_and(_shr(u, _u32(24)), _u32(0x80)), jnp.uint8)
    mag = b.magnitude(u)
    exp = lax.sub(lax.convert_element_type(_shr(mag, _u32(23)), jnp.int32), np.int32(127))
    normal = lax.sub(
        _shr(lax.add(lax.add(mag, _u32(0x7FFFF)), _and(_shr(mag, _u32(20)), _u32(1))), _u32(20)), _u32(120 << 3)
    )
    sig = _or(_and(mag, _u32(0x7FFFFF)), _u32(0x800000))
    q, up = b.shift_round(sig, lax.convert_element_type(b.clip(lax.sub(np.int32(14), exp), 21, 31), jnp.uint32))
    sub = lax.add(q, lax.convert_element_type(up, jnp.uint32))
    code = b.where(lax.ge(exp, np.int32(-6)), normal, b.where(lax.lt(exp, np.int32(-11)), _u32(0), sub))
    code = _or(sign, lax.convert_element_type(code, jnp.uint8))
    return b.where(b.is_nan(u), np.uint8(0xFF), code)


def e4m3_decode(code: jnp.ndarray) -> jnp.ndarray:
    """float32 bits of E4M3 codes (uint8)."""
    c = lax.convert_element_type(code, jnp.uint32)
    sign = _shl(_and(c, _u32(0x80)), _u32(24))
    exp = _and(_shr(c, _u32(3)), _u32(0xF))
    mant = _and(c, _u32(0x7))
    normal = _or(_shl(lax.add(exp, _u32(120)), _u32(23)), _shl(mant, _u32(20)))
    # Subnormal: mant * 2^-9 is a float32 normal with the leading one of mant on top.
    lead = b.where(lax.ge(mant, _u32(4)), _u32(2), b.where(lax.ge(mant, _u32(2)), _u32(1), _u32(0)))
    sub = _or(
        _shl(lax.add(lead, _u32(118)), _u32(23)), _shl(_and(_shl(mant, lax.sub(_u32(3), lead)), _u32(0x7)), _u32(20))
    )
    out = b.where(lax.eq(exp, _u32(0)), b.where(lax.eq(mant, _u32(0)), _u32(0), sub), normal)
    out = _or(sign, out)
    return b.where(lax.eq(_and(c, _u32(0x7F)), _u32(0x7F)), _or(b.NAN, sign), out)
