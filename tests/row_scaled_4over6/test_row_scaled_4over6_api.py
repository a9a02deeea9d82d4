"""The public API of row-scaled (per-token) NVFP4 and 4over6: metadata, errors, round trip, jit/vmap, GEMM.

Through ``jax_nvfp4.reference`` (the frontend over the pure-JAX spec); the
option checks run before any backend call, so they hold for the kernels too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    E2M1,
    IMPLS,
    assert_same_bytes,
    assert_same_tensor,
    canonical_zero_codes,
    load,
    needs_8_cpus,
    random_normal,
    tensor_of_codes,
    values64,
)
from helpers.numpy_eval import evaluate
from jax import lax

import jax_nvfp4
from jax_nvfp4 import reference


def _quantize_by_numpy(x, **options):
    """reference.quantize run by NumPy (helpers.numpy_eval): the same program, held to XLA and the golden files by
    tests/quantize/test_numpy_eval.py, without an XLA compile of the bit-level quantize for each case. Tests of
    jit, vmap and the golden bytes under jit call reference.quantize itself."""
    return evaluate(reference.quantize, x, **options)


def _dequantize_by_numpy(t, **options):
    """reference.dequantize run by NumPy, as _quantize_by_numpy."""
    return evaluate(reference.dequantize, t, **options)


def _gaussian(shape=(32, 64), seed=0, dtype=jnp.float32):
    return random_normal(shape, seed, dtype)


def _decode64(data, scale, amax, e4m3_max: int, cols: int) -> np.ndarray:
    """E2M1 * E4M3 * amax / (6 E) in float64, amax per tensor or per row (a column vector)."""
    return values64(data, scale, cols) * (np.asarray(amax, np.float64) / (6 * e4m3_max))


# ---- the tensor: metadata, layout, bytes ----


def test_row_scaled_tensor_layout_and_metadata():
    x = _gaussian((3, 8, 48), dtype=jnp.bfloat16)
    t = _quantize_by_numpy(x, columnwise=True, row_scaled=True)
    assert (t.spec.row_scaled, t.spec.e4m3_max, t.spec.block_2d, t.spec.rht) == (True, 448, False, False)
    assert t.amax.shape == (3, 8) and t.amax.dtype == jnp.float32  # one per row, in x's leading shape
    assert t.amax_t.shape == (48,)  # one per column of x (row of x^T)
    xf = np.abs(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(t.amax), xf.max(-1))
    np.testing.assert_array_equal(np.asarray(t.amax_t), xf.reshape(-1, 48).max(0))
    np.testing.assert_array_equal(np.asarray(reference.amax(x, row_scaled=True)), xf.max(-1))
    # The columnwise copy is the row-scaled quantization of x^T, amaxes included.
    tt = _quantize_by_numpy(x.reshape(24, 48).T, row_scaled=True)
    assert_same_bytes(t.data_t, tt.data)
    assert_same_bytes(t.scale_t, tt.scale)
    assert_same_bytes(t.amax_t, tt.amax)
    # Defaults: one amax per tensor, E = 448.
    plain = _quantize_by_numpy(x)
    assert (plain.spec.row_scaled, plain.spec.e4m3_max, plain.amax.shape) == (False, 448, ())


def test_4over6_records_e4m3_max_and_keeps_the_layout():
    x = _gaussian((40, 72), dtype=jnp.bfloat16)
    t = _quantize_by_numpy(x, columnwise=True, four_over_six_error="mse", e4m3_max=256)
    plain = _quantize_by_numpy(x, columnwise=True)
    assert (t.spec.e4m3_max, t.spec.row_scaled) == (256, False)
    for name in ("data", "scale", "data_t", "scale_t"):
        assert getattr(t, name).shape == getattr(plain, name).shape
    assert_same_bytes(t.amax, plain.amax)  # the amax is max|x| either way; E changes the scales
    assert _quantize_by_numpy(x, four_over_six_error="mae").spec.e4m3_max == 448


@pytest.mark.parametrize(
    "name",
    # tests/quantize/test_golden.py runs the reference under jit on one or two files of each family.
    ["rowscaled_both_64x128_bf16.npz", "4o6_2d_mse_exact_e448_128x256_bf16.npz"],
)
def test_public_reference_quantize_gives_the_golden_bytes(name):
    g, x, options = load(name)
    t = jax.jit(lambda x: reference.quantize(x, **options))(x)
    assert t.spec.row_scaled == options.get("row_scaled", False) and t.spec.e4m3_max == options.get("e4m3_max", 448)
    np.testing.assert_array_equal(np.asarray(t.data), g["data"])
    np.testing.assert_array_equal(np.asarray(t.scale).view(np.uint8), g["scale"][: x.shape[0]])
    np.testing.assert_array_equal(np.asarray(t.data_t), g["data_t"])
    np.testing.assert_array_equal(np.asarray(t.scale_t).view(np.uint8), g["scale_t"][: x.shape[1]])
    amax, amax_t = (g["amax_row"], g["amax_col"]) if t.spec.row_scaled else (g["amax_row"][0], g["amax_col"][0])
    assert np.asarray(t.amax).tobytes() == amax.astype(np.float32).tobytes()
    assert np.asarray(t.amax_t).tobytes() == amax_t.astype(np.float32).tobytes()


# ---- dequantize reads the tensor's amax and E ----


@pytest.mark.parametrize(
    "options",
    [
        dict(row_scaled=True),
        dict(four_over_six_error="mse", e4m3_max=256),
        dict(row_scaled=True, four_over_six_error="mae"),
    ],
    ids=["row_scaled", "4over6_e256", "row_scaled_4over6"],
)
def test_dequantize_reads_amax_and_e4m3_max_from_the_tensor(options):
    x = _gaussian((2, 16, 48), seed=1)
    t = _quantize_by_numpy(x, columnwise=True, **options)
    amax = np.asarray(t.amax)[..., None] if t.spec.row_scaled else np.asarray(t.amax)
    want = _decode64(t.data, t.scale, amax, t.spec.e4m3_max, 48)
    np.testing.assert_allclose(np.asarray(_dequantize_by_numpy(t)), want, rtol=2.0**-22, atol=0)
    amax_t = np.asarray(t.amax_t)[:, None] if t.spec.row_scaled else np.asarray(t.amax_t)
    want_t = _decode64(t.data_t, t.scale_t, amax_t, t.spec.e4m3_max, 32)  # [N, M]
    got_t = np.asarray(_dequantize_by_numpy(t, columnwise=True))
    np.testing.assert_allclose(got_t.reshape(32, 48).T, want_t, rtol=2.0**-22, atol=0)


def test_row_scaled_round_trip_with_the_tensors_amax():
    """Requantizing the dequantized tensor with its own per-row amax gives the same bytes."""
    x = _gaussian((2, 8, 64), seed=2, dtype=jnp.bfloat16) * jnp.logspace(-4, 4, 16).reshape(2, 8, 1).astype(
        jnp.bfloat16
    )
    for options in (dict(), dict(four_over_six_error="mse"), dict(four_over_six_error="mae", e4m3_max=256)):
        q = _quantize_by_numpy(x, row_scaled=True, **options)
        r = _quantize_by_numpy(_dequantize_by_numpy(q), row_scaled=True, amax=q.amax, **options)
        assert_same_bytes(canonical_zero_codes(r.data), canonical_zero_codes(q.data))
        assert_same_bytes(r.scale, q.scale)
        assert_same_bytes(r.amax, q.amax)
    # A given per-row amax equal to the computed one gives the same tensor.
    assert_same_tensor(
        _quantize_by_numpy(x, row_scaled=True, amax=reference.amax(x, row_scaled=True)),
        _quantize_by_numpy(x, row_scaled=True),
    )


# ---- what the options buy ----


def test_row_scaling_keeps_rows_of_very_different_magnitudes():
    """Rows 10^-8 .. 10^0 of the largest: one global scale underflows the small rows' block scales."""
    x = np.asarray(_gaussian((32, 64), seed=3)) * np.logspace(-8, 0, 32, dtype=np.float32)[:, None]

    def row_errors(t):
        y = np.asarray(_dequantize_by_numpy(t), np.float64)
        return np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1)

    row_scaled = row_errors(_quantize_by_numpy(x, row_scaled=True))
    per_tensor = row_errors(_quantize_by_numpy(x))
    assert row_scaled.max() < 0.15, row_scaled
    assert per_tensor.max() > 0.99  # the smallest rows come back as zeros
    assert per_tensor.max() > 6 * row_scaled.max()


@pytest.mark.parametrize("block_2d", [False, True])
def test_4over6_lowers_the_mean_round_trip_error(block_2d):
    x = np.asarray(_gaussian((64, 256), seed=4))

    def errors(**options):
        y = np.asarray(_dequantize_by_numpy(_quantize_by_numpy(x, block_2d=block_2d, **options)), np.float64)
        return np.mean((y - x) ** 2), np.mean(np.abs(y - x))

    plain_mse, plain_mae = errors()
    for e4m3_max in (448, 256):
        mse, _ = errors(four_over_six_error="mse", e4m3_max=e4m3_max)
        assert mse < (0.9 if not block_2d else 0.999) * plain_mse
    if not block_2d:
        _, mae = errors(four_over_six_error="mae")
        assert mae < 0.97 * plain_mae


# ---- errors ----


@IMPLS
@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(row_scaled=True, block_2d=True), "1x16 blocks only"),
        (dict(four_over_six_error="max"), "four_over_six_error must be None or one of"),
        (dict(four_over_six_error="MSE"), "four_over_six_error must be None or one of"),
        (dict(four_over_six_error="mse", e4m3_max=300), "e4m3_max must be 448 or 256"),
        (dict(four_over_six_error="mse", e4m3_max=True), "e4m3_max must be 448 or 256"),
        (dict(e4m3_max=256), "applies only with 4over6"),
        (dict(four_over_six_fast_math=True), "four_over_six_fast_math applies only with 4over6"),
        (dict(four_over_six_error="mae", rng_key=jax.random.key(0)), "no stochastic rounding"),
        (dict(row_scaled=True, amax=1.0), r"one amax per row, shape x.shape\[:-1\] = \(32,\)"),
        (dict(row_scaled=True, amax=jnp.ones(64)), "one amax per row"),
        (dict(row_scaled=True, amax=jnp.ones(32), columnwise=True), "one per column"),
        (dict(row_scaled=True, amax=jnp.ones(32), amax_mesh_axes="x"), "amax_mesh_axes applies only"),
    ],
)
def test_unsupported_combinations_raise_clear_errors(impl, options, match):
    with pytest.raises(ValueError, match=match):
        impl.quantize(jnp.ones((32, 64), jnp.float32), **options)


# ---- pytree, jit, vmap ----


def test_pytree_jit_and_vmap_keep_the_new_fields():
    x = _gaussian((4, 16, 32), seed=5, dtype=jnp.bfloat16) * jnp.arange(1, 5, dtype=jnp.bfloat16)[:, None, None]
    t = reference.quantize(x[0], columnwise=True, row_scaled=True, four_over_six_error="mse", e4m3_max=256)
    leaves, treedef = jax.tree.flatten(t)
    assert len(leaves) == 6  # the arrays; row_scaled and e4m3_max are static metadata
    assert_same_tensor(jax.tree.unflatten(treedef, leaves), t)
    through_jit = jax.jit(lambda t: t)(t)
    assert (through_jit.spec.row_scaled, through_jit.spec.e4m3_max) == (True, 256)
    assert_same_bytes(jax.jit(reference.dequantize)(t), reference.dequantize(t))
    # Tensors of different metadata are different pytree structures (jit retraces, tree ops refuse to mix).
    assert jax.tree.structure(reference.quantize(x)) != jax.tree.structure(reference.quantize(x, row_scaled=True))

    # vmap: each entry quantized on its own, per-row amaxes stacked.
    batched = jax.vmap(lambda x: reference.quantize(x, columnwise=True, row_scaled=True))(x)
    assert batched.amax.shape == (4, 16) and batched.amax_t.shape == (4, 32) and batched.spec.row_scaled
    deq = jax.vmap(reference.dequantize)(batched)
    for i in range(4):
        single = reference.quantize(x[i], columnwise=True, row_scaled=True)
        assert_same_tensor(jax.tree.map(lambda a, i=i: a[i], batched), single)
        assert_same_bytes(deq[i], reference.dequantize(single))


# ---- RHT with row scales ----


def test_row_scaled_rht_copy_has_per_column_amaxes_of_the_transform():
    x = _gaussian((64, 32), seed=6, dtype=jnp.bfloat16)
    t = _quantize_by_numpy(x, columnwise=True, rht=True, row_scaled=True)
    from jax_nvfp4.core import bits

    transformed = bits.from_bits(evaluate(lambda b: reference.rht_columns(b, x.dtype), bits.to_bits(x[None])))[0]
    np.testing.assert_array_equal(np.asarray(t.amax_t), np.abs(np.asarray(transformed, np.float32)).max(1))
    est = _quantize_by_numpy(x, columnwise=True, rht=True, rht_amax_factor=2.0, row_scaled=True)
    want = np.abs(np.asarray(x, np.float32)).max(0) * np.float32(2.0)
    np.testing.assert_array_equal(np.asarray(est.amax_t), want)
    with pytest.raises(ValueError, match="Random Hadamard"):
        reference.dequantize(t, columnwise=True)


# ---- the GEMM with row scales ----


def test_row_scaled_gemm_is_exact_when_float32_can_hold_it():
    """Scales in [1, 2), row decode scales powers of two: every sum and product is exact."""
    rng = np.random.default_rng(0)
    m, n, k = 24, 40, 64
    codes_a, codes_c = rng.integers(0, 16, (m, k)), rng.integers(0, 16, (n, k))
    scales_a, scales_c = rng.integers(0x38, 0x40, (m, k // 16)), rng.integers(0x38, 0x40, (n, k // 16))
    row_a = 2688.0 * 2.0 ** rng.integers(-20, 20, m)
    row_c = 1536.0 * 2.0 ** rng.integers(-20, 20, n)  # E = 256: decode scale amax / 1536
    va = E2M1[codes_a] * np.repeat(scales_a.astype(np.uint8).view(ml_dtypes.float8_e4m3fn), 16, 1).astype(float)
    vc = E2M1[codes_c] * np.repeat(scales_c.astype(np.uint8).view(ml_dtypes.float8_e4m3fn), 16, 1).astype(float)
    a = tensor_of_codes(codes_a, scales_a, row_a, row_scaled=True)
    for c, col_scale in (
        (tensor_of_codes(codes_c, scales_c, row_c, row_scaled=True, e4m3_max=256), row_c / 1536),
        (tensor_of_codes(codes_c, scales_c, 2688.0 * 8), np.full(n, 8.0)),
    ):
        want = (va @ vc.T) * (row_a / 2688)[:, None] * col_scale[None, :]
        np.testing.assert_array_equal(np.asarray(jax_nvfp4.gemm(a, c)), want)


_GEMM_CASES = {
    "a_rows": (dict(row_scaled=True), dict(block_2d=True)),
    "c_rows": (dict(), dict(row_scaled=True)),
    "both_rows_4over6": (dict(row_scaled=True, four_over_six_error="mse", e4m3_max=256), dict(row_scaled=True)),
    "per_tensor_e256": (dict(four_over_six_error="mae", e4m3_max=256), dict(four_over_six_error="mse")),
}


@pytest.mark.parametrize("case", _GEMM_CASES)
def test_gemm_scales_in_the_documented_order(case):
    """y = fp32(fp32(fp32(acc * g) * s_a[i]) * s_c[j]), acc the float32 sum of exact block products.

    acc comes from the same codes with a neutral global scale; the rest is replayed in numpy float32.
    Against float64: only the k additions and at most three products round.
    """
    opts_a, opts_c = _GEMM_CASES[case]
    rng = np.random.default_rng(1)
    x = np.asarray(_gaussian((2, 12, 80), seed=7)) * np.logspace(-3, 3, 12, dtype=np.float32)[:, None]
    w = np.asarray(_gaussian((20, 80), seed=8)) * rng.uniform(0.01, 100, (20, 1)).astype(np.float32)
    a, c = reference.quantize(x, **opts_a), reference.quantize(w, **opts_c)
    got = np.asarray(jax_nvfp4.gemm(a, c))
    assert got.shape == (2, 12, 20) and got.dtype == np.float32

    def neutral(t):  # decode scale exactly 1
        return dataclasses.replace(t, amax=jnp.float32(2688), spec=jax_nvfp4.QuantizeSpec())

    acc = np.asarray(jax_nvfp4.gemm(neutral(a), neutral(c))).reshape(24, 20)
    f32 = np.float32
    sa = np.asarray(a.amax, f32).reshape(-1) / f32(6 * a.spec.e4m3_max)
    sc = np.asarray(c.amax, f32).reshape(-1) / f32(6 * c.spec.e4m3_max)
    y = acc
    if not a.spec.row_scaled and not c.spec.row_scaled:
        y = y * (sa[0] * sc[0])
    elif not (a.spec.row_scaled and c.spec.row_scaled):
        y = y * (sc[0] if a.spec.row_scaled else sa[0])
    if a.spec.row_scaled:
        y = y * sa[:, None]
    if c.spec.row_scaled:
        y = y * sc[None, :]
    np.testing.assert_array_equal(got.reshape(24, 20), y)

    # float64: exact products of the dequantized values, with the decode scales' own roundings.
    va = values64(a.data, a.scale, 80).reshape(24, 80) * (sa[:, None] if a.spec.row_scaled else sa[0])
    vc = values64(c.data, c.scale, 80) * (sc[:, None] if c.spec.row_scaled else sc[0])
    want = va @ vc.T
    bound = (80 + 4) * 2.0**-24 * (np.abs(va) @ np.abs(vc).T)
    assert (np.abs(got.reshape(24, 20) - want) <= bound).all()
    # The dequantized tensors give the same product.
    deq = np.asarray(reference.dequantize(a), np.float64).reshape(24, 80) @ np.asarray(reference.dequantize(c)).T
    assert (np.abs(deq - want) <= 2.0**-21 * (np.abs(va) @ np.abs(vc).T)).all()


def test_nan_in_a_row_scaled_operand_poisons_only_its_row():
    x = np.array(_gaussian((16, 32), seed=9))
    x[3, 5] = np.nan
    y = np.asarray(
        jax_nvfp4.gemm(reference.quantize(x, row_scaled=True), reference.quantize(_gaussian((8, 32), seed=10)))
    )
    assert np.isnan(y[3]).all() and not np.isnan(np.delete(y, 3, axis=0)).any()
    assert np.isnan(np.asarray(jax_nvfp4.gemm(reference.quantize(x), reference.quantize(_gaussian((8, 32)))))).all()


def test_gemm_checks_a_row_scaled_operands_amax_shape():
    from jax_nvfp4.linear.gemm import batched_gemm

    t = reference.quantize(_gaussian((16, 32)), row_scaled=True)
    # A batch of one [1, 16, 32] whose amax is [16], not [1, 16].
    op = jax_nvfp4.NVFP4Tensor(
        t.data[None], t.scale[None], t.amax, None, None, None, (1, 16, 32), t.dtype, t.spec, True
    )
    with pytest.raises(ValueError, match=r"amax must be \[B, \*R\]"):
        batched_gemm(op, op, jnp.float32)


# ---- all_gather in shard_map ----


@needs_8_cpus
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_of_a_row_scaled_tensor(axis):
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices("cpu")[:8], axis_types=(AxisType.Auto,))
    x = _gaussian((128, 8 * 16), seed=11) * jnp.logspace(-4, 4, 128).reshape(128, 1)

    def gather(x):
        amax = reference.amax(x, row_scaled=True)
        if axis == 1:  # each row is split over the shards: share its amax
            amax = lax.pmax(amax, "x")
        g = jax_nvfp4.all_gather(reference.quantize(x, row_scaled=True, amax=amax), "x", axis=axis)
        # The columnwise copy with each shard's own per-column amaxes.
        c = jax_nvfp4.all_gather(reference.quantize(x, columnwise=True, row_scaled=True), "x", axis=axis)
        return g.data, g.scale, g.amax, c.data_t, c.amax_t

    spec = P("x", None) if axis == 0 else P(None, "x")
    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=spec, out_specs=(P(),) * 5, check_vma=False))
    data, scale, amax, data_t, amax_t = f(x)
    want = reference.quantize(x, columnwise=True, row_scaled=True)
    for got, expected in ((data, want.data), (scale, want.scale), (amax, want.amax)):
        assert_same_bytes(got, expected)
    if axis == 1:  # each column's rows are all on its shard
        assert_same_bytes(data_t, want.data_t)
        assert_same_bytes(amax_t, want.amax_t)
    else:  # the shards' per-column amaxes differ: NaN, not wrongly scaled values
        assert np.isnan(np.asarray(amax_t)).all()
