"""The reference's exact float32 arithmetic and format codecs against NumPy / ml_dtypes.

NumPy computes IEEE float32 with subnormals on this thread, and ml_dtypes
converts in software, so they are independent oracles for the bit-level code.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jax_nvfp4 import reference as ref
from jax_nvfp4.core import bits

EDGE_BITS = np.array(
    [0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
     0x3F800000, 0x45280000, 0x3E2AAAAB, 0x0000_4000, 0x0080_0001, 0x7F00_0000, 0x0100_0000],
    np.uint32,
)  # fmt: skip


def _random_bits(seed: int, n: int = 4096) -> np.ndarray:
    """Bit patterns with every exponent range well represented, subnormals included."""
    rng = np.random.default_rng(seed)
    sign = rng.integers(0, 2, n, dtype=np.uint32) << 31
    exponent = rng.choice(np.concatenate([np.arange(0, 8), np.arange(100, 160), np.arange(240, 256)]), n).astype(
        np.uint32
    )
    mantissa = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    mantissa = np.where(rng.random(n) < 0.2, mantissa & 0x7F0000, mantissa)  # short mantissas: exact cases, ties
    return np.concatenate([sign | (exponent << 23) | mantissa, EDGE_BITS])


def _same_float_bits(got: np.ndarray, want: np.ndarray):
    """Bitwise equality, any NaN matching any NaN (_bits makes NaN canonical)."""
    want_nan = np.isnan(want.view(np.float32))
    np.testing.assert_array_equal(np.isnan(got.view(np.float32)), want_nan)
    np.testing.assert_array_equal(got[~want_nan], want[~want_nan])


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_mul_matches_ieee(seed_a, seed_b):
    a, b = _random_bits(seed_a), _random_bits(seed_b)
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) * b.view(np.float32)).view(np.uint32)
    _same_float_bits(np.asarray(jax.jit(bits.mul)(a, b)), want)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_div_matches_ieee(seed_a, seed_b):
    a, b = _random_bits(seed_a), _random_bits(seed_b)
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) / b.view(np.float32)).view(np.uint32)
    _same_float_bits(np.asarray(jax.jit(bits.div)(a, b)), want)


@given(st.integers(0, 2**32 - 1), st.sampled_from([6.0, 2688.0, 1536.0, 3.0, 1.0, 0.75, 31 * 2.0**-140, 3 * 2.0**100]))
def test_division_by_a_constant_matches_ieee(seed, divisor):
    # The global scales' divisors (6 E: 2688, 1536) and 4over6's 6, and constants whose quotients overflow or
    # are subnormal; every exponent of the dividend, subnormals included.
    a = np.concatenate([_random_bits(seed), np.arange(4096, dtype=np.uint32), np.arange(512, dtype=np.uint32) << 23])
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) / np.float32(divisor)).view(np.uint32)
    _same_float_bits(np.asarray(jax.jit(lambda a: bits.div_by(a, divisor))(a)), want)


def test_division_by_a_constant_with_a_long_odd_part_is_the_long_division():
    a = _random_bits(0)
    with np.errstate(all="ignore"):
        want = (a.view(np.float32) / np.float32(0.1)).view(np.uint32)  # 0.1's significand is odd and 24 bits long
    _same_float_bits(np.asarray(jax.jit(lambda a: bits.div_by(a, 0.1))(a)), want)


@given(st.integers(0, 2**32 - 1))
def test_output_conversions_match_numpy(seed):
    u = _random_bits(seed)
    f = u.view(np.float32)
    with np.errstate(all="ignore"):
        want_bf16 = f.astype(ml_dtypes.bfloat16).view(np.uint16)
        want_f16 = f.astype(np.float16).view(np.uint16)
    got_bf16 = np.asarray(jax.jit(bits.f32_to_bf16)(u)).view(np.uint16)
    got_f16 = np.asarray(jax.jit(bits.f32_to_f16)(u)).view(np.uint16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(got_bf16[~nan], want_bf16[~nan])
    np.testing.assert_array_equal(got_f16[~nan], want_f16[~nan])
    assert (got_bf16[nan] == 0x7FC0).all() and (got_f16[nan] == 0x7E00).all()


def test_input_bits_keep_subnormals():
    x = np.array([1e-39, -1e-40, 3e-45, 1.0], np.float32)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        xs = x.astype(dtype)
        got = np.asarray(jax.jit(bits.to_bits)(xs))
        np.testing.assert_array_equal(got, xs.astype(np.float32).view(np.uint32))


@given(st.integers(0, 2**32 - 1))
def test_e4m3_encode_matches_ml_dtypes(seed):
    u = _random_bits(seed)
    f = np.clip(u.view(np.float32), -448, 448)
    got = np.asarray(jax.jit(ref.e4m3_encode)(f.view(np.uint32)))
    with np.errstate(invalid="ignore"):
        want = f.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    nan = np.isnan(f)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert (got[nan] == 0xFF).all()


@given(st.integers(0, 2**32 - 1))
def test_e2m1_encode_matches_ml_dtypes(seed):
    u = _random_bits(seed)
    f = np.clip(u.view(np.float32), -6, 6)
    got = np.asarray(jax.jit(ref.e2m1_encode)(u))
    # ml_dtypes keeps the sign of -0.0 (code 8); the spec gives code 0: add +0.0.
    with np.errstate(invalid="ignore"):
        want = (f + np.float32(0.0)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    nan = np.isnan(f)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert (got[nan] == 0).all()


def test_e2m1_ties_to_even():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, -0.0, -1e-30, 7.0, np.inf], np.float32)
    got = np.asarray(jax.jit(ref.e2m1_encode)(ties.view(np.uint32)))
    np.testing.assert_array_equal(got, [0, 2, 2, 4, 4, 6, 6, 8, 14, 0, 8, 7, 7])


def test_decoders_match_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(ref.e4m3_decode)(codes)).view(np.float32)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN == NaN here
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    e2m1 = np.arange(16, dtype=np.uint8)
    got = np.asarray(jax.jit(ref.e2m1_decode)(e2m1)).view(np.float32)
    np.testing.assert_array_equal(got, e2m1.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
