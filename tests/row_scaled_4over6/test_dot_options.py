"""dot_general with the recipe's 4over6 and row-scaled (per-token) options: exactly the GEMMs they name."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DENSE, assert_same_bytes, columnwise_as_rowwise, dense_grads, dense_problem, rel_err

import jax_nvfp4
from jax_nvfp4 import Recipe, gemm, quantize

PLAIN = {"rht": False, "stochastic_rounding": False}  # round to nearest, no transform


def _dot(recipe: Recipe, key=None):
    return functools.partial(jax_nvfp4.dot_general, recipe=recipe, rng_key=key)


def _fos(recipe: Recipe, operand: str) -> dict:
    """quantize()'s keyword arguments for the 4over6 format ``recipe`` gives ``operand``."""
    fos = recipe.four_over_six_for(operand)
    if fos is None:
        return {}
    return {"four_over_six_error": fos.error, "four_over_six_fast_math": fos.fast_math, "e4m3_max": fos.e4m3_max}


@pytest.mark.parametrize("operands", ["weights", "activations", "all"])
@pytest.mark.parametrize(
    "error", [{}, {"error": "mae", "fast_math": True, "e4m3_max": 448}], ids=["mse-e256", "mae-fast-e448"]
)
def test_four_over_six_gemms_are_those_of_quantize(operands, error):
    recipe = Recipe(four_over_six=jax_nvfp4.FourOverSix(operands, **error), **PLAIN)
    x, w, dy = dense_problem(m=64, k=80, n=48)
    y, dx, dw = jax.jit(functools.partial(dense_grads, _dot(recipe)))(x, w, dy)
    fx, fw, fdy = (_fos(recipe, op) for op in ("x", "w", "dy"))
    assert_same_bytes(y, gemm(quantize(x, **fx), quantize(w.T, block_2d=True, **fw), y.dtype))
    # W's columnwise 16x16 copy is the quantization of W itself (its blocks choose on their own error sums).
    assert_same_bytes(dx, gemm(quantize(dy, **fdy), quantize(w, block_2d=True, **fw), x.dtype))
    assert_same_bytes(dw, gemm(quantize(dy.T, **fdy), quantize(x.T, **fx), w.dtype).T)
    # ...and 4over6 changed the operands it names.
    y0, _, dw0 = dense_grads(_dot(Recipe(**PLAIN)), x, w, dy)
    assert not np.array_equal(np.asarray(y), np.asarray(y0))
    assert np.array_equal(np.asarray(dw), np.asarray(dw0)) == (operands == "weights")


def test_four_over_six_activations_with_the_full_recipe():
    """4over6 on x under NVIDIA's recipe: x's wgrad copy is the 4over6 quantization of its transform; dy keeps
    stochastic rounding."""
    recipe = Recipe(four_over_six=jax_nvfp4.FourOverSix("activations"))
    x, w, dy = dense_problem()
    key = jax.random.key(6)
    y, dx, dw = jax.jit(functools.partial(dense_grads, _dot(recipe, key)))(x, w, dy)
    fx = _fos(recipe, "x")
    qx = quantize(x, columnwise=True, rht=True, **fx)
    qdy = quantize(dy, columnwise=True, rht=True, rng_key=key)
    assert_same_bytes(y, gemm(qx, quantize(w.T, block_2d=True), y.dtype))
    assert_same_bytes(dx, gemm(qdy, quantize(w, block_2d=True), x.dtype))
    assert_same_bytes(dw, gemm(columnwise_as_rowwise(qdy), columnwise_as_rowwise(qx), w.dtype).T)


def test_four_over_six_with_1d_weight_blocks():
    recipe = Recipe(four_over_six=jax_nvfp4.FourOverSix("weights"), weight_block_2d=False, **PLAIN)
    x, w, dy = dense_problem()
    y, dx, _ = dense_grads(_dot(recipe), x, w, dy)
    fw = _fos(recipe, "w")
    assert_same_bytes(y, gemm(quantize(x), quantize(w.T, **fw), y.dtype))
    assert_same_bytes(dx, gemm(quantize(dy), quantize(w, **fw), x.dtype))


@pytest.mark.parametrize("activations,gradients", [(True, False), (False, True), (True, True)])
def test_row_scaled_gemms_are_those_of_quantize(activations, gradients):
    recipe = Recipe(row_scaled_activations=activations, row_scaled_gradients=gradients, **PLAIN)
    x, w, dy = dense_problem()
    y, dx, dw = jax.jit(functools.partial(dense_grads, _dot(recipe)))(x, w, dy)
    qw = quantize(w.T, block_2d=True)
    assert_same_bytes(y, gemm(quantize(x, row_scaled=activations), qw, y.dtype))
    assert_same_bytes(dx, gemm(quantize(dy, row_scaled=gradients), quantize(w, block_2d=True), x.dtype))
    # wgrad: dy^T's rows (output features) and x^T's rows (input features) each with their own scale.
    assert_same_bytes(dw, gemm(quantize(dy.T, row_scaled=gradients), quantize(x.T, row_scaled=activations), w.dtype).T)


def test_row_scaled_full_recipe_with_the_transform_and_stochastic_rounding():
    """Per-token scales with RHT and SR: the wgrad operands are the row-scaled transformed copies."""
    recipe = Recipe(row_scaled_activations=True, row_scaled_gradients=True)
    x, w, dy = dense_problem()
    key = jax.random.key(5)
    y, dx, dw = jax.jit(functools.partial(dense_grads, _dot(recipe, key)))(x, w, dy)
    qdy = quantize(dy, columnwise=True, rht=True, row_scaled=True, rng_key=key)
    qx = quantize(x, columnwise=True, rht=True, row_scaled=True)
    assert_same_bytes(y, gemm(qx, quantize(w.T, block_2d=True), y.dtype))
    assert_same_bytes(dx, gemm(qdy, quantize(w, block_2d=True), x.dtype))
    assert_same_bytes(dw, gemm(columnwise_as_rowwise(qdy), columnwise_as_rowwise(qx), w.dtype).T)


def test_row_scaled_estimated_transform_amax():
    recipe = Recipe(row_scaled_activations=True, rht_amax_estimate=True, stochastic_rounding=False)
    x, w, dy = dense_problem()
    _, _, dw = dense_grads(_dot(recipe), x, w, dy)
    qdy = quantize(dy, columnwise=True, rht=True, rht_amax_factor=recipe.rht_amax_factor_dy)
    qx = quantize(x, columnwise=True, rht=True, row_scaled=True, rht_amax_factor=recipe.rht_amax_factor_x)
    assert_same_bytes(dw, gemm(columnwise_as_rowwise(qdy), columnwise_as_rowwise(qx), w.dtype).T)


def test_row_scaled_tokens_are_quantized_independently():
    """Scaling one token by a power of two scales its output row exactly and leaves every other row's bytes;
    with one scale per tensor the other rows change (their amax moved)."""
    x, w, _ = dense_problem()
    big = x.at[3].multiply(64.0)
    for row_scaled in (True, False):
        dot = _dot(Recipe(row_scaled_activations=row_scaled, **PLAIN))
        y, y_big = (np.asarray(dot(v, w, DENSE), np.float32) for v in (x, big))
        others = np.arange(len(x)) != 3
        assert np.array_equal(y_big[others], y[others]) == row_scaled
        if row_scaled:
            np.testing.assert_array_equal(y_big[3], y[3] * 64)


def test_four_over_six_lowers_the_gemm_error_on_gaussian_operands():
    """The reason for 4over6: its GEMMs are closer to the float32 product (MSE choice, every operand; measured
    0.97, 0.96 and 0.91 of the plain relative errors of y, dx and dW)."""
    x, w, dy = dense_problem(m=256, k=256, n=128, dtype=jnp.float32)
    exact = dense_grads(lambda a, b, d: jax.lax.dot_general(a, b, d, preferred_element_type=jnp.float32), x, w, dy)
    plain = dense_grads(_dot(Recipe(**PLAIN)), x, w, dy)
    fos = dense_grads(_dot(Recipe(four_over_six=jax_nvfp4.FourOverSix("all"), **PLAIN)), x, w, dy)
    for p, f, e in zip(plain, fos, exact, strict=True):
        assert rel_err(f, e) < 0.99 * rel_err(p, e)


def test_gemm_bias_is_added_before_the_cast():
    x, w, _ = dense_problem()
    bias = jax.random.normal(jax.random.key(9), (w.shape[1],), jnp.float32)
    qx, qw = quantize(x, row_scaled=True), quantize(w.T, block_2d=True)
    want = (gemm(qx, qw, jnp.float32) + bias).astype(jnp.bfloat16)
    assert_same_bytes(gemm(qx, qw, jnp.bfloat16, bias=bias), want)
    # Per-tensor scales too: the bias joins the float32 result, not the bf16 one.
    qx = quantize(x)
    assert_same_bytes(gemm(qx, qw, jnp.bfloat16, bias=bias), (gemm(qx, qw, jnp.float32) + bias).astype(jnp.bfloat16))
    assert_same_bytes(gemm(qx, qw, jnp.float32, bias=jnp.zeros_like(bias)), gemm(qx, qw, jnp.float32))


def test_recipe_option_errors():
    with pytest.raises(ValueError, match=r"FourOverSix\.operands must be one of"):
        jax_nvfp4.FourOverSix("x")
    with pytest.raises(ValueError, match="stochastic_rounding=False"):
        Recipe(four_over_six=jax_nvfp4.FourOverSix("all"))
    with pytest.raises(ValueError, match=r"FourOverSix\.error"):
        jax_nvfp4.FourOverSix("weights", error="l1")
    with pytest.raises(ValueError, match="448 or 256"):
        jax_nvfp4.FourOverSix(e4m3_max=300)
    with pytest.raises(TypeError, match="row_scaled_activations must be a bool"):
        Recipe(row_scaled_activations=1)
    assert Recipe(four_over_six=jax_nvfp4.FourOverSix("activations")).four_over_six_for("dy") is None
    all_operands = jax_nvfp4.FourOverSix("all")
    assert Recipe(four_over_six=all_operands, stochastic_rounding=False).four_over_six_for("dy") == all_operands


def test_flax_layers_take_the_options():
    from jax_nvfp4.flax import NVFP4Dense

    recipe = Recipe(
        four_over_six=jax_nvfp4.FourOverSix("activations"), row_scaled_activations=True, stochastic_rounding=False
    )
    x = jax.random.normal(jax.random.key(0), (4, 16, 64), jnp.float32)
    layer = NVFP4Dense(32, recipe=recipe)
    params = layer.init(jax.random.key(1), x)
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    want = jax_nvfp4.dot_general(x, kernel, (((2,), (0,)), ((), ())), recipe=recipe) + bias
    assert_same_bytes(layer.apply(params, x), want)
