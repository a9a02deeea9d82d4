"""Flax layers: same parameters as Flax's, NVFP4 GEMMs inside, and they train."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bytes

import jax_nvfp4
from jax_nvfp4 import Recipe
from jax_nvfp4.flax import RNG_STREAM, NVFP4Dense, NVFP4DenseGeneral, NVFP4DotGeneral
from jax_nvfp4.flax.nnx.layers import NVFP4DotGeneral as NNXDotGeneral

X = jax.random.normal(jax.random.key(0), (2, 24, 64), jnp.bfloat16)


def _same_params(ours: nn.Module, flax_module: nn.Module, x=X):
    params = ours.init(jax.random.key(1), x)
    want = flax_module.init(jax.random.key(1), x)
    assert jax.tree.structure(params) == jax.tree.structure(want)
    jax.tree.map(assert_same_bytes, params, want)
    return params


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"use_bias": False},
        {"param_dtype": jnp.bfloat16, "dtype": jnp.bfloat16},
        {"kernel_init": nn.initializers.ones},
    ],
)
def test_dense_has_the_parameters_of_nn_dense(kwargs):
    params = _same_params(NVFP4Dense(48, **kwargs), nn.Dense(48, **kwargs))
    # A checkpoint of nn.Dense runs unchanged, and the layer is jax_nvfp4.dot_general.
    y = NVFP4Dense(48, **kwargs).apply(params, X)
    x, kernel = nn.dtypes.promote_dtype(X, params["params"]["kernel"], dtype=kwargs.get("dtype"))
    want = jax_nvfp4.dot_general(x, kernel, (((2,), (0,)), ((), ())))
    if kwargs.get("use_bias", True):
        want = want + params["params"]["bias"].astype(want.dtype)
    assert_same_bytes(y, want)
    assert not np.array_equal(np.asarray(y), np.asarray(nn.Dense(48, **kwargs).apply(params, X)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"features": (4, 16), "axis": -1},
        {"features": 32, "axis": (-2, -1)},
        {"features": (3, 16), "axis": -1, "batch_dims": (0,)},
    ],
)
def test_dense_general_has_the_parameters_of_nn_dense_general(kwargs):
    params = _same_params(NVFP4DenseGeneral(**kwargs), nn.DenseGeneral(**kwargs))
    y = NVFP4DenseGeneral(**kwargs).apply(params, X)
    want = nn.DenseGeneral(**kwargs).apply(params, X)
    assert y.shape == want.shape and y.dtype == want.dtype
    rel = np.linalg.norm(np.asarray(y - want, np.float64)) / np.linalg.norm(np.asarray(want, np.float64))
    assert 0 < rel < 0.2


def test_dot_general_cls_in_flax_modules():
    """NVFP4DotGeneral plugs into nn.Dense and nn.MultiHeadDotProductAttention unchanged."""
    recipe = Recipe(weight_block_2d=False)
    dense = nn.Dense(48, dot_general_cls=functools.partial(NVFP4DotGeneral, recipe=recipe))
    params = _same_params(dense, nn.Dense(48))
    assert_same_bytes(dense.apply(params, X), NVFP4Dense(48, recipe=recipe).apply(params, X))
    assert not np.array_equal(np.asarray(dense.apply(params, X)), np.asarray(NVFP4Dense(48).apply(params, X)))

    attention = nn.MultiHeadDotProductAttention(
        num_heads=4, qkv_dot_general_cls=NVFP4DotGeneral, out_dot_general_cls=NVFP4DotGeneral
    )
    params = _same_params(attention, nn.MultiHeadDotProductAttention(num_heads=4))
    y = attention.apply(params, X)
    want = nn.MultiHeadDotProductAttention(num_heads=4).apply(params, X)
    rel = np.linalg.norm(np.asarray(y - want, np.float64)) / np.linalg.norm(np.asarray(want, np.float64))
    assert 0 < rel < 0.3


def test_passing_another_dot_general_is_an_error():
    with pytest.raises(ValueError, match="computes its GEMM in NVFP4"):
        NVFP4Dense(8, dot_general=jax.lax.dot_general).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="computes its GEMM in NVFP4"):
        NVFP4DenseGeneral(8, dot_general_cls=NVFP4DotGeneral).init(jax.random.key(0), X)


def test_nnx_linear_takes_the_dot_general():
    layer = nnx.Linear(64, 32, dot_general=jax_nvfp4.dot_general, rngs=nnx.Rngs(0))
    kernel, bias = layer.kernel[...], layer.bias[...]
    x = X.astype(jnp.float32)
    assert_same_bytes(layer(x), jax_nvfp4.dot_general(x, kernel, (((2,), (0,)), ((), ()))) + bias)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(NVFP4Dense(64)(x))
        return NVFP4Dense(1)(x)


def test_a_small_model_trains():
    """Regression on a smooth target with the full recipe (stochastic rounding keys from the "nvfp4" stream):
    jitted SGD with momentum brings the loss down 10x."""
    x = jax.random.normal(jax.random.key(2), (256, 32), jnp.float32)
    target = jnp.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * x[:, 2:3]
    model = _MLP()
    params = model.init(jax.random.key(3), x)

    def loss_fn(p, key):
        return jnp.mean((model.apply(p, x, rngs={RNG_STREAM: key}) - target) ** 2)

    @jax.jit
    def step(p, m, key):
        loss, g = jax.value_and_grad(loss_fn)(p, key)
        m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree.map(lambda p, m: p - 0.05 * m, p, m), m, loss

    momentum = jax.tree.map(jnp.zeros_like, params)
    first = loss_fn(params, jax.random.key(0))
    for i in range(300):
        params, momentum, loss = step(params, momentum, jax.random.key(i))
    assert np.isfinite(loss) and loss < first / 10


def test_stochastic_rounding_needs_the_rng_stream():
    x = jax.random.normal(jax.random.key(2), (32, 32), jnp.float32)
    model = _MLP()
    params = model.init(jax.random.key(3), x)
    model.apply(params, x)  # the forward pass needs no key
    with pytest.raises(ValueError, match="'nvfp4' RNG stream"):  # raised while tracing
        jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x))))(params)
    # Jitted: one compile for the three keys (eager, each op compiles on its own).
    grad = jax.jit(jax.grad(lambda p, key: jnp.sum(model.apply(p, x, rngs={RNG_STREAM: key}))))
    grads = [grad(params, jax.random.key(k)) for k in (0, 0, 1)]
    kernels = [np.asarray(g["params"]["NVFP4Dense_0"]["kernel"]) for g in grads]
    np.testing.assert_array_equal(kernels[0], kernels[1])  # a key gives the same gradients
    assert not np.array_equal(kernels[0], kernels[2])  # another key other roundings


def test_logical_axes_annotate_the_params_without_changing_them():
    x = jnp.ones((4, 16))
    layer = NVFP4Dense(32, kernel_axes=("embed", "mlp"), bias_axes=("mlp",))
    variables = layer.init(jax.random.key(0), x)
    assert nn.get_partition_spec(variables)["params"] == {
        "kernel": jax.sharding.PartitionSpec("embed", "mlp"),
        "bias": jax.sharding.PartitionSpec("mlp"),
    }
    plain = nn.Dense(32).init(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(variables), plain)
    # Clones (Flax re-runs __post_init__) keep one annotation, with the clone's axes.
    clone = layer.clone(kernel_axes=("a", "b"))
    assert nn.get_partition_spec(clone.init(jax.random.key(0), x))["params"]["kernel"] == jax.sharding.PartitionSpec(
        "a", "b"
    )
    general = NVFP4DenseGeneral((2, 16), kernel_axes=("embed", "heads", "kv"))
    assert nn.get_partition_spec(general.init(jax.random.key(0), x))["params"]["kernel"] == jax.sharding.PartitionSpec(
        "embed", "heads", "kv"
    )
    # Without axes nothing is boxed.
    assert not nn.get_partition_spec(NVFP4Dense(32).init(jax.random.key(0), x))["params"]["kernel"]


# Flax NNX: jax_nvfp4.flax.nnx.NVFP4DotGeneral keeps a forked "nvfp4" stream in the layer's graph.

DIMS = (((2,), (0,)), ((), ()))


def _nnx_linear(rngs: nnx.Rngs, recipe: Recipe | None = None) -> nnx.Linear:
    """The README's usage: one Rngs for the layer and its dot_general."""
    return nnx.Linear(64, 32, dot_general=NNXDotGeneral(recipe or Recipe(), rngs=rngs), rngs=rngs)


def test_nnx_dot_general_is_jax_nvfp4_dot_general():
    x = X.astype(jnp.float32)
    options = Recipe(
        four_over_six=jax_nvfp4.FourOverSix("weights"), row_scaled_activations=True, row_scaled_gradients=True
    )
    for recipe in (Recipe(), Recipe(weight_block_2d=False, stochastic_rounding=False), options):
        layer = _nnx_linear(nnx.Rngs(0), recipe)
        want = jax_nvfp4.dot_general(x, layer.kernel[...], DIMS, recipe=recipe) + layer.bias[...]
        assert_same_bytes(layer(x), want)
    # nnx.Linear keeps dot_general as an attribute: its stream is part of the layer's state.
    layer = _nnx_linear(nnx.Rngs(0))
    streams = nnx.state(layer, nnx.RngState)
    assert set(streams["dot_general"]["rngs"]) == {"key", "count"}
    assert layer.dot_general.rngs.key.tag == RNG_STREAM
    # Its own "nvfp4" seed leaves the Linear's initialization as without NVFP4.
    plain = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    assert_same_bytes(_nnx_linear(nnx.Rngs(0, nvfp4=1)).kernel[...], plain.kernel[...])
    with pytest.raises(ValueError, match="'nvfp4' stream"):
        NNXDotGeneral(rngs=nnx.Rngs(params=0))


@nnx.jit
def _nnx_step(model: nnx.Linear, x: jax.Array):
    """A training step's loss and gradients (parameters unchanged, so steps differ only in their keys)."""
    return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)


def test_nnx_training_steps_take_new_keys_reproducibly():
    x = X.astype(jnp.float32)
    runs = []
    for _ in range(2):
        model = _nnx_linear(nnx.Rngs(0))
        key = model.dot_general.rngs.key[...]
        runs.append([np.asarray(_nnx_step(model, x)[1]["kernel"][...]) for _ in range(2)])
        assert int(model.dot_general.rngs.count[...]) == 2
    (first, second), again = runs
    assert not np.array_equal(first, second)  # each step rounds with a new key
    for a, b in zip(runs[0], again, strict=True):
        np.testing.assert_array_equal(a, b)  # the same seed gives the same steps
    # The first step's key is the stream's first: fold_in(key, 0).
    dense = functools.partial(jax_nvfp4.dot_general, rng_key=jax.random.fold_in(key, 0))
    want = jax.grad(lambda k: jnp.mean((dense(x, k, DIMS) + model.bias[...]) ** 2))(model.kernel[...])
    np.testing.assert_array_equal(first, np.asarray(want))


def test_nnx_dot_general_without_stochastic_rounding_needs_no_rngs():
    x = X.astype(jnp.float32)
    recipe = Recipe(stochastic_rounding=False)
    model = nnx.Linear(64, 32, dot_general=NNXDotGeneral(recipe), rngs=nnx.Rngs(0))
    grads = [np.asarray(_nnx_step(model, x)[1]["kernel"][...]) for _ in range(2)]
    np.testing.assert_array_equal(*grads)
    assert model.dot_general.rngs is None
    assert NNXDotGeneral(recipe, rngs=nnx.Rngs(0)).rngs is None  # no stream taken


def test_nnx_stochastic_rounding_without_rngs_says_what_to_pass():
    x = X.astype(jnp.float32)
    model = nnx.Linear(64, 32, dot_general=NNXDotGeneral(), rngs=nnx.Rngs(0))
    model(x)  # the forward pass needs no key
    with pytest.raises(ValueError, match=r"NVFP4DotGeneral\(rngs=rngs\)"):
        _nnx_step(model, x)
