"""Exact IEEE float32 arithmetic on bit patterns (uint32), in pure JAX.

XLA on CPU runs with denormals-are-zero and flush-to-zero, so plain float32 ops
turn subnormal inputs and results into zeros (and comparisons see them as zero).
The NVFP4 spec needs the exact IEEE results there (e.g. a bf16-subnormal input
scaled by a huge encode scale, a tiny negative product whose sign picks code 8).
These helpers compute round-to-nearest-even results with integer ops only, so
the reference gives the same bits on every backend as the C++/CUDA kernels,
which run with subnormals preserved.
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


def u32(v) -> jnp.ndarray:
    return jnp.asarray(v, dtype=U32)


def to_bits(x: jnp.ndarray) -> jnp.ndarray:
    """Float32 bits of a bf16/f16/f32 array (exact)."""
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(U32) << 16
    # f16 subnormals are f32 normals, so the hardware convert of f16 is exact.
    return lax.bitcast_convert_type(x.astype(jnp.float32), U32)


def from_bits(u: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(u, jnp.float32)


def is_nan(u: jnp.ndarray) -> jnp.ndarray:
    return (u & MAG) > INF


def magnitude(u: jnp.ndarray) -> jnp.ndarray:
    """|x| bits: for non-NaN values integer order equals float order."""
    return u & MAG


def canonical_nan(u: jnp.ndarray) -> jnp.ndarray:
    return jnp.where(is_nan(u), u32(NAN), u)


def minimum(u: jnp.ndarray, limit: int) -> jnp.ndarray:
    """min(x, limit) for a positive limit; NaN passes through (as torch.min does)."""
    return jnp.where((u > limit) & (u <= INF), u32(limit), u)  # positive, not NaN


def clamp_magnitude(u: jnp.ndarray, limit: int) -> jnp.ndarray:
    """clamp(x, -limit, limit); NaN passes through."""
    return jnp.where(~is_nan(u) & (magnitude(u) > limit), u32(limit) | (u & SIGN), u)


def _unpack(u: jnp.ndarray):
    """(exponent, significand) of |u| with value = sig * 2**(exp - 23), sig in [2^23, 2^24)."""
    field = ((u >> 23) & 0xFF).astype(jnp.int32)
    sig = (u & 0x7FFFFF) | jnp.where(field == 0, u32(0), u32(0x800000))
    # Subnormals: shift the leading one up to bit 23 (a normal's is there: no shift).
    shift = lax.clz(sig | 1) - 8
    exp = jnp.maximum(field, 1) - 127 - shift.astype(jnp.int32)
    return exp, sig << shift


def _round_pack(sign, exp, sig26, sticky):
    """Round value = sig26 * 2**(exp - 25) (bit 25 of sig26 set) to float32 bits, RNE."""
    biased = exp + 127
    # Bits to drop: 2 for a normal result, more for a subnormal one.
    drop = jnp.clip(3 - biased, 2, 31).astype(U32)
    kept = sig26 >> drop
    rem = sig26 & ((u32(1) << drop) - 1)
    half = u32(1) << (drop - 1)
    up = (rem > half) | ((rem == half) & (sticky | ((kept & 1) == 1)))
    # A normal result's kept has bit 23 set, which adds one to the exponent field below it (a rounding carry into
    # bit 24, one more); a subnormal's is the field itself (one that rounds up to 2^-126 is exactly its bits).
    # The shifted field fits in 32 bits while biased < 512: a float32 product or quotient (div_by's too, by any
    # float32 constant) reaches biased 404 at most; what lies past 254 becomes inf below.
    packed = (jnp.maximum(biased, 1) - 1).astype(U32) << 23
    packed = packed + kept + up.astype(U32)
    return sign | jnp.minimum(packed, u32(INF))


def mul(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of fp32(a * b), round to nearest even, subnormals kept."""
    a, b = jnp.broadcast_arrays(u32(a), u32(b))
    sign = (a ^ b) & SIGN
    ea, ma = _unpack(a)
    eb, mb = _unpack(b)
    # 24x24-bit product as 12-bit limbs: every partial product fits in 32 bits.
    a1, a0 = ma >> 12, ma & 0xFFF
    b1, b0 = mb >> 12, mb & 0xFFF
    mid = a1 * b0 + a0 * b1
    low = a0 * b0 + ((mid & 0xFFF) << 12)
    lo = low & 0xFFFFFF
    hi = a1 * b1 + (mid >> 12) + (low >> 24)  # product = hi * 2^24 + lo, in [2^46, 2^48)
    top = (hi >> 23) == 1  # product >= 2^47
    sig26 = jnp.where(top, (hi << 2) | (lo >> 22), (hi << 3) | (lo >> 21))
    sticky = jnp.where(top, (lo & 0x3FFFFF) != 0, (lo & 0x1FFFFF) != 0)
    exp = ea + eb + top.astype(jnp.int32)
    out = _round_pack(sign, exp, sig26, sticky)
    a_mag, b_mag = magnitude(a), magnitude(b)
    zero = (a_mag == 0) | (b_mag == 0)
    inf = (a_mag == INF) | (b_mag == INF)
    out = jnp.where(zero, sign, out)
    out = jnp.where(inf, sign | INF, out)
    nan = is_nan(a) | is_nan(b) | (zero & inf)
    return jnp.where(nan, u32(NAN), out)


def div(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of fp32(a / b), round to nearest even, subnormals kept."""
    a, b = jnp.broadcast_arrays(u32(a), u32(b))
    sign = (a ^ b) & SIGN
    ea, ma = _unpack(a)
    eb, mb = _unpack(b)
    # Long division: 26 quotient bits with the leading one at bit 25, 8 + 7 + 7 + 4 of them a step, each step
    # one integer division of a remainder below 2^32 (the remainder is below mb < 2^24): a fraction of the
    # ops of a bit a step for XLA to compile.
    below = ma < mb
    r = jnp.where(below, ma << 1, ma)  # r / mb in [1, 2)
    q = jnp.zeros_like(r)
    for bits in (7, 7, 7, 4):
        r = r << bits
        digit = r // jnp.maximum(mb, 1)  # mb is 0 only for a zero divisor, whose result is set below
        q = (q << bits) | digit
        r = r - digit * mb
    exp = ea - eb - below.astype(jnp.int32)
    out = _round_pack(sign, exp, q, r != 0)
    a_mag, b_mag = magnitude(a), magnitude(b)
    out = jnp.where((a_mag == 0) | (b_mag == INF), sign, out)
    out = jnp.where((b_mag == 0) | (a_mag == INF), sign | INF, out)
    nan = is_nan(a) | is_nan(b) | ((a_mag == 0) & (b_mag == 0)) | ((a_mag == INF) & (b_mag == INF))
    return jnp.where(nan, u32(NAN), out)


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
    sign = a & SIGN
    ea, ma = _unpack(a)
    # a / d = (ma * 2^7 / odd) * 2^(ea - 30 - k); ma * 2^7 < 2^31, and its quotient keeps >= 26 bits.
    q = (ma << 7) // np.uint32(odd)
    rest = (ma << 7) - q * np.uint32(odd)
    lead = 31 - lax.clz(q).astype(jnp.int32)  # 25 + (0 to 5)
    sh = (lead - 25).astype(U32)
    sticky = (rest != 0) | ((q & ((u32(1) << sh) - 1)) != 0)
    out = _round_pack(sign, ea - 5 - k + (lead - 25), q >> sh, sticky)
    mag = magnitude(a)
    out = jnp.where(mag == 0, sign, out)
    out = jnp.where(mag == INF, sign | INF, out)
    return jnp.where(is_nan(a), u32(NAN), out)


def f32_to_bf16(u: jnp.ndarray) -> jnp.ndarray:
    """bfloat16 array from float32 bits, RNE; NaN -> canonical quiet NaN."""
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = jnp.where(is_nan(u), u32(0x7FC0), r)
    return lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)


def f32_to_f16(u: jnp.ndarray) -> jnp.ndarray:
    """float16 array from float32 bits, RNE with subnormals; NaN -> canonical NaN."""
    sign = (u >> 16) & 0x8000
    mag = magnitude(u)
    exp = (mag >> 23).astype(jnp.int32) - 127
    r = mag - ((127 - 15) << 23)
    normal = (r + 0xFFF + ((r >> 13) & 1)) >> 13
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = jnp.clip(-exp - 1, 14, 31).astype(U32)
    q = sig >> shift
    rem = sig & ((u32(1) << shift) - 1)
    half = u32(1) << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(U32)
    out = jnp.where(exp >= -14, normal, jnp.where(exp < -25, 0, sub))
    out = jnp.where(mag >= 0x477FF000, u32(0x7C00), out)
    out = sign | out
    out = jnp.where(is_nan(u), u32(0x7E00), out)
    return lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.float16)


def add(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of fp32(a + b), round to nearest even, subnormals kept."""
    a, b = jnp.broadcast_arrays(u32(a), u32(b))
    # Order by magnitude: |a| >= |b|; the result takes a's sign unless it is an exact zero.
    swap = magnitude(b) > magnitude(a)
    a, b = jnp.where(swap, b, a), jnp.where(swap, a, b)
    a_mag, b_mag = magnitude(a), magnitude(b)
    sign = a & SIGN
    ea, ma = _unpack(a)
    eb, mb = _unpack(b)
    # Three guard bits; b's bits shifted out beyond them fold into a sticky bit 0.
    a3, b3 = ma << 3, mb << 3
    d = jnp.clip(ea - eb, 0, 31).astype(U32)
    shifted = jnp.where(d >= 27, 0, b3 >> d)
    lost = jnp.where(d >= 27, b3 != 0, (b3 & ((u32(1) << d) - 1)) != 0)
    b3 = shifted | lost.astype(U32)
    subtract = ((a ^ b) & SIGN) != 0
    s = jnp.where(subtract, a3 - b3, a3 + b3)  # value s * 2^(ea - 26)
    # Normalize the leading one to bit 25 (the sig26 of _round_pack), keeping a sticky bit.
    lead = 31 - lax.clz(s | 1).astype(jnp.int32)
    sh = lead - 25
    right = jnp.clip(sh, 0, 31).astype(U32)
    sticky = (s & ((u32(1) << right) - 1)) != 0
    sig26 = jnp.where(sh >= 0, s >> right, s << jnp.clip(-sh, 0, 31).astype(U32))
    out = _round_pack(sign, ea - 1 + sh, sig26, sticky)
    out = jnp.where(s == 0, u32(0), out)  # x - x = +0
    out = jnp.where(b_mag == 0, jnp.where(a_mag == 0, a & b, a), out)  # -0 + -0 = -0, else +0
    out = jnp.where(a_mag == INF, jnp.where(subtract & (b_mag == INF), u32(NAN), a), out)
    return jnp.where(is_nan(a) | is_nan(b), u32(NAN), out)
