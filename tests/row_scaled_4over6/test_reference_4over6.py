"""Row-scaled NVFP4 and 4over6 in the pure-JAX reference: the rules the golden files pin, and properties."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SEED, load, unpack
from helpers.numpy_eval import evaluate

from jax_nvfp4 import QuantizeSpec, reference
from jax_nvfp4.core import bits
from jax_nvfp4.reference import four_over_six as fos


def _core_quantize(x, amax, amax_t=None, **options):
    """quantize_core of [B, R, C], traced afresh (so a monkeypatched helper is traced) and run by NumPy
    (helpers.numpy_eval: the same program, held to XLA and the golden files in tests/quantize/test_numpy_eval.py,
    without an XLA compile of the bit-level program for each case)."""
    options = {
        "rowwise": True,
        "columnwise": False,
        "block_2d": False,
        "rht": False,
        "stochastic_rounding": False,
    } | options
    core = functools.partial(reference.quantize_core, spec=QuantizeSpec(**options))
    outs = evaluate(core, x, amax, amax if amax_t is None else amax_t, SEED)
    return [np.asarray(o).view(np.uint8) if o.dtype.itemsize == 1 else np.asarray(o) for o in outs]


E4M3 = {2.0: 0x40, 3.0: 0x44}


@pytest.mark.parametrize("e4m3_max", [448, 256])
@pytest.mark.parametrize("fast_math", [False, True])
@pytest.mark.parametrize("mode", fos.ERROR_MODES)
def test_ties_keep_map6_and_a_smaller_map4_error_wins(mode, fast_math, e4m3_max):
    # amax = 6E makes ges = 1, so a chunk with max 12 has s6 = 2 and s4 = 3.
    x = np.zeros((1, 1, 32), np.float32)
    x[0, 0, :2] = [12, -12]  # exact on both grids (+-6 * 2, +-4 * 3): err4 == err6 == 0
    x[0, 0, 16:18] = [12, 9]  # 9 = 4.5 * 2 rounds to 8 on map-6, is 3 * 3 on map-4
    amax = jnp.full((1,), 6.0 * e4m3_max, jnp.float32)
    opts = {"four_over_six_error": mode, "four_over_six_fast_math": fast_math, "e4m3_max": e4m3_max}
    data, scale = _core_quantize(jnp.asarray(x), amax, **opts)
    codes = unpack(data)[0, 0]
    assert scale[0, 0].tolist() == [E4M3[2.0], E4M3[3.0]]
    assert codes[:2].tolist() == [7, 15]  # map-6: +-6
    assert codes[16:18].tolist() == [6, 5]  # map-4: 4, 3

    # The tie is a true one: both candidates' errors are +0.
    g = reference.GlobalScales(bits.to_bits(amax).reshape(1, 1, 1), e4m3_max)
    blocks = bits.to_bits(jnp.asarray(x)).reshape(1, 1, 2, 1, 16)[:, :, :1]
    scales = jnp.asarray([[[[E4M3[2.0]]]], [[[E4M3[3.0]]]]], jnp.uint8)
    enc = jnp.stack([reference.block_encode_scale(s, g.decode) for s in scales])
    codes = reference.e2m1_encode(bits.mul(blocks, enc[..., None, None]))
    err = np.asarray(fos.chunk_errors(blocks, codes, scales, g, mode, fast_math))
    assert err.ravel().tolist() == [0, 0]


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def test_2d_tree_sum_is_not_the_sequential_sum():
    # 1 + 2^-24 rounds back to 1 (ties to even) one addend at a time; the tree first adds the small ones.
    r = np.array([1.0] + [2.0**-24] * 15, np.float32)
    sequential = functools.reduce(np.add, r)
    tree = r
    while tree.size > 1:
        tree = tree[: tree.size // 2] + tree[tree.size // 2 :]  # r_i + r_{i+8}, then +4, +2, +1
    assert sequential == np.float32(1) and tree[0] == np.float32(1 + 7 * 2.0**-23)
    r_bits = jnp.asarray(r.view(np.uint32))
    assert _f32(fos.tree_sum(r_bits)) == tree[0]
    assert _f32(fos.sequential_sum(r_bits)) == sequential


def _at_most(a, c, less=fos.less):
    return ~less(c, a)


# Each documented rule, broken on purpose, changes the bytes of a golden file that pins it.
BROKEN_RULES = {
    "ties go to map-4": ("4o6sel_1d_mae_exact_e448_64x128_bf16.npz", "less", _at_most),
    "16x16 row errors summed in order": ("4o6sel_2d_mae_exact_e256_64x128_bf16.npz", "tree_sum", fos.sequential_sum),
    "chunk elements summed as a tree": ("4o6sel_1d_mse_exact_e448_64x128_bf16.npz", "sequential_sum", fos.tree_sum),
}


@pytest.mark.parametrize("rule", [*BROKEN_RULES, "exact and fast_math swapped"])
def test_golden_files_pin_the_rule(rule, monkeypatch):
    name = BROKEN_RULES.get(rule, ("4o6sel_1d_mse_fast_e448_64x128_bf16.npz",))[0]
    g, x, options = load(name)
    if rule in BROKEN_RULES:
        _, attr, broken = BROKEN_RULES[rule]
        monkeypatch.setattr(fos, attr, broken)
    else:
        options["four_over_six_fast_math"] = not options["four_over_six_fast_math"]
    amax = reference.amax_core(x[None])[0]
    data, scale, data_t, scale_t = (o[0] for o in _core_quantize(x[None], amax, **options))
    outs = {"data": data, "scale": scale, "data_t": data_t, "scale_t": scale_t}
    assert not all(np.array_equal(a, g[k][: a.shape[0]]) for k, a in outs.items())


def _roundtrip_mse(x, options) -> float:
    amax = reference.amax_core(x)[0]
    data, scale = _core_quantize(x, amax, **options)
    scale = jnp.asarray(scale).view(jnp.float8_e4m3fn)
    e4m3_max = options.get("e4m3_max", 448)
    deq = reference.dequantize_core(data, scale, amax, cols=x.shape[-1], dtype=jnp.float32, e4m3_max=e4m3_max)
    return float(np.mean((np.asarray(deq) - np.asarray(x, np.float32)) ** 2))


@pytest.mark.parametrize("e4m3_max", [448, 256])
@pytest.mark.parametrize("fast_math", [False, True])
def test_4over6_mse_roundtrip_error_is_at_most_plain(fast_math, e4m3_max):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((1, 64, 256)) * np.exp(rng.standard_normal((1, 64, 1))), jnp.bfloat16)
    plain = _roundtrip_mse(x, {})
    options = {"four_over_six_error": "mse", "four_over_six_fast_math": fast_math, "e4m3_max": e4m3_max}
    assert _roundtrip_mse(x, options) <= plain


@pytest.mark.parametrize("four_over_six", [None, "mae"])
def test_row_scaled_is_one_global_quantization_per_row(four_over_six):
    """Row-scaled [1, M, N] == M independent tensors [1, N] (batch entries with their own amax), both copies."""
    rng = np.random.default_rng(3)
    m, n = 32, 48
    x = jnp.asarray(rng.standard_normal((1, m, n)) * 10.0 ** rng.integers(-3, 4, (1, m, 1)), jnp.bfloat16)
    opts = {"four_over_six_error": four_over_six}
    amax_rows, amax_cols = reference.amax_core(x, per_row=True)
    np.testing.assert_array_equal(amax_rows[0], np.abs(np.asarray(x[0], np.float32)).max(axis=1))
    np.testing.assert_array_equal(amax_cols[0], np.abs(np.asarray(x[0], np.float32)).max(axis=0))
    data, scale, data_t, scale_t = _core_quantize(x, amax_rows, amax_cols, columnwise=True, row_scaled=True, **opts)
    rows, row_scales = _core_quantize(x.reshape(m, 1, n), amax_rows[0], **opts)
    cols, col_scales = _core_quantize(jnp.swapaxes(x, 1, 2).reshape(n, 1, m), amax_cols[0], **opts)
    np.testing.assert_array_equal(data[0], rows[:, 0])
    np.testing.assert_array_equal(scale[0], row_scales[:, 0])
    np.testing.assert_array_equal(data_t[0], cols[:, 0])
    np.testing.assert_array_equal(scale_t[0], col_scales[:, 0])

    # Dequantize: each row with its own amax / (6 * 448).
    def deq(data, scale, amax):
        scale = jnp.asarray(scale).view(jnp.float8_e4m3fn)
        return np.asarray(reference.dequantize_core(data, scale, amax, cols=n, dtype=jnp.float32))

    np.testing.assert_array_equal(deq(data, scale, amax_rows)[0], deq(rows, row_scales, amax_rows[0])[:, 0])


@pytest.mark.parametrize(
    "options",
    [
        {"row_scaled": True, "block_2d": True},
        {"e4m3_max": 256},  # only with 4over6 (TransformerEngine silently uses 448)
        {"e4m3_max": 300, "four_over_six_error": "mse"},
        {"four_over_six_error": "MAE"},
        {"four_over_six_error": "mae", "stochastic_rounding": True},
    ],
)
def test_undefined_option_combinations_raise(options):
    x = jnp.ones((1, 16, 16), jnp.float32)
    with pytest.raises(ValueError):
        _core_quantize(x, jnp.ones((1,), jnp.float32), **options)


def test_row_scaled_amax_shapes_are_checked():
    x = jnp.ones((1, 16, 32), jnp.float32)
    with pytest.raises(ValueError, match="row-scaled"):
        _core_quantize(x, jnp.ones((1,), jnp.float32), row_scaled=True)
