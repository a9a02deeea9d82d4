"""Stochastic rounding's spec: the random stream (Philox-4x32-10, one hash per 1x16 block) and the encode.

**The stream.** A copy [B, R, W] (W = its padded width, whole blocks of 16) draws one 8-bit random
number per value. Block j of row r of batch entry b of a copy's ``stream`` (0 rowwise, 1 columnwise)
hashes the counter (j, r, b, stream) under the key ``seed`` (uint32 [2]) with Philox-4x32-10
(Random123's, as cuRAND's ``curand_Philox4x32_10``); the 16 little-endian bytes of the four output
words are its 16 values' random bytes, value k taking byte k % 4 of word k // 4. Philox, not JAX's
Threefry: its rounds are two 32x32->64 multiplies and two XORs, which a GPU issues as 4
instructions (Threefry-2x32 needs 20 rounds of add, rotate, xor for 64 bits), and one hash gives a
whole block's 128 random bits. Counters hold positions, not a running index, so a copy's draws do
not depend on its size and the CPU and CUDA kernels, however they split the work, give the same
bytes. They are positions in the whole tensor: a shard of it (under ``jit`` on a mesh) is told its
place (``Place``: the seed operand grows from the key to [4 + M] words) and draws what the whole
tensor draws there, so sharded equals unsharded. 16x16 blocks draw once per value, from the rowwise
stream of the padded tile array.

**The encode.** Between the neighbouring E2M1 magnitudes lo <= |v| < hi, with f = (|v| - lo) / (hi -
lo), let X = floor(256 f + 1/2), 0..256. The code is lo's plus one iff X + rbyte >= 256, so it
rounds up with probability X / 256 and E[q] - |v| = (hi - lo) (X / 256 - f), at most (hi - lo) / 512
in magnitude (8 random bits; rounding f to X, not truncating it, halves the 1/256 that truncation
would give and leaves the error no systematic sign). A value on the grid (f = 0) never moves. In
integers: T = 256 lo_index + X (``sr_position``) is 256 times |v|'s position on the E2M1 grid, rounded
half up, and the code magnitude is min((T + rbyte) >> 8, 7). Saturation (6, inf too), signs (a negative value keeps the
sign bit, -0.0 gives +0) and NaN (code 0) as with round-to-nearest.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.core import bits as b
from jax_nvfp4.core.codecs import negative
from jax_nvfp4.core.formats import BLOCK

# Philox-4x32's multipliers and key increments (Salmon et al., SC'11; Random123).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10

# The hash and the encode as lax calls on uint32 operands (numpy scalar constants), not jax.numpy's operators,
# whose every call takes jit's Python path while tracing (core/bits.py).
_and, _xor, _shr, _shl = lax.bitwise_and, lax.bitwise_xor, lax.shift_right_logical, lax.shift_left
_u32 = np.uint32
_U16, _LOW16 = _u32(16), _u32(0xFFFF)


def _mulhilo(a: int, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(hi, lo) words of the 64-bit product of the constant ``a`` and uint32 ``x``, in 16-bit halves (no uint64)."""
    a_lo, a_hi = _u32(a & 0xFFFF), _u32(a >> 16)
    x_lo, x_hi = _and(x, _LOW16), _shr(x, _U16)
    low = lax.mul(x_lo, a_lo)
    m1, m2 = lax.mul(x_lo, a_hi), lax.mul(x_hi, a_lo)
    mid = lax.add(lax.add(_shr(low, _U16), _and(m1, _LOW16)), _and(m2, _LOW16))
    hi = lax.add(lax.add(lax.add(lax.mul(x_hi, a_hi), _shr(m1, _U16)), _shr(m2, _U16)), _shr(mid, _U16))
    return hi, lax.mul(x, _u32(a))


def philox4x32_10(key: jnp.ndarray, c0, c1, c2, c3) -> tuple[jnp.ndarray, ...]:
    """Philox-4x32-10 of counters (c0, c1, c2, c3) (uint32 arrays, broadcast) under ``key`` uint32 [2]."""
    k0, k1 = key[0].astype(jnp.uint32), key[1].astype(jnp.uint32)
    c = [jnp.asarray(v, jnp.uint32) for v in jnp.broadcast_arrays(c0, c1, c2, c3)]
    for i in range(PHILOX_ROUNDS):
        if i:
            k0, k1 = lax.add(k0, _u32(PHILOX_W0)), lax.add(k1, _u32(PHILOX_W1))
        hi0, lo0 = _mulhilo(PHILOX_M0, c[0])
        hi1, lo1 = _mulhilo(PHILOX_M1, c[2])
        c = [_xor(_xor(hi1, c[1]), k0), lo1, _xor(_xor(hi0, c[3]), k1), lo0]
    return tuple(c)


def block_bytes(key: jnp.ndarray, j, r, bi, stream, shape: tuple[int, ...]) -> jnp.ndarray:
    """The random bytes (uint32 0..255) of the blocks at counters (j, r, bi, stream) (broadcast to [..., blocks]),
    each block's 16 in value order, reshaped to ``shape`` ([..., 16 blocks])."""
    words = jnp.stack(philox4x32_10(key, j, r, bi, stream), axis=-1)  # [..., blocks, 4]
    shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
    return ((words[..., None] >> shifts) & 0xFF).reshape(shape)


class Place(NamedTuple):
    """Where a copy's values sit in the whole tensor [B, M, N] (the kernels' ``Stream``), so that a shard draws the
    bytes the whole tensor draws there: its first batch entry ``b`` and column ``n`` of x (uint32 scalars), and
    the whole tensor's index of each of its M rows (uint32 [M]; None: its rows are 0..M-1)."""

    b: jnp.ndarray | int = 0
    n: jnp.ndarray | int = 0
    rows: jnp.ndarray | None = None

    def row_ids(self, count: int) -> jnp.ndarray:
        """The counters of rows 0..count-1 (padded rows past the M given keep their own index)."""
        own = jnp.arange(count, dtype=jnp.uint32)
        if self.rows is None:
            return own
        return jnp.concatenate([self.rows[:count], own[self.rows.shape[0] :]])

    def block_ids(self, count: int) -> jnp.ndarray:
        """The counters of the blocks of 16 rows 0..count-1 (a columnwise copy's blocks)."""
        return self.row_ids(count * BLOCK)[::BLOCK] // BLOCK


def check_seed_shape(shape: tuple[int, ...], rows: int) -> None:
    """ValueError unless a quantize's seed operand of ``shape`` is uint32 [2] or [4 + rows] (``split_seed``)."""
    if shape not in ((2,), (4 + rows,)):
        raise ValueError(f"the seed is uint32 [2] or [4 + M] (M = {rows} rows), not {shape}")


def split_seed(seed: jnp.ndarray) -> tuple[jnp.ndarray, Place]:
    """A quantize's seed operand, uint32 [2] (the key) or [4 + M] (the key, b, n, the M rows' indices), as
    (key, Place)."""
    if seed.shape[0] == 2:
        return seed, Place()
    return seed[:2], Place(seed[2], seed[3], seed[4:])


def random_bytes(seed: jnp.ndarray, shape: tuple[int, int, int], stream: int) -> jnp.ndarray:
    """The random byte (uint32 0..255) of each value of a copy [B, R, W] (W whole blocks of 16) of ``stream``.

    ``seed``: uint32 [2] or [4 + M] (``split_seed``). The rowwise copy (stream 0) has x's rows and blocks along
    its columns, from column ``n``; the columnwise one (stream 1) x^T's rows, from ``n``, and blocks along x's
    rows."""
    key, place = split_seed(seed)
    bsz, rows, width = shape
    if stream == 0:
        j = jnp.arange(width // BLOCK, dtype=jnp.uint32) + jnp.uint32(place.n) // BLOCK
        r = place.row_ids(rows)
    else:
        j = place.block_ids(width // BLOCK)
        r = jnp.arange(rows, dtype=jnp.uint32) + jnp.uint32(place.n)
    bi = jnp.arange(bsz, dtype=jnp.uint32) + jnp.uint32(place.b)
    return block_bytes(key, j, r[:, None], bi[:, None, None], jnp.uint32(stream), shape)


def sr_position(mag: jnp.ndarray) -> jnp.ndarray:
    """T = floor(256 p + 1/2) for the E2M1 grid position p of magnitude bits ``mag`` (p: 0 for 0, 2 for 1.0, 7 for 6).

    From 1.0 up, p is the top 9 bits of the float's exponent and mantissa less 252, and T adds 8
    more mantissa bits rounded half up; below 1.0, p = 2 |v| and T = floor(512 |v| + 1/2) from the
    significand, shifted by the exponent (0 below 2^-10).
    """
    big = lax.sub(_shr(lax.add(mag, _u32(0x2000)), _u32(14)), _u32(0xFC00))
    field = _shr(mag, _u32(23))
    frac = _and(mag, _u32(0x7FFFFF))
    sig = b.where(lax.eq(field, _u32(0)), frac, lax.bitwise_or(frac, _u32(0x800000)))
    shift = lax.convert_element_type(
        b.clip(lax.sub(np.int32(141), lax.convert_element_type(field, jnp.int32)), 15, 25), jnp.uint32
    )
    small = _shr(lax.add(sig, _shl(_u32(1), lax.sub(shift, _u32(1)))), shift)
    return b.where(lax.ge(mag, _u32(0x3F800000)), big, small)


def e2m1_encode_stochastic(u: jnp.ndarray, rbyte: jnp.ndarray) -> jnp.ndarray:
    """E2M1 codes of float32 bits ``u`` (already scaled), rounded stochastically by random bytes ``rbyte``."""
    mag = b.magnitude(u)
    code = lax.min(_shr(lax.add(sr_position(mag), rbyte), _u32(8)), _u32(7))
    code = lax.convert_element_type(b.where(negative(u, mag), lax.bitwise_or(code, _u32(8)), code), jnp.uint8)
    return b.where(b.is_nan(u), np.uint8(0), code)
