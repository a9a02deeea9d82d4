"""plain_dot: the recipe's GEMMs exactly, gradients, dimension numbers, transforms."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    DENSE,
    assert_same_bytes,
    columnwise_as_rowwise,
    dense_grads,
    dense_problem,
    examples,
    random_normal,
    random_tensor,
    rel_err,
    unpack,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_nvfp4
from jax_nvfp4 import Recipe, gemm, quantize

PLAIN = Recipe(rht=False, stochastic_rounding=False)  # round to nearest, no transform: the GEMMs of quantize
plain_dot = functools.partial(jax_nvfp4.dot_general, recipe=PLAIN)


def test_forward_and_backward_are_exactly_the_recipe_gemms():
    """y, dx and dW are, bit for bit, NVFP4 GEMMs of the operands each recipe step names."""
    x, w, dy = dense_problem()
    y, dx, dw = jax.jit(functools.partial(dense_grads, plain_dot))(x, w, dy)
    # fprop: x in 1x16 blocks along K; W^T [N, K] in 16x16 blocks.
    assert_same_bytes(y, gemm(quantize(x), quantize(w.T, block_2d=True), y.dtype))
    # dgrad: dy along N against W [K, N], the same 16x16 blocks seen transposed.
    assert_same_bytes(dx, gemm(quantize(dy), quantize(w, block_2d=True), x.dtype))
    # wgrad: dW [K, N] = x^T . dy, both blocked along the M tokens.
    assert_same_bytes(dw, gemm(quantize(x.T), quantize(dy.T), w.dtype))
    assert y.dtype == jnp.bfloat16 and dx.dtype == x.dtype and dw.dtype == w.dtype
    # ...and they really are quantized: bf16 GEMMs give different numbers.
    y16, dx16, dw16 = dense_grads(lax.dot_general, x, w, dy)
    for got, bf16 in ((y, y16), (dx, dx16), (dw, dw16)):
        assert not np.array_equal(np.asarray(got), np.asarray(bf16))


def test_weight_2d_blocks_share_codes_and_scales_with_their_transpose():
    w = random_normal((48, 80), 3)
    t = quantize(w, columnwise=True, block_2d=True)
    np.testing.assert_array_equal(unpack(t.data_t)[:, :48], unpack(t.data)[:, :80].T)
    scales = np.asarray(t.scale).view(np.uint8)  # [48, 5], one row per row of w
    np.testing.assert_array_equal(np.asarray(t.scale_t).view(np.uint8), scales[::16].T.repeat(16, axis=0))


def test_recipe_with_1d_weight_blocks():
    x, w, dy = dense_problem()
    dot = functools.partial(plain_dot, recipe=Recipe(weight_block_2d=False, rht=False, stochastic_rounding=False))
    y, dx, _ = dense_grads(dot, x, w, dy)
    assert_same_bytes(y, gemm(quantize(x), quantize(w.T), y.dtype))
    assert_same_bytes(dx, gemm(quantize(dy), quantize(w), x.dtype))  # W requantized along N
    y2d, _, _ = dense_grads(plain_dot, x, w, dy)
    assert not np.array_equal(np.asarray(y), np.asarray(y2d))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gradients_match_float32_closely(dtype):
    """NVFP4 errors are ~10-15%; a wrong transpose, operand or factor-2 scale gives >= 100%."""
    x, w, dy = dense_problem(96, 128, 64, dtype)
    exact = dense_grads(lambda a, b, d: lax.dot_general(a, b, d, preferred_element_type=jnp.float32), x, w, dy)
    got = dense_grads(plain_dot, x, w, dy)
    for g, e in zip(got, exact, strict=True):
        assert rel_err(g, e) < 0.2


DIMS = [
    # (lhs shape, rhs shape, dimension numbers): the ones nn.Dense / DenseGeneral / attention use.
    ((4, 6, 32), (32, 24), (((2,), (0,)), ((), ()))),
    ((4, 6, 2, 16), (2, 16, 3, 8), (((2, 3), (0, 1)), ((), ()))),  # DenseGeneral axis=(-2, -1)
    ((3, 10, 32), (3, 32, 16), (((2,), (1,)), ((0,), (0,)))),  # DenseGeneral batch_dims=(0,)
    ((10, 32, 3), (16, 3, 32), (((1,), (2,)), ((2,), (1,)))),  # batch and contract in the middle
    ((5, 7, 20), (20, 9), (((2,), (0,)), ((), ()))),  # sizes that are not multiples of 16
]


@pytest.mark.parametrize(("lhs_shape", "rhs_shape", "dims"), DIMS)
def test_dimension_numbers(lhs_shape, rhs_shape, dims):
    lhs, rhs = random_normal(lhs_shape, 4, jnp.float32), random_normal(rhs_shape, 5, jnp.float32)
    # Equal maxima in every batch slice, so one global amax equals each slice's own.
    lhs, rhs = lhs.at[(0,) * lhs.ndim].set(8.0), rhs.at[(0,) * rhs.ndim].set(8.0)
    (lb, rb) = dims[1]
    if lb:
        lhs = jnp.moveaxis(lhs, lb[0], 0).at[:, 0, 0].set(8.0)
        lhs = jnp.moveaxis(lhs, 0, lb[0])
        rhs = jnp.moveaxis(rhs, rb[0], 0).at[:, 0, 0].set(8.0)
        rhs = jnp.moveaxis(rhs, 0, rb[0])
    want = lax.dot_general(lhs, rhs, dims)
    got = plain_dot(lhs, rhs, dims)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < 0.2
    dl, dr = jax.grad(lambda a, b: jnp.sum(plain_dot(a, b, dims) * want), (0, 1))(lhs, rhs)
    el, er = jax.grad(lambda a, b: jnp.sum(lax.dot_general(a, b, dims) * want), (0, 1))(lhs, rhs)
    assert rel_err(dl, el) < 0.2 and rel_err(dr, er) < 0.2
    if lb:  # a batched GEMM is the stack of per-slice GEMMs, bit for bit
        slices = [
            plain_dot(jnp.take(lhs, i, lb[0]), jnp.take(rhs, i, rb[0]), _drop_batch(dims))
            for i in range(lhs.shape[lb[0]])
        ]
        assert_same_bytes(got, jnp.stack(slices))


def _drop_batch(dims):
    (lc, rc), (lb, rb) = dims

    def shift(axes, batch):
        return tuple(a - (a > batch[0]) for a in axes)

    return (shift(lc, lb), shift(rc, rb)), ((), ())


@settings(max_examples=examples(10))
@given(m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_any_shape_differentiates(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(random_tensor(rng, (m, k), ml_dtypes.bfloat16, spread=1, specials=("zero",), frac=0.05))
    w = jnp.asarray(random_tensor(rng, (k, n), ml_dtypes.bfloat16, spread=1, specials=("zero",), frac=0.05))
    dy = jnp.asarray(random_tensor(rng, (m, n), ml_dtypes.bfloat16, spread=1, specials=(), frac=0))
    y, dx, dw = dense_grads(plain_dot, x, w, dy)
    assert_same_bytes(y, gemm(quantize(x), quantize(w.T, block_2d=True), y.dtype))
    assert_same_bytes(dx, gemm(quantize(dy), quantize(w, block_2d=True), x.dtype))
    assert_same_bytes(dw, gemm(quantize(x.T), quantize(dy.T), w.dtype))


def test_jit_grad_vmap_compose():
    x, w, dy = dense_problem()
    loss = lambda x, w: jnp.sum(plain_dot(x, w, DENSE).astype(jnp.float32) * dy)  # noqa: E731
    eager = jax.grad(loss, (0, 1))(x, w)
    jitted = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    for a, b in zip(eager, jitted, strict=True):
        assert_same_bytes(a, b)
    # vmap over a stack of problems == each problem alone (vmap keeps one amax per problem).
    xs, ws = jnp.stack([x, 2 * x, -x]), jnp.stack([w, w * 0.5, w])
    batched = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(xs, ws)
    for i in range(3):
        single = jax.grad(loss, (0, 1))(xs[i], ws[i])
        for a, b in zip(batched, single, strict=True):
            assert_same_bytes(a[i], b)


def test_residuals_are_the_quantized_operands():
    """Backward keeps the 4-bit copies of x and W: 28% of the bytes of bf16 copies."""
    m, k, n = 256, 128, 64
    x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)

    def residual_bytes(dot):
        _, vjp = jax.vjp(lambda x, w: dot(x, w, DENSE), x, w)
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(vjp))

    nvfp4, bf16 = residual_bytes(plain_dot), residual_bytes(lax.dot_general)
    assert bf16 == 2 * (m * k + k * n)
    # Codes (1/2 byte) + one E4M3 scale per 16 values + two float32 amax.
    assert nvfp4 == (m * k + k * n) * (1 / 2 + 1 / 16) + 2 * 4
    assert nvfp4 / bf16 < 0.29  # saves 72% of the residual memory


def test_nan_input_gives_nan_output():
    x, w, _ = dense_problem()
    y = plain_dot(x.at[3, 7].set(jnp.nan), w, DENSE)
    assert np.isnan(np.asarray(y, np.float32)).all()  # one NaN poisons the tensor's amax


def test_errors_and_fallbacks():
    x, w, _ = dense_problem()
    with pytest.raises(TypeError, match="lhs is int32"):
        plain_dot(x.astype(jnp.int32), w, DENSE)
    with pytest.raises(TypeError, match="produces bfloat16, float16 or float32"):
        plain_dot(x, w, DENSE, preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="Recipe"):
        plain_dot(x, w, DENSE, recipe={"weight_block_2d": True})
    with pytest.raises(TypeError, match="must be a bool"):
        Recipe(weight_block_2d=1)
    with pytest.raises(TypeError):  # lax's own check of the dimension numbers
        plain_dot(x, w.T, DENSE)
    empty = plain_dot(jnp.ones((0, 64)), w, DENSE)
    assert empty.shape == (0, 32)
    assert plain_dot(x, w, DENSE, preferred_element_type=jnp.float32).dtype == jnp.float32


@st.composite
def _dimension_numbers(draw):
    """Random shapes and dimension numbers: 0-1 batch, 1-2 contracting, 0-2 free axes, in any order."""
    sizes = st.integers(1, 20)
    batch = draw(st.lists(sizes, max_size=1))
    contract = draw(st.lists(sizes, min_size=1, max_size=2))

    def operand(free):
        axes = [("b", i, n) for i, n in enumerate(batch)] + [("c", i, n) for i, n in enumerate(contract)]
        axes = draw(st.permutations(axes + [("f", i, n) for i, n in enumerate(free)]))
        position = {(role, i): p for p, (role, i, _) in enumerate(axes)}
        contracting = tuple(position["c", i] for i in range(len(contract)))
        return tuple(n for _, _, n in axes), contracting, tuple(position["b", i] for i in range(len(batch)))

    lhs_shape, lc, lb = operand(draw(st.lists(sizes, max_size=2)))
    rhs_shape, rc, rb = operand(draw(st.lists(sizes, max_size=2)))
    return lhs_shape, rhs_shape, ((lc, rc), (lb, rb))


@settings(max_examples=examples(10))
@given(problem=_dimension_numbers(), seed=st.integers(0, 2**32 - 1))
def test_any_dimension_numbers_match_the_canonical_matmul(problem, seed):
    lhs_shape, rhs_shape, dims = problem
    lhs, rhs = random_normal(lhs_shape, seed % 1000), random_normal(rhs_shape, seed % 1000 + 1)
    got = plain_dot(lhs, rhs, dims)
    want = lax.dot_general(lhs, rhs, dims)
    assert got.shape == want.shape and got.dtype == want.dtype
    (lc, rc), (lb, _) = dims
    if not lb:  # without batch axes: bit for bit the [M, K] . [K, N] product of the permuted operands
        lf = [d for d in range(lhs.ndim) if d not in lc]
        rf = [d for d in range(rhs.ndim) if d not in rc]
        k = math.prod(lhs.shape[d] for d in lc)
        x = lhs.transpose(*lf, *lc).reshape(-1, k)
        w = rhs.transpose(*rc, *rf).reshape(k, -1)
        assert_same_bytes(got, plain_dot(x, w, DENSE).reshape(got.shape))
    grads = jax.grad(lambda a, b: jnp.sum(plain_dot(a, b, dims).astype(jnp.float32)), (0, 1))(lhs, rhs)
    assert grads[0].shape == lhs.shape and grads[1].shape == rhs.shape


def test_full_recipe_gemms_use_the_transform_and_stochastic_rounding():
    """Recipe() (NVIDIA's): y and dx as the plain recipe but dy rounded stochastically; dW from the RHT copies."""
    x, w, dy = dense_problem()
    key = jax.random.key(5)
    y, dx, dw = jax.jit(functools.partial(dense_grads, functools.partial(jax_nvfp4.dot_general, rng_key=key)))(x, w, dy)
    qdy = quantize(dy, columnwise=True, rht=True, rng_key=key)
    qx = quantize(x, columnwise=True, rht=True)

    assert_same_bytes(y, gemm(quantize(x), quantize(w.T, block_2d=True), y.dtype))
    assert_same_bytes(dx, gemm(qdy, quantize(w, block_2d=True), x.dtype))
    assert_same_bytes(dw, gemm(columnwise_as_rowwise(qdy), columnwise_as_rowwise(qx), w.dtype).T)
    _, dx_plain, dw_plain = dense_grads(plain_dot, x, w, dy)
    assert not np.array_equal(np.asarray(dx), np.asarray(dx_plain))
    assert rel_err(dw, dw_plain) < 0.35  # two NVFP4 approximations of dW (each ~15% off), not equal
    # The backward pass needs the key; the forward pass does not.
    jax_nvfp4.dot_general(x, w, DENSE)
    with pytest.raises(ValueError, match="rng_key"):
        dense_grads(jax_nvfp4.dot_general, x, w, dy)
