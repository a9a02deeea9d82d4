"""The kernels' row-scaled NVFP4 and 4over6 give the reference's bytes.

Calls the kernel backend (``ops.KERNELS``: the primitives on canonical
[B, *R, N] arrays) and compares with ``reference.*_core``. Every reference
program compiles in seconds, so the option combinations are spread over few
compilations: a fixed set covering every option pairwise on odd shapes and all
dtypes, random cases drawn by hypothesis, and the golden files (kernel only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    COMBINATION_IDS,
    COMBINATIONS,
    CPUS,
    OPTION_DTYPES,
    SEED,
    SPECIAL_VALUES,
    assert_golden,
    assert_same_bytes,
    examples,
    kernel_options,
    load,
    needs_8_cpus,
    option_cases,
    option_entries,
    option_quantize_cases,
    random_tensor,
    reference_amax,
    reference_quantize,
    unpack,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import QuantizeSpec, reference
from jax_nvfp4.ops import KERNELS
from jax_nvfp4.sharding.hlo import collectives

_reference_dequantize = jax.jit(reference.dequantize_core, static_argnames=("cols", "dtype", "e4m3_max"))


@functools.cache
def _kernel_quantize(flags: tuple):
    return jax.jit(lambda x, a, at, s: KERNELS.quantize(x, a, at, s, spec=QuantizeSpec(**dict(flags))))


def kernel_quantize(x, amax, amax_t, **opts):
    return _kernel_quantize(tuple(sorted(opts.items())))(x, amax, amax_t, SEED)


def amaxes(x, opts):
    """(amax, amax_t) of x [B, M, N] from the kernel, as quantize takes them."""
    got = jax.jit(lambda x: KERNELS.amax(x, amax_mesh_axes=None, rht_amax=opts["rht"], per_row=opts["row_scaled"]))(x)
    return got if opts["rht"] or opts["row_scaled"] else (got[0], got[0])


def check_quantize(x, opts, amax=None, amax_t=None):
    """Kernel == reference on x [B, M, N] with these options (the kernel's own amaxes by default)."""
    if amax is None:
        amax, amax_t = amaxes(x, opts)
    got = kernel_quantize(x, amax, amax_t, **opts)
    want = reference_quantize(x, amax, amax_t, SEED, **opts)
    assert len(got) == len(want) == 2 * (opts["rowwise"] + opts["columnwise"])
    for name, g, w in zip(("data", "scale", "data_t", "scale_t")[-len(got) :], got, want, strict=False):
        assert_same_bytes(g, w, name)


@pytest.mark.parametrize("layout,fos", COMBINATIONS, ids=COMBINATION_IDS)
def test_every_option_combination(layout, fos):
    """Both copies of odd, ragged [3, 37, 41] inputs, each dtype in turn (the RHT: in the random cases)."""
    i = COMBINATIONS.index((layout, fos))
    check_quantize(
        option_entries(np.random.default_rng(i), (37, 41), OPTION_DTYPES[i % len(OPTION_DTYPES)]),
        kernel_options(layout, fos),
    )


# Each example compiles a reference program (seconds): a quarter of the profile's examples.
@settings(max_examples=examples(10))
@given(case=option_quantize_cases())
def test_quantize_matches_reference(case):
    x, opts, scale = case
    amax, amax_t = amaxes(x, opts)
    if scale is not None:
        amax, amax_t = amax * np.float32(scale[0]), amax_t * np.float32(scale[1])
    check_quantize(x, opts, amax, amax_t)


@settings(max_examples=examples(20))
@given(
    x=st.builds(
        lambda seed, rows, cols, dtype, specials: jnp.asarray(
            random_tensor(np.random.default_rng(seed), (2, rows, cols), dtype, spread=4.0, specials=specials, frac=0.05)
        ),
        st.integers(0, 2**32 - 1),
        st.sampled_from([16, 32, 48]),
        st.integers(1, 300),
        st.sampled_from(OPTION_DTYPES),
        st.sets(st.sampled_from(sorted(SPECIAL_VALUES))).map(tuple),
    ),
    rht=st.booleans(),
)
def test_row_scaled_amax(x, rht):
    got = jax.jit(lambda x: KERNELS.amax(x, amax_mesh_axes=None, rht_amax=rht, per_row=True))(x)
    want = reference_amax(x, rht_amax=rht, per_row=True)
    assert len(got) == 2
    for g, w, name in zip(got, want, ("amax", "amax_t"), strict=True):
        assert_same_bytes(g, w, name)


def test_row_scaled_amax_of_several_row_axes_keeps_them():
    """x [B, *R, N]: amax [B, *R] (the one shape of a per-row amax, which quantize takes back), amax_t [B, N]."""
    x = option_entries(np.random.default_rng(5), (4, 16, 24), ml_dtypes.bfloat16)  # [3, 4, 16, 24]
    amax, amax_t = jax.jit(lambda x: KERNELS.amax(x, amax_mesh_axes=None, rht_amax=True, per_row=True))(x)
    flat = x.reshape(3, 64, 24)
    want = reference_amax(flat, rht_amax=True, per_row=True)
    assert_same_bytes(amax, want[0].reshape(3, 4, 16), "amax")
    assert_same_bytes(amax_t, want[1], "amax_t")
    opts = kernel_options("row_scaled", ("mse", True, 256), rht=True)
    got = jax.jit(lambda x, a, at: KERNELS.quantize(x, a, at, SEED, spec=QuantizeSpec(**opts)))(x, amax, amax_t)
    for g, w in zip(got, reference_quantize(flat, want[0], amax_t, SEED, **opts), strict=True):
        assert_same_bytes(g.reshape(w.shape), w)


@pytest.mark.parametrize("row_scaled", [False, True])
@pytest.mark.parametrize("e4m3_max", [448, 256])
def test_dequantize(row_scaled, e4m3_max):
    rng = np.random.default_rng(int(row_scaled) + e4m3_max)
    x = option_entries(rng, (33, 45), np.float32)
    opts = kernel_options("row_scaled" if row_scaled else "1x16", ("mse", False, e4m3_max) if e4m3_max != 448 else None)
    amax, amax_t = amaxes(x, opts)
    data, scale, data_t, scale_t = kernel_quantize(x, amax, amax_t, **opts)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for d, s, a, cols in ((data, scale, amax, 45), (data_t, scale_t, amax_t, 33)):
            got = jax.jit(functools.partial(KERNELS.dequantize, cols=cols, dtype=dtype, e4m3_max=e4m3_max))(d, s, a)
            want = _reference_dequantize(d, s, a, cols=cols, dtype=dtype, e4m3_max=e4m3_max)
            assert_same_bytes(got, want, str(dtype))


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("mode", ["mae", "mse"])
def test_ties_keep_map6_and_a_smaller_map4_error_wins(mode, block_2d):
    # amax = 6 E makes ges = 1, so a block with max 12 has s6 = 2 (0x40) and s4 = 3 (0x44).
    x = np.zeros((1, 16, 32), np.float32)
    x[0, 0, :2] = [12, -12]  # exact on both grids: a tie, map-6
    x[0, 0, 16:18] = [12, 9]  # 9 rounds to 8 on map-6, is 3 * 3 on map-4
    opts = kernel_options("16x16" if block_2d else "1x16", (mode, False, 448))
    amax = jnp.full((1,), 6.0 * 448, jnp.float32)
    data, scale, _, scale_t = kernel_quantize(jnp.asarray(x), amax, amax, **opts)
    codes = unpack(np.asarray(data))[0, 0]
    assert np.asarray(scale).view(np.uint8)[0, 0].tolist() == [0x40, 0x44]
    assert codes[:2].tolist() == [7, 15] and codes[16:18].tolist() == [6, 5]
    if block_2d:  # x^T's block (1, 0) holds the columns 16 and 17: map-4 too
        assert np.asarray(scale_t).view(np.uint8)[0, [0, 16], 0].tolist() == [0x40, 0x44]


def test_16x16_copies_choose_on_their_own_errors():
    """Golden tiles whose row errors and column errors pick differently: the columnwise copy is not the
    rowwise copy transposed (both are the golden bytes, test_golden_through_the_kernel)."""
    differ = 0
    for name in option_cases():
        if name.startswith("4o6sel_2d_"):
            _, x, opts = load(name)
            amax = reference.amax_core(x[None])[0]
            outs = kernel_quantize(x[None], amax, amax, rht=False, stochastic_rounding=False, **opts)
            tiles, tiles_t = (np.asarray(outs[k]).view(np.uint8)[0, ::16] for k in (1, 3))  # [M/16, N/16], [N/16, M/16]
            differ += int(np.sum(tiles != tiles_t.T))
    assert differ > 0


@pytest.mark.parametrize("name", option_cases())
def test_golden_through_the_kernel(name):
    """The row-scaled and 4over6 golden files, byte for byte, from the kernels on [1, M, N]."""
    g, x, opts = load(name)
    row_scaled = opts.get("row_scaled", False)
    amax, amax_t = amaxes(x[None], {"rht": False, "row_scaled": row_scaled})
    outs = kernel_quantize(x[None], amax, amax_t, rht=False, stochastic_rounding=False, **opts)
    data, scale, *columnwise = (o[0] for o in outs)
    assert_golden(g, opts["columnwise"], data, scale, amax[0], *(columnwise or (None, None)), amax_t[0])


@pytest.mark.parametrize(
    "opts",
    [
        {"row_scaled": True, "block_2d": True},
        {"e4m3_max": 256},
        {"four_over_six_error": "mae", "stochastic_rounding": True},
        {"four_over_six_error": "max"},
    ],
)
def test_undefined_option_combinations_raise(opts):
    full = kernel_options("1x16", None) | opts
    x = jnp.ones((1, 16, 16), jnp.float32)
    amax = jnp.ones((1, 16), jnp.float32) if full["row_scaled"] else jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError):
        KERNELS.quantize(x, amax, amax, SEED, spec=QuantizeSpec(**full))


# ---- sharding: a row's amax reduces over the column shards, a column's over the row shards ----


@needs_8_cpus
@pytest.mark.parametrize("rht", [False, True])
def test_sharded_row_scaled_amax_and_quantize(rht):
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:8], axis_types=(AxisType.Auto,) * 2)
    x = option_entries(np.random.default_rng(9), (64, 256), ml_dtypes.bfloat16)[:1]
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "x", "y")))
    opts = kernel_options("row_scaled", ("mae", False, 448), rht=rht)

    def run(x):
        amax, amax_t = KERNELS.amax(x, amax_mesh_axes=None, rht_amax=rht, per_row=True)
        data, scale, *columnwise = KERNELS.quantize(x, amax, amax_t, SEED, spec=QuantizeSpec(**opts))
        return amax, amax_t, data, scale, *columnwise, KERNELS.dequantize(data, scale, amax, cols=256, dtype=x.dtype)

    want = run(x)
    f = jax.jit(run)
    got = f(xs)
    for g, w in zip(got, want, strict=True):
        assert_same_bytes(g, w)
    assert got[0].sharding.spec == P(None, "x") and got[1].sharding.spec == P(None, "y")
    # The values stay put: the only collectives reduce the local amaxes, of 32 rows over "y" and of 64 columns
    # over "x" (max of int32 bits).
    found = collectives(f.lower(xs).compile().as_text())
    assert sorted(c[:3] for c in found) == [("all-reduce", "s32", (1, 32)), ("all-reduce", "s32", (1, 64))]
