"""ragged_dot: y, dx and dW are each group's GEMMs of the quantized operands (public quantize + gemm): bit for bit
where the float32 sums are exact, within the float32 bound of another order of summation otherwise."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, assert_same_bytes, examples, needs_8_cpus
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4 import NVFP4Tensor, QuantizeSpec, Recipe, dequantize, gemm, quantize
from jax_nvfp4.sharding.hlo import collectives

BLOCK = 16


def _rowwise_spec(spec: QuantizeSpec) -> QuantizeSpec:
    """How a copy decodes as a rowwise tensor: its scaling, no transform (it cancels in the GEMM)."""
    return QuantizeSpec(
        row_scaled=spec.row_scaled, four_over_six_error=spec.four_over_six_error, e4m3_max=spec.e4m3_max
    )


def _rows(t: NVFP4Tensor, lo: int, hi: int) -> NVFP4Tensor:
    """Rows lo..hi of a rowwise [M, L] tensor."""
    amax = t.amax[lo:hi] if t.spec.row_scaled else t.amax
    return NVFP4Tensor(t.data[lo:hi], t.scale[lo:hi], amax, None, None, None, (hi - lo, t.shape[1]), t.dtype, t.spec)


def _column_blocks(t: NVFP4Tensor, first: int, end: int) -> NVFP4Tensor:
    """The columnwise copy of [M, L], token blocks first..end-1 only, as the rowwise tensor [L, tokens]."""
    tokens = min(BLOCK * end, t.shape[0]) - BLOCK * first
    data = t.data_t[:, first * BLOCK // 2 : first * BLOCK // 2 + -(-tokens // 2)]
    scale = t.scale_t[:, first : first + -(-tokens // BLOCK)]
    spec = _rowwise_spec(t.spec)
    return NVFP4Tensor(data, scale, t.amax_t, None, None, None, (t.shape[1], tokens), t.dtype, spec)


def _transposed(t: NVFP4Tensor) -> NVFP4Tensor:
    """A 16x16-block weight's columnwise copy as the rowwise tensor of its transpose."""
    return NVFP4Tensor(t.data_t, t.scale_t, t.amax_t, None, None, None, t.shape[::-1], t.dtype, _rowwise_spec(t.spec))


def _operand_spec(recipe: Recipe, operand: str, rows: int, columnwise: bool) -> QuantizeSpec:
    return dataclasses.replace(recipe.spec(operand, columnwise=columnwise, tokens=rows), rowwise=not columnwise)


def _magnitudes(a: NVFP4Tensor, c: NVFP4Tensor) -> np.ndarray:
    """sum_k |a_ik c_jk| of the two copies' decoded values (global scales included): the float32 bound's scale."""
    va, vc = (np.abs(np.asarray(dequantize(t), np.float64)) for t in (a, c))
    return va @ vc.T


def per_group(x, w, sizes, dy, recipe: Recipe, key=None):
    """y, dx, dW from each group's GEMMs: the recipe's copies made by the public quantize, multiplied by gemm;
    and for each, sum |a_i c_i| over its contraction (the float32 accumulation's error bound, ``_assert_close``)."""
    m, groups = x.shape[0], w.shape[0]
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    ids = np.searchsorted(ends, np.arange(m), side="right")
    valid = (ids < groups)[:, None]
    keys = [None] * (groups + 1) if key is None else list(jax.random.split(key, groups + 1))
    qx = quantize(jnp.where(valid, x, 0), _operand_spec(recipe, "x", m, False))
    qdy = quantize(jnp.where(valid, dy, 0), _operand_spec(recipe, "dy", m, False), rng_key=keys[0])
    y = np.zeros((m, w.shape[2]), jnp.result_type(x, w))
    dx, dw = np.zeros(x.shape, x.dtype), np.zeros(w.shape, w.dtype)
    sums = [np.zeros(a.shape) for a in (y, dx, dw)]
    for g, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        if hi == lo:
            continue  # an empty group: no rows, a zero weight gradient
        qw = quantize(w[g].T, recipe.spec("w", columnwise=True, tokens=w.shape[2]))
        operands = [(_rows(qx, lo, hi), qw), (_rows(qdy, lo, hi), _transposed(qw))]
        y[lo:hi], dx[lo:hi] = (gemm(a, c, out.dtype) for (a, c), out in zip(operands, (y, dx), strict=True))
        sums[0][lo:hi], sums[1][lo:hi] = (_magnitudes(a, c) for a, c in operands)
        # The group's rows alone (the rest zero), blocked on the global 16-row grid: its blocks only.
        mine = (ids == g)[:, None]
        cx = quantize(jnp.where(mine, x, 0), _operand_spec(recipe, "x", m, True))
        cdy = quantize(jnp.where(mine, dy, 0), _operand_spec(recipe, "dy", m, True), rng_key=keys[1 + g])
        first, end = lo // BLOCK, -(-hi // BLOCK)
        a, c = _column_blocks(cdy, first, end), _column_blocks(cx, first, end)
        dw[g], sums[2][g] = gemm(a, c, dw.dtype).T, _magnitudes(a, c).T
    return (y, dx, dw), sums


def _vjp(x, w, sizes, dy, recipe, key=None):
    def f(x, w):
        return jax_nvfp4.ragged_dot(x, w, sizes, recipe=recipe, rng_key=key)

    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy.astype(y.dtype)))


def _problem(m, k, n, groups, seed=0, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) * 0.1).astype(dtype)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
    return x, w, dy


E2M1_MAGNITUDES = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _grid(rng, shape, six_rows, dtype):
    """E2M1 values with random signs, +-6 in every 16th column and in the rows ``six_rows``."""
    v = rng.choice(E2M1_MAGNITUDES, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    v[:, ::BLOCK] = 6.0 * np.sign(v[:, ::BLOCK])
    v[six_rows] = 6.0 * np.sign(v[six_rows])
    return jnp.asarray(v, dtype)


def _exact_problem(m, k, n, sizes, seed=0, dtype=jnp.bfloat16):
    """Operands whose GEMM sums are exact in float32 in any order (without the RHT): every 1x16 block of x and
    dy, every piece of a 16-token block that a group holds and every 16x16 tile of W holds a +-6 among
    values of the E2M1 grid, so every block scale is 448 and every decoded value a multiple of 224 below
    2688: a product is a multiple of 224^2 below 144 of them, and a sum of fewer than 2^17 is exact."""
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.minimum(np.cumsum(sizes), m)[:-1]])
    six_rows = np.union1d(np.arange(0, m, BLOCK), starts[starts < m])
    x, dy = _grid(rng, (m, k), six_rows, dtype), _grid(rng, (m, n), six_rows, dtype)
    w = jnp.stack([_grid(rng, (n, k), np.arange(0, n, BLOCK), dtype).T for _ in sizes])
    return x, w, dy


def _assert_close(got, want, sums, length: int):
    """|got - want| within two float32 accumulations of ``length`` terms in different orders (each off by at most
    (length - 1) u sum|a_i c_i|, u = 2^-24), the epilogue's float32 products (u each) and the roundings of both
    to the output dtype (one of its ulps)."""
    eps = float(jnp.finfo(np.asarray(want).dtype).eps)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = (2 * length + 4) * 2.0**-24 * sums + eps * np.abs(want)
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) - tol))


def _check_per_group(m, k, n, sizes, recipe, key=None, dtype=jnp.bfloat16, exact=False):
    """ragged_dot's y, dx and dW against each group's GEMMs: the same bytes for operands whose float32 sums are
    exact (``exact``), else within the float32 bound of two orders of summation."""
    sizes = np.asarray(sizes, np.int32)
    x, w, dy = _exact_problem(m, k, n, sizes, dtype=dtype) if exact else _problem(m, k, n, len(sizes), dtype=dtype)
    got = jax.jit(functools.partial(_vjp, recipe=recipe, key=key))(x, w, jnp.asarray(sizes), dy)
    want, sums = per_group(x, w, sizes, dy, recipe, key)
    for name, g, e, s, length in zip(("y", "dx", "dW"), got, want, sums, (k, n, m), strict=True):
        if exact:
            assert_same_bytes(g, e), name
        else:
            _assert_close(g, e, s, length), name
    return got


NO_SR = Recipe(stochastic_rounding=False)
EXACT = Recipe(rht=False)  # the RHT's values are not the exact problems' grid; stochastic rounding keeps grid values


# Groups that cut 16-row blocks (first: 5 | 0 | 27), an empty group, a one-row group, rows past the last group.
CASES = {
    "cut blocks": (64, 32, 48, [5, 0, 27, 1, 19]),
    "ragged tail, no rht": (37, 40, 24, [0, 16, 3, 15]),
    "rows past the groups": (48, 16, 16, [7, 20, 0]),
}


@pytest.mark.parametrize("case", CASES)
def test_ragged_dot_is_each_groups_gemms(case):
    """Bit for bit where the float32 sums are exact (stochastic rounding on, its keys as documented)."""
    _check_per_group(*CASES[case], EXACT, key=jax.random.key(1), exact=True)


def test_full_recipe_is_each_groups_gemms_to_float32_order():
    """The full recipe (RHT, stochastic rounding) on random values, within the float32 bound."""
    _check_per_group(*CASES["cut blocks"], Recipe(), key=jax.random.key(2))


def test_stochastic_rounding_uses_the_documented_keys():
    key = jax.random.key(7)
    y, dx, dw = _check_per_group(48, 32, 16, [20, 0, 28], Recipe(), key=key)
    # Another key rounds dy differently: dx and dW move, y does not.
    y2, dx2, dw2 = jax.jit(functools.partial(_vjp, recipe=Recipe(), key=jax.random.key(8)))(
        *_problem(48, 32, 16, 3)[:2], jnp.array([20, 0, 28]), _problem(48, 32, 16, 3)[2]
    )
    assert_same_bytes(y, y2)
    assert not np.array_equal(np.asarray(dx), np.asarray(dx2)) and not np.array_equal(np.asarray(dw), np.asarray(dw2))


def test_recipe_options_per_group():
    """Per-token scales (x, dy; their wgrad copies per feature of each group) and 4over6 for all operands."""
    recipe = Recipe(
        stochastic_rounding=False,
        row_scaled_activations=True,
        row_scaled_gradients=True,
        four_over_six=jax_nvfp4.FourOverSix("all"),
    )
    _check_per_group(48, 32, 32, [9, 30, 9], recipe)


@settings(max_examples=examples(12))
@given(
    m=st.integers(1, 70),
    k=st.sampled_from([16, 32, 24]),
    n=st.sampled_from([16, 40]),
    cuts=st.lists(st.integers(0, 70), min_size=0, max_size=4),
)
def test_random_group_sizes(m, k, n, cuts):
    bounds = np.sort(np.minimum(cuts, m))
    sizes = np.diff(np.concatenate([[0], bounds, [m]]))
    _check_per_group(m, k, n, sizes, EXACT, key=jax.random.key(m), exact=True)


def test_a_cut_block_is_the_group_quantized_alone_with_leading_zeros():
    """Group g's wgrad copy = its rows, padded in front by start mod 16 zero rows, quantized on their own."""
    x, w, dy = _problem(48, 32, 16, 2)
    sizes = jnp.array([21, 27])
    dw = jax.jit(functools.partial(_vjp, recipe=NO_SR))(x, w, sizes, dy)[2]
    pad = lambda v: jnp.concatenate([jnp.zeros((21 % BLOCK, v.shape[1]), v.dtype), v[21:]])  # noqa: E731
    cx, cdy = (quantize(pad(v), columnwise=True, rht=True) for v in (x, dy))
    a, c = _column_blocks(cdy, 0, 2), _column_blocks(cx, 0, 2)
    _assert_close(dw[1], gemm(a, c, w.dtype).T, _magnitudes(a, c).T, 32)


def test_close_to_lax_ragged_dot_and_zero_past_the_groups():
    x, w, dy = _problem(64, 64, 32, 3)
    sizes = jnp.array([10, 30, 14])
    y, dx, dw = jax.jit(functools.partial(_vjp, recipe=Recipe(), key=jax.random.key(0)))(x, w, sizes, dy)
    y16, vjp = jax.vjp(lambda x, w: lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32), x, w)
    dx16, dw16 = vjp(dy.astype(jnp.float32))
    for got, want in ((y, y16), (dx, dx16), (dw, dw16)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) < 0.25 * np.linalg.norm(want)
    assert not np.any(np.asarray(y)[54:]) and not np.any(np.asarray(dx)[54:])
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype


def test_errors():
    x, w, _ = _problem(32, 16, 16, 2)
    sizes = jnp.array([16, 16])
    with pytest.raises(TypeError, match="bfloat16, float16 or float32 operands, lhs is int32"):
        jax_nvfp4.ragged_dot(x.astype(jnp.int32), w, sizes)
    with pytest.raises(ValueError, match=r"lhs \[M, K\], rhs \[G, K, N\]"):
        jax_nvfp4.ragged_dot(x, w, sizes[:1])
    with pytest.raises(TypeError, match="group_sizes must be integers"):
        jax_nvfp4.ragged_dot(x, w, sizes.astype(jnp.float32))
    with pytest.raises(NotImplementedError, match="group_offset"):
        jax_nvfp4.ragged_dot(x, w, sizes, group_offset=jnp.array([0]))
    with pytest.raises(ValueError, match="rng_key"):  # raised while tracing
        jax.jit(jax.grad(lambda x: jnp.sum(jax_nvfp4.ragged_dot(x, w, sizes).astype(jnp.float32))))(x)


@needs_8_cpus
def test_expert_and_data_sharding_equals_unsharded_and_moves_no_weights():
    """Experts over "expert", tokens over "data" (8 CPU devices): the unsharded results, the weights stay put.

    The grouped quantize keeps the token rows whole, so x (forward) and dy (backward) are gathered for it
    once each; nothing else of their size or of the weights' crosses devices: the other collectives are
    the float32 GEMM results' reductions, the amaxes and the group sizes.
    """
    mesh = jax.make_mesh((2, 4), ("expert", "data"), devices=CPUS[:8], axis_types=(AxisType.Auto,) * 2)
    m, k, n, groups = 256, 64, 128, 4
    x, w, dy = _problem(m, k, n, groups)
    sizes = jnp.array([50, 0, 130, 60], jnp.int32)
    grads = jax.jit(functools.partial(_vjp, recipe=NO_SR))
    want = grads(*jax.device_put((x, w, sizes, dy), CPUS[0]))  # on the CPU as the mesh, also on a GPU machine
    named = functools.partial(NamedSharding, mesh)
    args = (
        jax.device_put(x, named(P("data"))),
        jax.device_put(w, named(P("expert"))),
        jax.device_put(sizes, named(P())),
        jax.device_put(dy, named(P("data"))),
    )
    grads = jax.jit(grads, out_shardings=(named(P("data")), named(P("data")), named(P("expert"))))
    got = grads(*args)
    assert_same_bytes(got[0], want[0])  # y and dx: each row is its own GEMM rows, wherever it runs
    assert_same_bytes(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want[2]))))
    found = collectives(grads.lower(*args).compile().as_text())
    gathered = {c.shape[-2:] for c in found if c.op == "all-gather" and c.nbytes > 4 * groups * k}
    assert gathered == {(m, k), (m, n)}, found  # x and dy, once each
    others = [c for c in found if c.op != "all-gather"]
    assert {c.op for c in others} <= {"all-reduce", "collective-permute"}, found
    assert all(c.dtype in ("f32", "s32") for c in found), found
    assert all(c.nbytes < m * k * 2 for c in others if c.op == "collective-permute"), found
