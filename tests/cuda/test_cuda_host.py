"""The CUDA kernels give the CPU kernels' bytes: every kernel and option, run on the CPU by the
CUDA host execution model (tests/helpers/cuda_host.py), on Hopper's code paths and on sm_100a's.

Each case runs one function twice, once over the CPU kernels (``jax_nvfp4``) and once over the
CUDA kernels (``cuda_host``), and compares the bytes. Shapes stay small: a few blocks of each
kernel exercise the same paths as many (ragged edges, several tiles, stripes and amax chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    COMBINATION_IDS,
    COMBINATIONS,
    DTYPES,
    OPTION_DTYPES,
    RECIPE_OPTIONS,
    SEED,
    assert_golden,
    assert_same_bytes,
    assert_same_tensor,
    assert_same_tree,
    cases,
    cuda_host,
    examples,
    kernel_options,
    load,
    option_cases,
    option_entries,
    option_quantize_cases,
    quantize_options,
    quantize_with_options,
    random_tensor,
    tensors,
)
from helpers.cuda_host import needs_module
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import QuantizeSpec
from jax_nvfp4.ops import KERNELS

pytestmark = needs_module
# Hopper (sm_90, the software E2M1 rounding) and sm_100a (its FP4 convert instruction, through
# the host equivalent of nvfp4/ptx.h).
SMS = (90, 100)


def both(fn, *args, sm: int = 90):
    """fn(api, *args) jitted over the CUDA kernels and over the CPU kernels: (cuda, cpu) results."""
    with cuda_host.emulating(sm):
        got = jax.jit(lambda *a: fn(cuda_host, *a))(*args)
    return got, jax.jit(lambda *a: fn(jax_nvfp4, *a))(*args)


def both_kernels(fn, *args, sm: int = 90):
    """fn(backend, *args) over the CUDA and the CPU kernel backends: (cuda, cpu) results."""
    with cuda_host.emulating(sm):
        got = jax.jit(lambda *a: fn(cuda_host.BACKEND, *a))(*args)
    return got, jax.jit(lambda *a: fn(KERNELS, *a))(*args)


@given(x=tensors(), opts=quantize_options, sm=st.sampled_from(SMS))
def test_quantize(x, opts, sm):
    assert_same_tensor(*both(lambda api, x: api.quantize(x, **opts), x, sm=sm))


@given(
    x=tensors(max_dim=40),
    amax=st.sampled_from([0.0, 1e-30, 3.0, 1e30, np.inf, np.nan, -2.0]),
    block_2d=st.booleans(),
    sm=st.sampled_from(SMS),
)
def test_quantize_with_given_amax(x, amax, block_2d, sm):
    def quantize(api, x, a):  # a traced amax: NaN and negative ones are not refused (a concrete one would be)
        return api.quantize(x, columnwise=True, block_2d=block_2d, amax=a)

    assert_same_tensor(*both(quantize, x, jnp.float32(amax), sm=sm))


# Products that land exactly on E2M1's rounding thresholds: with amax 6 * 448 the global scale
# is 1 and a block whose max is 6 has scale 1.0, so x * enc == x (and with max 3, 2x). The
# round-down ties (0.25, 1.25, 2.5, 5) need the kernel's tie-safe code index (cuda/e2m1_lut.cuh).
TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.25, -2.5, -5.0, -0.0, 0.0, 1.0, -6.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("sm", SMS)
def test_exact_ties_take_the_tie_safe_index(dtype, block_2d, sm):
    row = np.array(TIES, np.float32)
    x = jnp.asarray(np.stack([np.roll(row, k) * (0.5 if k % 2 else 1.0) for k in range(32)]), dtype)

    def quantize(api, x):
        return api.quantize(x, columnwise=True, block_2d=block_2d, amax=jnp.float32(6 * 448))

    got, want = both(quantize, x, sm=sm)
    assert_same_tensor(got, want)
    # The ties were hit: the reference rounds 1.25 down to 1.0 (code 2) and -2.5 to -2 (code 12).
    codes = np.asarray(want.data[0]).view(np.uint8)
    assert (codes[1] >> 4, codes[5] & 0xF) == (2, 12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sm", SMS)
def test_exact_ties_row_scaled(dtype, sm):
    """Row-scaled copies take a tie-safe index always (pair_code_safe on sm_90): every row and column
    amax 6 * 448 makes the products the values themselves, ties included."""
    row = np.array(TIES, np.float32)
    x = jnp.asarray(np.stack([np.roll(row, k) * (0.5 if k % 2 else 1.0) for k in range(32)])[None], dtype)
    amax, amax_t = jnp.full((1, 32), 6.0 * 448, jnp.float32), jnp.full((1, 16), 6.0 * 448, jnp.float32)
    spec = QuantizeSpec(columnwise=True, row_scaled=True)
    got, want = both_kernels(lambda backend, x: backend.quantize(x, amax, amax_t, SEED, spec=spec), x, sm=sm)
    assert_same_tree(got, want)
    codes = np.asarray(want[0][0, 0]).view(np.uint8)
    assert (codes[1] >> 4, codes[5] & 0xF) == (2, 12)  # 1.25 -> 1.0, -2.5 -> -2: the ties were hit


# Stochastic rounding's zero and tiny products: -0.0 gives code 0, a tiny negative product code 8.
# Each block holds `big`, so that with amax 3e38 its encode scale is about 2^-125 and the small
# bfloat16 values' products underflow: x * enc + 0 is +0.0 (code 0) where one FFMA would give -0.0
# (code 8), so the kernel must leave its fast index (cuda/e2m1_lut.cuh, underflow_possible).
SMALL = [-0.0, 0.0, -(2.0**-133), 2.0**-133, -1e-30, -6e-8, -1e-38, -(2.0**-24), -0.3, 1.0]


@pytest.mark.parametrize("amax", [6.0 * 448, 1e30, 3e38])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("sm", SMS)
def test_stochastic_rounding_of_zeros_and_underflows(amax, dtype, block_2d, sm):
    big = min(amax, float(ml_dtypes.finfo(dtype).max))
    row = np.array(SMALL + [big] * (16 - len(SMALL)), np.float32)
    x = jnp.asarray(np.stack([np.roll(row, k) * (-1.0 if k % 3 else 1.0) for k in range(32)]), dtype)

    def quantize(api, x):
        return api.quantize(x, columnwise=True, block_2d=block_2d, amax=jnp.float32(amax), rng_key=jax.random.key(11))

    got, want = both(quantize, x, sm=sm)
    assert_same_tensor(got, want)


FOS = [("mse", False, 256), ("mse", True, 256), ("mae", False, 448), ("mae", True, 448)]


@pytest.mark.parametrize("fos", FOS, ids=["-".join(map(str, f)) for f in FOS])
@pytest.mark.parametrize("sm", SMS)
def test_4over6_at_extreme_and_tie_amaxes(fos, sm):
    """4over6's faster path (four_over_six.cuh: class values, per-block units of the exact error)
    against the CPU at amaxes that take it (1, 6 E: products on the E2M1 ties) and that leave it for
    the reference path (tiny, huge, inf), one batch entry each."""
    mode, fast_math, e4m3_max = fos
    row = np.array(TIES, np.float32)
    ties = np.stack([np.roll(row, k) * (0.5 if k % 2 else 1.0) for k in range(32)])
    rng = np.random.default_rng(7)
    wide = (rng.standard_normal((32, 16)) * np.exp(rng.uniform(-8, 8, (32, 16)))).astype(np.float32)
    amaxes = [1.0, 6.0 * e4m3_max, 1e-36, 3e-33, 1e33, 3e38, np.inf]
    # Even entries: the wide values scaled to the entry's amax, so that tiny and huge amaxes give
    # finite errors on the reference path.
    scaled = [wide * np.float32(a / np.abs(wide).max()) if np.isfinite(a) else wide for a in amaxes]
    x = jnp.asarray(np.stack([ties if i % 2 else scaled[i] for i in range(len(amaxes))]), jnp.bfloat16)
    amax = jnp.asarray(amaxes, jnp.float32)
    spec = QuantizeSpec(columnwise=True, four_over_six_error=mode, four_over_six_fast_math=fast_math, e4m3_max=e4m3_max)
    got, want = both_kernels(lambda backend, x: backend.quantize(x, amax, amax, SEED, spec=spec), x, sm=sm)
    assert_same_tree(got, want)


def test_e2m1_tables_are_exhaustively_right():
    """Over every float32 bit pattern but signalling NaNs (arithmetic makes none), in one pass:
    the tie-safe index of the E2M1 code table gives float_to_e2m1's code; the fast index and the
    pair table's code of the float16 truncation do too but for the round-down ties and -0.0, the
    cases the kernel rules out before taking them (cuda/e2m1_lut.cuh), and the pair table's code
    of the truncated tie-safe bits (pair_code_safe) with no exception."""
    assert cuda_host.module.e2m1_tables_mismatches() == (0, 0, 0, 9, 0)


def test_sr_arithmetic_is_exhaustively_right():
    """Stochastic rounding's position by float16 arithmetic (sr_pair_sums: the truncations of the product and of
    2^15 (|product| + 1)) is sr_position's, clamped to 7 * 256, for every float32 magnitude in both halves of
    a word; and its codes in both halves are float_to_e2m1_stochastic's for every float16 value and random
    byte, which covers every (position, random byte, sign) a product can have (cuda/e2m1_lut.cuh)."""
    assert cuda_host.module.sr_arithmetic_mismatches() == (0, 0)


@given(x=tensors(), out_dtype=st.sampled_from(DTYPES), block_2d=st.booleans())
def test_dequantize_and_amax(x, out_dtype, block_2d):
    t = jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d)

    def dequantize(api, t):
        return api.dequantize(t, out_dtype), api.dequantize(t, out_dtype, columnwise=True)

    assert_same_tree(*both(dequantize, t))
    assert_same_bytes(*both(lambda api, x: api.amax(x), x))


AMAX_SPECIALS = np.array([0.0, -0.0, np.inf, np.nan, 1e-42, 3e38, -5.0], np.float32)


@settings(max_examples=examples(120))
@given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 9),
    blocks=st.integers(1, 5),
    ragged=st.sampled_from([0, 0, 1, 9, 15]),
    per_row=st.booleans(),
    out_dtype=st.sampled_from(DTYPES),
    e4m3_max=st.sampled_from([448, 256]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_any_codes_scales_and_amaxes(batch, rows, blocks, ragged, per_row, out_dtype, e4m3_max, seed):
    """Every code and scale byte (NaN scales too) and special amaxes (0, inf, NaN, subnormal, huge,
    negative), one per entry or per row: whole 16-value blocks (the block kernel, its decode and
    its reference path) and ragged rows (the byte kernel)."""
    rng = np.random.default_rng(seed)
    cols = 16 * blocks - ragged
    data = rng.integers(0, 256, (batch, rows, (cols + 1) // 2), np.uint8)
    scale = rng.integers(0, 256, (batch, rows, blocks), np.uint8).view(ml_dtypes.float8_e4m3fn)
    amax = np.abs(rng.standard_normal((batch, rows) if per_row else (batch,))).astype(np.float32) * 100
    amax = np.where(rng.random(amax.shape) < 0.2, rng.choice(AMAX_SPECIALS, amax.shape), amax)

    def dequantize(backend, data, scale, amax):
        return (backend.dequantize(data, scale, amax, cols=cols, dtype=out_dtype, e4m3_max=e4m3_max),)

    assert_same_tree(*both_kernels(dequantize, data, scale, amax))


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_loops_over_blocks(per_row, out_dtype):
    """More 16-value blocks (3 x 70 x 41) than the block kernel's grid has threads times its unroll:
    each thread loops, its global scale switching between and within unrolled steps."""
    rng = np.random.default_rng(5)
    batch, rows, blocks = 3, 70, 41
    data = rng.integers(0, 256, (batch, rows, 8 * blocks), np.uint8)
    scale = rng.integers(0, 256, (batch, rows, blocks), np.uint8).view(ml_dtypes.float8_e4m3fn)
    amax = rng.uniform(0.5, 500.0, (batch, rows) if per_row else (batch,)).astype(np.float32)
    amax.flat[::7] = np.inf

    def dequantize(backend, data, scale, amax):
        return (backend.dequantize(data, scale, amax, cols=16 * blocks, dtype=out_dtype, e4m3_max=448),)

    assert_same_tree(*both_kernels(dequantize, data, scale, amax))


@pytest.mark.parametrize("shape", [(64, 80), (2, 48, 33), (32, 300)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", RECIPE_OPTIONS)
def test_rht_and_stochastic_rounding(shape, dtype, name):
    """The RHT with its fused and its estimated amax, and stochastic rounding: the same key, the same bytes."""
    opts = dict(RECIPE_OPTIONS[name])
    stochastic = opts.pop("stochastic_rounding", False)
    x = random_tensor(np.random.default_rng(3), shape, dtype, spread=3, specials=("zero", "subnormal"), frac=0.05)

    def quantize(api, x):
        key = jax.random.key(11) if stochastic else None
        return api.quantize(x, columnwise=True, rng_key=key, **opts)

    assert_same_tensor(*both(quantize, x))


@given(case=option_quantize_cases(), sm=st.sampled_from(SMS))
def test_row_scaled_and_4over6(case, sm):
    """Row-scaled and 4over6 (MAE/MSE, exact/fast math, E 448/256) on random shapes, amaxes and values."""
    x, opts, scale = case
    assert_same_tree(*both_kernels(quantize_with_options(opts, scale), x, sm=sm))


@pytest.mark.parametrize("layout,fos", COMBINATIONS, ids=COMBINATION_IDS)
def test_every_option_combination(layout, fos):
    """Each 4over6 and layout combination on [3, 37, 41]: wide values; zeros, subnormals and outliers; inf and NaN."""
    i = COMBINATIONS.index((layout, fos))
    x = option_entries(np.random.default_rng(i), (37, 41), OPTION_DTYPES[i % len(OPTION_DTYPES)])
    assert_same_tree(*both_kernels(quantize_with_options(kernel_options(layout, fos)), x))


# Ragged and degenerate shapes: one row, one column, odd N, M and N off 16 and off the kernels'
# 128/256-column tiles, several tiles, stripes and amax chunks, batch dims.
SHAPES = [(1, 1), (1, 16), (16, 1), (1, 33), (17, 2), (3, 17, 33), (2, 3, 5, 18), (130, 260), (2, 300, 17)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_ragged_shapes(shape, dtype):
    x = random_tensor(np.random.default_rng(0), shape, dtype, spread=2.0, specials=("zero", "nan"), frac=0.01)
    for block_2d in (False, True):

        def run(api, x, block_2d=block_2d):
            t = api.quantize(x, columnwise=True, block_2d=block_2d)
            return t, api.dequantize(t), api.dequantize(t, columnwise=True), api.amax(x)

        (t, *rest), (u, *rest_cpu) = both(run, x)
        assert_same_tensor(t, u)
        assert_same_tree(rest, rest_cpu)


@pytest.mark.parametrize("layout,fos", [("row_scaled", None), ("row_scaled", ("mse", True, 256))])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 16, 300), (2, 45, 67), (1, 300, 16)])
def test_row_scaled_ragged_shapes(shape, layout, fos):
    x = random_tensor(np.random.default_rng(4), shape, np.float32, spread=4.0, specials=("zero", "inf"), frac=0.02)
    assert_same_tree(*both_kernels(quantize_with_options(kernel_options(layout, fos)), x))


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("shape", [(1, 32, 300), (2, 48, 33), (3, 16, 1), (2, 160, 700)])
def test_amax_with_atomics_across_threads(shape, rht):
    """The amax kernels fold block maxima with atomicMax; here the blocks run on 4 threads."""
    x = random_tensor(np.random.default_rng(1), shape, np.float32, spread=6.0, specials=("nan", "inf"), frac=1e-3)
    with cuda_host.threads(4):
        for row_scaled in (False, True):
            got, want = both_kernels(
                lambda backend, x, r=row_scaled: backend.amax(x, amax_mesh_axes=None, rht_amax=rht, per_row=r), x
            )
            assert_same_tree(got, want)


@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 7, 8), (1, 96, 1000), (2, 5, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_of_any_values(shape, dtype):
    """The global amax of each batch entry: the vector kernel (entries of whole 16-byte vectors,
    its unrolled steps partly past the end) and the element kernel; its maximum, inf or NaN at any
    place, each magnitude in either half of a packed word."""
    rng = np.random.default_rng(sum(shape))
    for special in (None, np.inf, np.nan, -np.inf):
        x = random_tensor(rng, shape, dtype, spread=5.0, specials=("zero", "subnormal"), frac=0.05)
        if special is not None:
            x.reshape(shape[0], -1)[:, rng.integers(x[0].size)] = special
        assert_same_tree(
            *both_kernels(lambda backend, x: backend.amax(x, amax_mesh_axes=None, rht_amax=False, per_row=False), x)
        )


@pytest.mark.parametrize("e4m3_max", [448, 256])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_row_scaled_dequantize(out_dtype, e4m3_max):
    x = random_tensor(np.random.default_rng(2), (2, 45, 67), np.float32, spread=4.0, specials=("zero",), frac=0.05)
    fos = ("mse", True, e4m3_max) if e4m3_max != 448 else None
    amax, amax_t, data, scale, data_t, scale_t = jax.jit(
        lambda x: quantize_with_options(kernel_options("row_scaled", fos))(KERNELS, x)
    )(x)

    def dequantize(backend, data, scale, amax, data_t, scale_t, amax_t):
        return (
            backend.dequantize(data, scale, amax, cols=67, dtype=out_dtype, e4m3_max=e4m3_max),
            backend.dequantize(data_t, scale_t, amax_t, cols=45, dtype=out_dtype, e4m3_max=e4m3_max),
        )

    assert_same_tree(*both_kernels(dequantize, data, scale, amax, data_t, scale_t, amax_t))


@pytest.mark.parametrize("sm", SMS)
@pytest.mark.parametrize("name", cases() + option_cases())
def test_golden(name, sm):
    """Every golden file, the CUDA kernels through the public quantize."""
    g, x, opts = load(name)
    with cuda_host.emulating(sm):
        t = jax.jit(lambda x: cuda_host.quantize(x, **opts))(x)
    assert_golden(g, opts["columnwise"], t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t)
