"""Exact IEEE float32 arithmetic on bit patterns (uint32), in pure JAX.

XLA on CPU runs with denormals-are-zero and flush-to-zero, so plain float32 ops
turn subnormal inputs and results into zeros (and comparisons see them as zero).
The NVFP4 spec needs the exact IEEE results there (e.g. a bf16-subnormal input
scaled by a huge encode scale, a tiny negative product whose sign picks code 8).
These helpers compute round-to-nearest-even results with integer ops only, so
the reference gives the same bits on every backend as the C++/CUDA kernels,
which run with subnormals preserved.

Their integer ops are ``lax`` calls on operands of one dtype (numpy scalar
constants), not jax.numpy's operators: those are jitted functions whose every
call takes ``jit``'s Python path while tracing (about 95 us an equation
against 35), and these helpers are much of the reference's thousands of
equations. The program computes what the operators did: the StableHLO of 50
reference programs was byte for byte the same when the bitwise and arithmetic
operators changed; ``jnp.where``, ``clip``, ``maximum`` and ``//`` were nested
functions in it, and when they became ``where``, ``clip`` and ``lax`` calls the
reference programs' outputs were (211 arrays on random and special inputs).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

U32 = jnp.uint32
# numpy scalars: a Python int >= 2^31 would overflow JAX's weak int32 typing.
SIGN = np.uint32(0x80000000)
MAG = np.uint32(0x7FFFFFFF)
INF = np.uint32(0x7F800000)
NAN = np.uint32(0x7FC00000)
FLT_MAX = np.uint32(0x7F7FFFFF)
ONE = np.uint32(1)

# Integer ops on traced arrays (see the module's docstring); shifts take a uint32 count.
_and, _or, _xor, _not = lax.bitwise_and, lax.bitwise_or, lax.bitwise_xor, lax.bitwise_not
_shr, _shl = lax.shift_right_logical, lax.shift_left


def _c(v, dtype=np.uint32):
    """A constant operand for lax: a numpy scalar of the other operand's dtype."""
    return np.dtype(dtype).type(v)


def _broadcast(v, shape: tuple[int, ...]) -> jnp.ndarray:
    """``v`` (an array or a numpy scalar) broadcast to ``shape`` as NumPy does (trailing axes aligned)."""
    if np.shape(v) == shape:
        return v
    return lax.broadcast_in_dim(v, shape, tuple(range(len(shape) - np.ndim(v), len(shape))))


def where(cond: jnp.ndarray, x, y) -> jnp.ndarray:
    """``jnp.where(cond, x, y)`` for a boolean ``cond`` and ``x``, ``y`` of one dtype (arrays or numpy
    scalars), as ``lax.select``: jax.numpy's is a jitted function, and the reference calls it thousands of
    times a program (see the module's docstring)."""
    shape = lax.broadcast_shapes(np.shape(cond), np.shape(x), np.shape(y))
    return lax.select(_broadcast(cond, shape), _broadcast(x, shape), _broadcast(y, shape))


def clip(x: jnp.ndarray, low: int, high: int) -> jnp.ndarray:
    """``jnp.clip(x, low, high)`` of an integer array, as lax calls."""
    return lax.min(lax.max(_c(low, x.dtype), x), _c(high, x.dtype))


def broadcast_pair(a, b) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``jnp.broadcast_arrays(u32(a), u32(b))`` as lax calls."""
    a, b = u32(a), u32(b)
    shape = lax.broadcast_shapes(a.shape, b.shape)
    return _broadcast(a, shape), _broadcast(b, shape)


def _low_mask(count: jnp.ndarray) -> jnp.ndarray:
    """(1 << count) - 1 of a uint32 count."""
    return lax.sub(_shl(ONE, count), ONE)


def shift_round(
    sig: jnp.ndarray, shift: jnp.ndarray, sticky: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sig >> shift, whether round to nearest even takes it one up) for uint32 ``shift`` >= 1; ``sticky``:
    whether nonzero bits were dropped below ``sig`` already. The one rounding step of every encode here."""
    kept = _shr(sig, shift)
    rem = _and(sig, _low_mask(shift))
    half = _shl(ONE, lax.sub(shift, ONE))
    odd = lax.eq(_and(kept, ONE), ONE)
    return kept, _or(lax.gt(rem, half), _and(lax.eq(rem, half), odd if sticky is None else _or(sticky, odd)))


def u32(v) -> jnp.ndarray:
    return jnp.asarray(v, dtype=U32)


def to_bits(x: jnp.ndarray) -> jnp.ndarray:
    """Float32 bits of a bf16/f16/f32 array (exact)."""
    if x.dtype == jnp.bfloat16:
        return _shl(lax.convert_element_type(lax.bitcast_convert_type(x, jnp.uint16), U32), _c(16))
    # f16 subnormals are f32 normals, so the hardware convert of f16 is exact.
    return lax.bitcast_convert_type(lax.convert_element_type(x, jnp.float32), U32)


def from_bits(u: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(u, jnp.float32)


def is_nan(u: jnp.ndarray) -> jnp.ndarray:
    return lax.gt(_and(u, MAG), INF)


def magnitude(u: jnp.ndarray) -> jnp.ndarray:
    """|x| bits: for non-NaN values integer order equals float order."""
    return _and(u, MAG)


def canonical_nan(u: jnp.ndarray) -> jnp.ndarray:
    return where(is_nan(u), NAN, u)


def minimum(u: jnp.ndarray, limit: int) -> jnp.ndarray:
    """min(x, limit) for a positive limit; NaN passes through (as torch.min does)."""
    return where(_and(lax.gt(u, _c(limit)), lax.le(u, INF)), _c(limit), u)  # positive, not NaN


def clamp_magnitude(u: jnp.ndarray, limit: int) -> jnp.ndarray:
    """clamp(x, -limit, limit); NaN passes through."""
    return where(_and(_not(is_nan(u)), lax.gt(magnitude(u), _c(limit))), _or(_c(limit), _and(u, SIGN)), u)


def _unpack(u: jnp.ndarray):
    """(exponent, significand) of |u| with value = sig * 2**(exp - 23), sig in [2^23, 2^24)."""
    field = lax.convert_element_type(_and(_shr(u, _c(23)), _c(0xFF)), jnp.int32)
    sig = _or(_and(u, _c(0x7FFFFF)), where(lax.eq(field, _c(0, np.int32)), _c(0), _c(0x800000)))
    # Subnormals: shift the leading one up to bit 23 (a normal's is there: no shift).
    shift = lax.sub(lax.clz(_or(sig, ONE)), _c(8))
    exp = lax.sub(
        lax.sub(lax.max(field, _c(1, np.int32)), _c(127, np.int32)), lax.convert_element_type(shift, jnp.int32)
    )
    return exp, _shl(sig, shift)


def _round_pack(sign, exp, sig26, sticky):
    """Round value = sig26 * 2**(exp - 25) (bit 25 of sig26 set) to float32 bits, RNE."""
    biased = lax.add(exp, _c(127, np.int32))
    # Bits to drop: 2 for a normal result, more for a subnormal one.
    drop = lax.convert_element_type(clip(lax.sub(_c(3, np.int32), biased), 2, 31), U32)
    kept, up = shift_round(sig26, drop, sticky)
    # A normal result's kept has bit 23 set, which adds one to the exponent field below it (a rounding carry into
    # bit 24, one more); a subnormal's is the field itself (one that rounds up to 2^-126 is exactly its bits).
    # The shifted field fits in 32 bits while biased < 512: a float32 product or quotient (div_by's too, by any
    # float32 constant) reaches biased 404 at most; what lies past 254 becomes inf below.
    packed = _shl(lax.convert_element_type(lax.sub(lax.max(biased, _c(1, np.int32)), _c(1, np.int32)), U32), _c(23))
    packed = lax.add(lax.add(packed, kept), lax.convert_element_type(up, U32))
    return _or(sign, lax.min(packed, INF))


def mul(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of fp32(a * b), round to nearest even, subnormals kept."""
    a, b = broadcast_pair(a, b)
    sign = _and(_xor(a, b), SIGN)
    ea, ma = _unpack(a)
    eb, mb = _unpack(b)
    # 24x24-bit product as 12-bit limbs: every partial product fits in 32 bits.
    a1, a0 = _shr(ma, _c(12)), _and(ma, _c(0xFFF))
    b1, b0 = _shr(mb, _c(12)), _and(mb, _c(0xFFF))
    mid = lax.add(lax.mul(a1, b0), lax.mul(a0, b1))
    low = lax.add(lax.mul(a0, b0), _shl(_and(mid, _c(0xFFF)), _c(12)))
    lo = _and(low, _c(0xFFFFFF))
    # product = hi * 2^24 + lo, in [2^46, 2^48)
    hi = lax.add(lax.add(lax.mul(a1, b1), _shr(mid, _c(12))), _shr(low, _c(24)))
    top = lax.eq(_shr(hi, _c(23)), ONE)  # product >= 2^47
    sig26 = where(top, _or(_shl(hi, _c(2)), _shr(lo, _c(22))), _or(_shl(hi, _c(3)), _shr(lo, _c(21))))
    sticky = where(top, lax.ne(_and(lo, _c(0x3FFFFF)), _c(0)), lax.ne(_and(lo, _c(0x1FFFFF)), _c(0)))
    exp = lax.add(lax.add(ea, eb), lax.convert_element_type(top, jnp.int32))
    out = _round_pack(sign, exp, sig26, sticky)
    a_mag, b_mag = magnitude(a), magnitude(b)
    zero = _or(lax.eq(a_mag, _c(0)), lax.eq(b_mag, _c(0)))
    inf = _or(lax.eq(a_mag, INF), lax.eq(b_mag, INF))
    out = where(zero, sign, out)
    out = where(inf, _or(sign, INF), out)
    nan = _or(_or(is_nan(a), is_nan(b)), _and(zero, inf))
    return where(nan, NAN, out)


def div(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of fp32(a / b), round to nearest even, subnormals kept."""
    a, b = broadcast_pair(a, b)
    sign = _and(_xor(a, b), SIGN)
    ea, ma = _unpack(a)
    eb, mb = _unpack(b)
    # Long division: 26 quotient bits with the leading one at bit 25, 8 + 7 + 7 + 4 of them a step, each step
    # one integer division of a remainder below 2^32 (the remainder is below mb < 2^24): a fraction of the
    # ops of a bit a step for XLA to compile.
    below = lax.lt(ma, mb)
    r = where(below, _shl(ma, ONE), ma)  # r / mb in [1, 2)
    q = lax.full_like(r, 0)
    for bits in (7, 7, 7, 4):
        r = _shl(r, _c(bits))
        digit = lax.div(r, lax.max(mb, ONE))  # mb is 0 only for a zero divisor, whose result is set below
        q = _or(_shl(q, _c(bits)), digit)
        r = lax.sub(r, lax.mul(digit, mb))
    exp = lax.sub(lax.sub(ea, eb), lax.convert_element_type(below, jnp.int32))
    out = _round_pack(sign, exp, q, lax.ne(r, _c(0)))
    a_mag, b_mag = magnitude(a), magnitude(b)
    out = where(_or(lax.eq(a_mag, _c(0)), lax.eq(b_mag, INF)), sign, out)
    out = where(_or(lax.eq(b_mag, _c(0)), lax.eq(a_mag, INF)), _or(sign, INF), out)
    nan = _or(
        _or(_or(is_nan(a), is_nan(b)), _and(lax.eq(a_mag, _c(0)), lax.eq(b_mag, _c(0)))),
        _and(lax.eq(a_mag, INF), lax.eq(b_mag, INF)),
    )
    return where(nan, NAN, out)


def div_by(a: jnp.ndarray, divisor: float) -> jnp.ndarray:
    """Bits of fp32(a / divisor) for a positive float32 constant ``divisor`` whose significand's odd part is at
    most 31 (6, 2688 = 21 * 2^7, 1536 = 3 * 2^9...): ``div``'s result, from one integer division by that odd
    part instead of ``div``'s long division, in a fraction of the ops for XLA to compile (the reference's global
    decode scales, 4over6's division by 6)."""
    d = np.float32(divisor)
    mantissa, exponent = np.frexp(np.float64(d))  # d = mantissa * 2^exponent, mantissa in [0.5, 1)
    odd, k = int(mantissa * 2**24), int(exponent) - 24  # d = odd * 2^k, made odd below
    while odd % 2 == 0:
        odd, k = odd // 2, k + 1
    if not (np.isfinite(d) and d > 0 and odd <= 31):
        return div(a, lax.bitcast_convert_type(jnp.asarray(d), U32))
    a = u32(a)
    sign = _and(a, SIGN)
    ea, ma = _unpack(a)
    # a / d = (ma * 2^7 / odd) * 2^(ea - 30 - k); ma * 2^7 < 2^31, and its quotient keeps >= 26 bits.
    q = lax.div(_shl(ma, _c(7)), np.uint32(odd))
    rest = lax.sub(_shl(ma, _c(7)), lax.mul(q, np.uint32(odd)))
    lead = lax.sub(_c(31, np.int32), lax.convert_element_type(lax.clz(q), jnp.int32))  # 25 + (0 to 5)
    sh = lax.convert_element_type(lax.sub(lead, _c(25, np.int32)), U32)
    sticky = _or(lax.ne(rest, _c(0)), lax.ne(_and(q, _low_mask(sh)), _c(0)))
    exp = lax.add(lax.sub(lax.sub(ea, _c(5, np.int32)), _c(k, np.int32)), lax.sub(lead, _c(25, np.int32)))
    out = _round_pack(sign, exp, _shr(q, sh), sticky)
    mag = magnitude(a)
    out = where(lax.eq(mag, _c(0)), sign, out)
    out = where(lax.eq(mag, INF), _or(sign, INF), out)
    return where(is_nan(a), NAN, out)


def f32_to_bf16(u: jnp.ndarray) -> jnp.ndarray:
    """bfloat16 array from float32 bits, RNE; NaN -> canonical quiet NaN."""
    r = _shr(lax.add(lax.add(u, _c(0x7FFF)), _and(_shr(u, _c(16)), ONE)), _c(16))
    r = where(is_nan(u), _c(0x7FC0), r)
    return lax.bitcast_convert_type(lax.convert_element_type(r, jnp.uint16), jnp.bfloat16)


def f32_to_f16(u: jnp.ndarray) -> jnp.ndarray:
    """float16 array from float32 bits, RNE with subnormals; NaN -> canonical NaN."""
    sign = _and(_shr(u, _c(16)), _c(0x8000))
    mag = magnitude(u)
    exp = lax.sub(lax.convert_element_type(_shr(mag, _c(23)), jnp.int32), _c(127, np.int32))
    r = lax.sub(mag, _c((127 - 15) << 23))
    normal = _shr(lax.add(lax.add(r, _c(0xFFF)), _and(_shr(r, _c(13)), ONE)), _c(13))
    sig = _or(_and(mag, _c(0x7FFFFF)), _c(0x800000))
    shift = lax.convert_element_type(clip(lax.sub(lax.neg(exp), _c(1, np.int32)), 14, 31), U32)
    q, up = shift_round(sig, shift)
    sub = lax.add(q, lax.convert_element_type(up, U32))
    out = where(lax.ge(exp, _c(-14, np.int32)), normal, where(lax.lt(exp, _c(-25, np.int32)), _c(0), sub))
    out = where(lax.ge(mag, _c(0x477FF000)), _c(0x7C00), out)
    out = _or(sign, out)
    out = where(is_nan(u), _c(0x7E00), out)
    return lax.bitcast_convert_type(lax.convert_element_type(out, jnp.uint16), jnp.float16)


def add(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of fp32(a + b), round to nearest even, subnormals kept."""
    a, b = broadcast_pair(a, b)
    # Order by magnitude: |a| >= |b|; the result takes a's sign unless it is an exact zero.
    swap = lax.gt(magnitude(b), magnitude(a))
    a, b = where(swap, b, a), where(swap, a, b)
    a_mag, b_mag = magnitude(a), magnitude(b)
    sign = _and(a, SIGN)
    ea, ma = _unpack(a)
    eb, mb = _unpack(b)
    # Three guard bits; b's bits shifted out beyond them fold into a sticky bit 0.
    a3, b3 = _shl(ma, _c(3)), _shl(mb, _c(3))
    d = lax.convert_element_type(clip(lax.sub(ea, eb), 0, 31), U32)
    shifted = where(lax.ge(d, _c(27)), _c(0), _shr(b3, d))
    lost = where(lax.ge(d, _c(27)), lax.ne(b3, _c(0)), lax.ne(_and(b3, _low_mask(d)), _c(0)))
    b3 = _or(shifted, lax.convert_element_type(lost, U32))
    subtract = lax.ne(_and(_xor(a, b), SIGN), _c(0))
    s = where(subtract, lax.sub(a3, b3), lax.add(a3, b3))  # value s * 2^(ea - 26)
    # Normalize the leading one to bit 25 (the sig26 of _round_pack), keeping a sticky bit.
    lead = lax.sub(_c(31, np.int32), lax.convert_element_type(lax.clz(_or(s, ONE)), jnp.int32))
    sh = lax.sub(lead, _c(25, np.int32))
    right = lax.convert_element_type(clip(sh, 0, 31), U32)
    sticky = lax.ne(_and(s, _low_mask(right)), _c(0))
    sig26 = where(
        lax.ge(sh, _c(0, np.int32)),
        _shr(s, right),
        _shl(s, lax.convert_element_type(clip(lax.neg(sh), 0, 31), U32)),
    )
    out = _round_pack(sign, lax.add(lax.sub(ea, _c(1, np.int32)), sh), sig26, sticky)
    out = where(lax.eq(s, _c(0)), _c(0), out)  # x - x = +0
    # -0 + -0 = -0, else +0
    out = where(lax.eq(b_mag, _c(0)), where(lax.eq(a_mag, _c(0)), _and(a, b), a), out)
    out = where(lax.eq(a_mag, INF), where(_and(subtract, lax.eq(b_mag, INF)), NAN, a), out)
    return where(_or(is_nan(a), is_nan(b)), NAN, out)
