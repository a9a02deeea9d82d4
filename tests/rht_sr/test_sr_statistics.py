"""Stochastic rounding's statistics: the encode's exact bias bound, the kernels' empirical unbiasedness, and no
correlation between the random decisions of values that the stream keeps apart.

The spec is ``jax_nvfp4.reference.stochastic``'s docstring. Between the E2M1 neighbours lo <= |v| < hi, with
f = (|v| - lo) / (hi - lo), a value rounds up iff X + rbyte >= 256, X = floor(256 f + 1/2): with 8 random bits
P(up) = X / 256, and rounding 256 f to the nearest integer leaves |X / 256 - f| <= 1/512, the bias bound of 8
random bits (a relative bias of (hi - lo) / 512 at most). Inputs of the kernel tests have a unit block scale:
with amax 6 (global encode scale 6 * 448 / 6 = 448) a block whose largest magnitude is 6 gets the E4M3 scale 448
(code 0x7E), so its scaled values are the inputs themselves. Every input and key is fixed, so each test gives
the same answer on every run; the 5 sigma limits only say how far from the ideal a fixed draw may fall.
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, IMPLS, needs_8_cpus, unpack
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4.reference import stochastic

# E2M1 magnitudes by code.
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The bias bound that 8 random bits imply, in units of the step hi - lo: P(up) is a multiple of 1/256, and the
# nearest one to f (X / 256, X = floor(256 f + 1/2)) is within half of 1/256 of it.
BIAS_BOUND = fractions.Fraction(1, 512)
SCALE_448 = 0x7E  # E4M3 bits of 448, the block scale of a block whose max is 6 when amax is 6

_encode_all_bytes = jax.jit(
    lambda u: stochastic.e2m1_encode_stochastic(u[:, None], jnp.arange(256, dtype=jnp.uint32)[None, :])
)


def sr_codes(values) -> np.ndarray:
    """The stochastic codes of float32 ``values`` [n] for every random byte 0..255: uint8 [n, 256]."""
    u = np.asarray(values, np.float32).view(np.uint32)
    return np.asarray(_encode_all_bytes(jnp.asarray(u)))


def grid_interval(v: np.ndarray) -> np.ndarray:
    """The index of lo, the largest E2M1 magnitude <= |v| (7 from 6 up)."""
    return np.searchsorted(np.array(GRID), np.abs(np.asarray(v, np.float64)), side="right") - 1


def exact_fraction(v: float) -> tuple[int, fractions.Fraction]:
    """(lo's index, f) of a float32 magnitude below 6, exactly."""
    i = int(grid_interval(np.float64(v)))
    lo, hi = fractions.Fraction(GRID[i]), fractions.Fraction(GRID[i + 1])
    return i, (fractions.Fraction(float(v)) - lo) / (hi - lo)


def assert_rounds_between_neighbours(codes: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Every code of row i is lo[i] or lo[i] + 1, and the ups are the highest bytes: the count of ups per row."""
    up = codes.astype(np.int64) - lo[:, None]
    assert np.isin(up, (0, 1)).all(), "a code that is neither neighbour"
    count = up.sum(axis=1)
    # Rounding up iff X + rbyte >= 256: the ups are the bytes 256 - X .. 255.
    np.testing.assert_array_equal(up, (np.arange(256)[None, :] >= 256 - count[:, None]).astype(np.int64))
    return count


# ---- a. the encode's exact bias, every random byte ----


def test_bias_is_within_the_bound_of_8_random_bits_for_every_step_and_boundary():
    """Each E2M1 interval at f = k/256 (no bias), at every rounding boundary (2k+1)/512 and just either side of
    it, at tiny f (below 1/512) and just below 1: the count of ups over the 256 bytes is X = floor(256 f + 1/2),
    so P(up) = X / 256, and |X / 256 - f| <= 1/512."""
    eps = 2.0**-22  # f's resolution in every interval for float32 (4 <= |v| < 6: ulp 2^-21, step 2)
    fs = [k / 256 for k in range(256)]
    for k in range(256):
        fs += [(2 * k + 1) / 512 - eps, (2 * k + 1) / 512, (2 * k + 1) / 512 + eps]
    fs += [eps, 2.0**-16, 2.0**-10, 1 - 2.0**-10, 1 - eps]
    values = np.array([GRID[i] + f * (GRID[i + 1] - GRID[i]) for i in range(7) for f in fs], np.float32)
    lo = grid_interval(values)
    counts = assert_rounds_between_neighbours(sr_codes(values), lo)
    worst = fractions.Fraction(0)
    for v, count in zip(values.tolist(), counts.tolist(), strict=True):
        f = exact_fraction(v)[1]
        assert count == int(np.floor(256 * f + fractions.Fraction(1, 2))), (v, count)
        worst = max(worst, abs(fractions.Fraction(count, 256) - f))
        assert abs(fractions.Fraction(count, 256) - f) <= BIAS_BOUND, (v, count, f)
    assert worst == BIAS_BOUND  # reached at the boundaries (2k+1)/512 themselves: the bound is tight
    # The boundaries are where X steps: (2k+1)/512 rounds up (half up), just below it does not.
    probe = np.array([GRID[i] + (2 * k + 1) / 512 * (GRID[i + 1] - GRID[i]) for i in range(7) for k in (0, 127, 255)])
    below = np.nextafter(probe.astype(np.float32), np.float32(0))
    got = assert_rounds_between_neighbours(sr_codes(probe.astype(np.float32)), grid_interval(probe))
    got_below = assert_rounds_between_neighbours(sr_codes(below), grid_interval(below))
    np.testing.assert_array_equal(got, np.tile([1, 128, 256], 7))
    np.testing.assert_array_equal(got_below, np.tile([0, 127, 255], 7))


def test_bias_bound_on_random_float32_values():
    """Many random float32 values in [0, 8): uniform ones, and uniform bit patterns (mostly tiny magnitudes,
    subnormals included). X from counting the ups over all 256 bytes equals floor(256 f + 1/2) and is within 1/512
    of f; from 6 up the code is 7 whatever the byte."""
    rng = np.random.default_rng(512)
    uniform = rng.uniform(0.0, 8.0, 20000).astype(np.float32)
    patterns = rng.integers(0, 0x41000000, 20000, dtype=np.uint32).view(np.float32)  # every float below 8.0
    values = np.concatenate([uniform, patterns])
    lo = grid_interval(values)
    codes = sr_codes(values)
    big = lo == 7
    assert big.sum() > 4000 and (codes[big] == 7).all()
    counts = assert_rounds_between_neighbours(codes[~big], lo[~big])
    # f in float64 is exact (the step is a power of two); so is 256 f + 1/2 wherever it could reach 1.
    v = values[~big].astype(np.float64)
    grid = np.array(GRID)
    f = (v - grid[lo[~big]]) / (grid[lo[~big] + 1] - grid[lo[~big]])
    np.testing.assert_array_equal(counts, np.floor(256 * f + 0.5))
    assert np.abs(counts / 256 - f).max() <= 1 / 512
    # Some of every interval; most bit patterns are below 2^-10, where X = 0 (they never move).
    assert np.all(np.bincount(lo, minlength=8) > 100)
    assert (counts[(~big[:20000]).sum() :] == 0).mean() > 0.8


def test_grid_values_saturation_nan_and_signs():
    """Grid values never move; 6 and more (inf too) give code 7, NaN 0; a negative value keeps the sign bit
    (a tiny one rounding to zero gives 8), -0.0 gives +0."""
    grid = np.array(GRID, np.float32)
    np.testing.assert_array_equal(sr_codes(grid), np.repeat(np.arange(8, dtype=np.uint8), 256).reshape(8, 256))
    big = np.array([6.0, 6.5, 7.99, 8.0, 1e30, np.finfo(np.float32).max, np.inf], np.float32)
    assert (sr_codes(big) == 7).all() and (sr_codes(-big) == 15).all()
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    assert (sr_codes(nans) == 0).all()
    assert (sr_codes(np.array([-0.0], np.float32)) == 0).all()
    # Negative values: the positive value's codes with the sign bit, also where they round to zero.
    rng = np.random.default_rng(8)
    v = np.concatenate([rng.uniform(0, 7, 2000), [1e-45, 1e-30, 1e-6, 2.0**-11]]).astype(np.float32)
    np.testing.assert_array_equal(sr_codes(-v), sr_codes(v) | 8)
    assert (sr_codes(-v[-4:]) == 8).all()


# ---- b. empirical unbiasedness through the kernels and the reference ----

# (lo's index, f, sign) for each of 15 columns, every interval at least once, plus a 6 (a unit block scale).
# f = 2^-12 never rounds up (X = 0: bias 2^-12 of a step), 1 - 2^-12 always does (X = 256).
_CASES = [
    (0, 0.2, 1), (0, 0.5, 1), (1, 0.25, 1), (1, 0.9, -1), (2, 0.5, 1), (3, 0.1, 1), (3, 0.75, 1),
    (4, 0.5, 1), (4, 0.3, -1), (5, 0.5, 1), (5, 0.8, 1), (6, 0.25, -1), (6, 0.5, 1), (6, 2.0**-12, 1),
    (2, 1 - 2.0**-12, 1),
]  # fmt: skip
UNBIASED_VALUES = np.array([s * (GRID[i] + f * (GRID[i + 1] - GRID[i])) for i, f, s in _CASES] + [6.0], np.float32)
# [512, 256]: x[r, c] = UNBIASED_VALUES[(c - r) % 16], so every 1x16 block of a row, and every 16 rows
# of a column, hold each value once (and a 6): both copies have unit scales; each value is drawn 8192 times a copy.
UNBIASED_X = UNBIASED_VALUES[(np.arange(256)[None, :] - np.arange(512)[:, None]) % 16]


@IMPLS
def test_mean_of_many_draws_is_the_input(impl):
    """Each value's mean over 32768 draws (both copies, two keys) is the input to within the bias bound and
    5 sigma of sampling; round-to-nearest misses by more wherever its error exceeds that."""
    q = impl  # jax_nvfp4 (the CPU kernels) or jax_nvfp4.reference
    x = jnp.asarray(UNBIASED_X)
    samples = []
    for key in (jax.random.key(11), jax.random.key(12)):
        # Eager: the reference's compiled quantize (by shape and spec) serves both keys.
        t = q.quantize(x, amax=6.0, rng_key=key, columnwise=True)
        assert (np.asarray(t.scale).view(np.uint8) == SCALE_448).all()
        assert (np.asarray(t.scale_t).view(np.uint8) == SCALE_448).all()
        samples += [np.asarray(q.dequantize(t)), np.asarray(q.dequantize(t, columnwise=True))]
    nearest = np.asarray(jax_nvfp4.dequantize(jax_nvfp4.quantize(x, amax=6.0)))  # the kernels' (= the reference's)
    position = (np.arange(256)[None, :] - np.arange(512)[:, None]) % 16
    unit = np.float64(nearest[position == 15][0]) / 6.0  # the dequantized value of a unit step (6 is on the grid)
    lo_index = grid_interval(UNBIASED_VALUES)
    for k, v in enumerate(UNBIASED_VALUES[:-1]):
        got = np.concatenate([s[position == k] for s in samples]).astype(np.float64) / unit
        n = got.size
        i, f = exact_fraction(abs(v))
        step = GRID[i + 1] - GRID[i]
        p = int(np.floor(256 * f + fractions.Fraction(1, 2))) / 256  # P(up) of the spec
        neighbour = np.isclose(np.abs(got)[:, None], [GRID[i], GRID[i + 1]], rtol=1e-6, atol=0).any(axis=1)
        assert neighbour.all(), (v, np.unique(got))
        limit = step * (float(BIAS_BOUND) + 5 * np.sqrt(p * (1 - p) / n)) + 1e-6  # + float slack of the unit
        assert abs(got.mean() - v) <= limit, (v, got.mean(), limit)
        rtn_error = abs(nearest[position == k][0] / unit - v)
        assert np.isclose(rtn_error, step * min(float(f), 1 - float(f)), rtol=1e-5, atol=1e-5), (v, rtn_error)
        if min(float(f), 1 - float(f)) > 0.01:  # all but the values next to the grid: round-to-nearest misses
            assert rtn_error > 2 * limit, (v, rtn_error, limit)
        assert lo_index[k] == i


# ---- c. no correlation between decisions the stream keeps apart ----

MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)  # f = 1/2 of each step: P(up) = 1/2


def midpoint_input(rows: int, cols: int) -> np.ndarray:
    """Midpoints of every step (some negative), with a 6 on each diagonal of 16 so that every 1x16 block of either
    copy, and every 16x16 tile, has a unit scale. At f = 1/2 the decision is the random byte's top bit."""
    r, c = np.arange(rows)[:, None] % 16, np.arange(cols)[None, :]
    x = MIDPOINTS[(c + 3 * r) % 7] * np.where((r + 2 * c) % 5 == 0, -1, 1)
    return np.where((c - r) % 16 == 0, 6.0, x).astype(np.float32)


def up_decisions(data, x: np.ndarray) -> np.ma.MaskedArray:
    """The round-up decisions (0/1) of packed codes of ``x``, the 6s (which cannot move) masked."""
    codes = unpack(data)[..., : x.shape[-1]] & 7
    lo = grid_interval(x)
    six = lo == 7
    assert (codes[six] == 7).all()
    d = codes.astype(np.int64) - lo
    assert np.isin(d[~six], (0, 1)).all()
    return np.ma.masked_array(d, mask=six)


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


def assert_uncorrelated(a, b, what: str) -> None:
    """|Pearson r| of the pairs (a, b) where neither is masked < 5 / sqrt(N): 5 sigma of N independent pairs."""
    a, b = np.ma.masked_array(a), np.ma.masked_array(b)
    keep = ~(np.ma.getmaskarray(a) | np.ma.getmaskarray(b))
    a, b = np.asarray(a)[keep].astype(np.float64), np.asarray(b)[keep].astype(np.float64)
    n = a.size
    assert n > 5000, (what, n)
    assert abs(a.mean() - 0.5) < 2.5 / np.sqrt(n), (what, a.mean())  # P(up) = 1/2, 5 sigma
    r = pearson(a, b)
    assert abs(r) < 5 / np.sqrt(n), f"{what}: Pearson r = {r:.4f} over {n} pairs, limit {5 / np.sqrt(n):.4f}"
    # The statistic catches a correlated stream: identical (or complementary) decisions give |r| = 1.
    assert pearson(a, a) > 0.999 and pearson(a, 1 - a) < -0.999


_ROWS, _COLS = 512, 256


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_decisions_are_uncorrelated(block_2d):
    """Through the CPU kernels (the reference's bytes, which test_random_bytes_are_uniform_and_uncorrelated
    checks directly): (i) values of a block, (ii) the same position in neighbouring blocks of a row,
    (iii) neighbouring rows, (iv) the rowwise and the columnwise copy of an element (1x16: two streams; 16x16:
    one draw, shared), (vi) two keys."""
    x = midpoint_input(_ROWS, _COLS)
    quantize = jax.jit(lambda x, key: jax_nvfp4.quantize(x, amax=6.0, rng_key=key, columnwise=True, block_2d=block_2d))
    t = quantize(jnp.asarray(x), jax.random.key(21))
    assert (np.asarray(t.scale).view(np.uint8) == SCALE_448).all()
    assert (np.asarray(t.scale_t).view(np.uint8) == SCALE_448).all()
    d = up_decisions(t.data, x)
    d_col = up_decisions(t.data_t, x.T).T
    blocks = d.reshape(_ROWS, _COLS // 16, 16)
    # (i) every pair of positions k < l of a block, over all blocks; and neighbours k, k + 1 pooled
    for k in range(16):
        for m in range(k + 1, 16):
            assert_uncorrelated(blocks[..., k], blocks[..., m], f"positions {k}, {m} of a block")
    assert_uncorrelated(blocks[..., :-1], blocks[..., 1:], "neighbours in a block")
    # (ii) the same position of neighbouring blocks; and the last value of a block with the next block's first
    assert_uncorrelated(blocks[:, :-1], blocks[:, 1:], "neighbouring blocks of a row")
    assert_uncorrelated(blocks[:, :-1, -1], blocks[:, 1:, 0], "across a block boundary")
    # (iii) neighbouring rows (within a 16x16 tile and across tiles)
    assert_uncorrelated(d[:-1], d[1:], "neighbouring rows")
    # (iv) the two copies of an element
    if block_2d:
        np.testing.assert_array_equal(d_col.filled(9), d.filled(9))  # one draw per value, shared by both copies
    else:
        assert_uncorrelated(d, d_col, "rowwise and columnwise copy")
        # The same (row, column) of the two copies' own arrays (x and x^T), whose random bytes would be the same
        # were the stream index left out of the counter.
        d_t = up_decisions(t.data_t, x.T)
        assert_uncorrelated(d[:_COLS], d_t[:, :_COLS], "the same position of x and x^T")
        assert_uncorrelated(d_col[:-1], d_col[1:], "neighbouring values of a columnwise block")
    # (vi) another key
    d2 = up_decisions(quantize(jnp.asarray(x), jax.random.key(22)).data, x)
    assert_uncorrelated(d, d2, "two keys")


@needs_8_cpus
@pytest.mark.parametrize("spec", [P("x", None), P(None, "x")], ids=["rows", "columns"])
def test_shards_draw_uncorrelated_streams(spec):
    """(v) Under jit on 8 devices each shard draws at its place in the whole tensor (tests/rht_sr/test_sr_place.py:
    sharded equals unsharded): the decisions at the same local position of neighbouring shards are uncorrelated,
    in both copies. (Without the place they would be the same: each shard's kernel numbers its blocks from 0, as
    quantizing the shards' slices apart shows.)"""
    mesh = jax.make_mesh((8,), ("x",), devices=CPUS[:8], axis_types=(AxisType.Auto,))
    x = midpoint_input(_ROWS, _COLS)
    quantize = jax.jit(lambda x: jax_nvfp4.quantize(x, amax=6.0, rng_key=jax.random.key(5), columnwise=True))
    t = quantize(jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)))
    assert t.data.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    d, d_col = up_decisions(t.data, x), up_decisions(t.data_t, x.T).T
    axis = 0 if spec[0] else 1
    shards = [np.ma.stack(np.array_split(a, 8, axis=axis)) for a in (d, d_col)]  # [8, local...]
    for s in shards:
        assert_uncorrelated(s[:-1], s[1:], f"neighbouring shards over {spec}")
        assert_uncorrelated(s[0], s[7], f"first and last shard over {spec}")
    # What the place prevents: the first two shards' slices quantized apart with one key draw the same bytes.
    part = np.array_split(x, 8, axis=axis)
    same = [up_decisions(quantize(jnp.asarray(p)).data, p) for p in part[:2]]
    assert pearson(same[0].compressed().astype(float), same[1].compressed().astype(float)) > 0.999


def test_random_bytes_are_uniform_and_uncorrelated():
    """The stream itself (the bytes the kernels must reproduce, tests elsewhere): uniform bytes (chi-square), and
    whole bytes, not only the top bit the decisions above see, uncorrelated between neighbouring values, blocks,
    rows, batch entries, the two streams and two keys."""
    shape = (2, 256, 256)
    seed = jnp.asarray(np.array([0x01234567, 0x89ABCDEF], np.uint32))
    draw = jax.jit(stochastic.random_bytes, static_argnums=(1, 2))
    r0 = np.asarray(draw(seed, shape, 0)).astype(np.float64)
    r1 = np.asarray(draw(seed, shape, 1)).astype(np.float64)
    other = np.asarray(draw(seed ^ jnp.uint32(1), shape, 0)).astype(np.float64)
    counts = np.bincount(r0.astype(np.int64).ravel(), minlength=256)
    expected = r0.size / 256
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 255 + 5 * np.sqrt(2 * 255), chi2  # chi-square with 255 degrees of freedom, 5 sigma
    # Whole bytes as the values: Pearson r the same as above (uniform 0..255 instead of 0/1).
    for a, b, what in [
        (r0[..., :-1], r0[..., 1:], "neighbouring values"),
        (r0[..., :-16], r0[..., 16:], "neighbouring blocks"),
        (r0[:, :-1], r0[:, 1:], "neighbouring rows"),
        (r0[0], r0[1], "batch entries"),
        (r0, r1, "the two streams"),
        (r0, other, "two keys"),
    ]:
        r = pearson(a.ravel(), b.ravel())
        assert abs(r) < 5 / np.sqrt(a.size), (what, r)
    # Every pair of the 16 bytes of a hash (positions within a block: bytes of one word, of different words).
    per_position = r0.reshape(-1, 16)
    for k in range(16):
        for m in range(k + 1, 16):
            r = pearson(per_position[:, k], per_position[:, m])
            assert abs(r) < 5 / np.sqrt(per_position.shape[0]), (k, m, r)
    # Each bit of the bytes is a fair coin.
    bits = (r0.astype(np.uint8)[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    assert np.all(np.abs(bits.reshape(-1, 8).mean(axis=0) - 0.5) < 2.5 / np.sqrt(r0.size))
