"""The mixture-of-experts MLP (linen and NNX): routing, the combination, NVFP4 against bf16, training."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_kernels import assert_same_bytes

from jax_nvfp4 import Recipe
from jax_nvfp4.flax.moe import MoEMLP, route
from jax_nvfp4.flax.nnx_moe import MoEMLP as NNXMoEMLP

D, HIDDEN, EXPERTS, TOP_K = 32, 48, 4, 2


def _x(shape=(2, 24, D), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def test_route_sorts_rows_by_expert_and_balances_to_one():
    logits = jnp.array([[3.0, 2.0, 0.0, -1.0], [0.0, 1.0, 5.0, 4.0], [2.0, -1.0, 1.0, 0.0]])
    r = route(logits, 2)
    np.testing.assert_array_equal(r.group_sizes, [2, 1, 2, 1])  # choices: (0, 1), (2, 3), (0, 2)
    np.testing.assert_array_equal(np.asarray(r.order) // 2, [0, 2, 0, 1, 2, 1])  # tokens of experts 0, 1, 2, 3
    np.testing.assert_allclose(r.gates.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(r.gates[0], jax.nn.softmax(jnp.array([3.0, 2.0])), rtol=1e-6)
    assert float(route(jnp.zeros((8, 4)), 1).load_balance) == pytest.approx(1.0)  # ties go to expert 0: f = (1,0,0,0)
    balanced = jnp.tile(jnp.eye(4) * 10, (2, 1))
    assert float(route(balanced, 1).load_balance) == pytest.approx(1.0, abs=1e-3)


def _dense_reference(params, x):
    """Each token through its top-k experts' MLPs one by one (float32), weighted by the gates."""
    tokens = x.reshape(-1, D).astype(jnp.float32)
    logits = tokens @ params["router"]["kernel"]
    top, chosen = jax.lax.top_k(logits, TOP_K)
    gates = jax.nn.softmax(top, axis=-1)
    out = jnp.zeros_like(tokens)
    for j in range(TOP_K):
        up, down = params["up"][chosen[:, j]], params["down"][chosen[:, j]]
        h = nn.gelu(jnp.einsum("td,tdh->th", tokens, up), approximate=False)
        out += gates[:, j : j + 1] * jnp.einsum("th,thd->td", h, down)
    return out.reshape(x.shape)


def test_linen_bf16_is_the_per_token_mixture_and_nvfp4_is_close_to_it():
    x = _x()
    bf16 = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=None)
    variables = bf16.init(jax.random.key(1), x)
    params = variables["params"]
    assert params["up"].shape == (EXPERTS, D, HIDDEN) and params["down"].shape == (EXPERTS, HIDDEN, D)
    want = np.asarray(_dense_reference(params, x))
    got = np.asarray(bf16.apply(variables, x), np.float32)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
    fp4 = np.asarray(MoEMLP(EXPERTS, HIDDEN, TOP_K).apply(variables, x), np.float32)
    assert not np.array_equal(fp4, got)
    assert np.linalg.norm(fp4 - want) < 0.3 * np.linalg.norm(want)  # two NVFP4 GEMMs in a row


def test_nnx_layer_equals_linen_with_the_same_parameters():
    x = _x()
    linen = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=Recipe(stochastic_rounding=False))
    params = linen.init(jax.random.key(1), x)["params"]
    model = NNXMoEMLP(D, HIDDEN, EXPERTS, top_k=TOP_K, recipe=Recipe(stochastic_rounding=False), rngs=nnx.Rngs(0))
    model.router.kernel[...] = params["router"]["kernel"]
    model.up[...], model.down[...] = params["up"], params["down"]
    assert_same_bytes(model(x), linen.apply({"params": params}, x))
    state = linen.apply({"params": params}, x, mutable=["losses"])[1]
    assert_same_bytes(model.load_balance[...], state["losses"]["load_balance"][0])


def test_linen_layer_trains_with_stochastic_rounding():
    x, target = _x(seed=2), _x(seed=3)
    layer = MoEMLP(EXPERTS, HIDDEN, TOP_K)
    params = layer.init(jax.random.key(0), x)["params"]
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt, key):
        def loss_fn(params):
            y, aux = layer.apply({"params": params}, x, rngs={"nvfp4": key}, mutable=["losses"])
            mse = jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))
            return mse + 0.01 * aux["losses"]["load_balance"][0], mse

        (_, mse), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, mse

    opt, losses = tx.init(params), []
    for i in range(25):
        params, opt, mse = step(params, opt, jax.random.key(i))
        losses.append(float(mse))
    assert losses[-1] < 0.8 * losses[0], losses


def test_nnx_layer_trains_under_nnx_jit_with_new_keys():
    x, target = _x(seed=2), _x(seed=3)
    model = NNXMoEMLP(D, HIDDEN, EXPERTS, top_k=TOP_K, rngs=nnx.Rngs(0, nvfp4=1))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            mse = jnp.mean(jnp.square(model(x).astype(jnp.float32) - target.astype(jnp.float32)))
            return mse + 0.01 * model.load_balance[...], mse

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(25)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="top_k must be in"):
        MoEMLP(2, HIDDEN, 3).init(jax.random.key(0), _x())
    with pytest.raises(ValueError, match="top_k must be in"):
        NNXMoEMLP(D, HIDDEN, 2, top_k=0, rngs=nnx.Rngs(0))
