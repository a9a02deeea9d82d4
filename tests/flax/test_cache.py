"""cache_weights (linen): the NVFP4 layers' weights quantized once per step, read from the "nvfp4_cache" collection."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes, eqns_named, normal, quantized_shapes

from jax_nvfp4 import Recipe, remat_policy

flax_nn = pytest.importorskip("flax.linen")
from jax_nvfp4.flax import CACHE, NVFP4Dense, NVFP4DenseGeneral, cache_weights  # noqa: E402


class _Model(flax_nn.Module):
    """16x16-block layers (one promoting float32 params to bf16, one contracting two axes), a 1x16-block one."""

    @flax_nn.compact
    def __call__(self, x):
        h = NVFP4DenseGeneral((2, 16), dtype=jnp.bfloat16, name="qkv")(x)
        y = NVFP4DenseGeneral(32, axis=(-2, -1), name="out")(h)
        y = NVFP4Dense(48, recipe=Recipe(weight_block_2d=False), name="mlp")(jax.nn.gelu(y))
        return flax_nn.Dense(8, name="head")(y)


def test_linen_cache_gives_the_loss_and_gradients_without_quantizing_the_weights():
    model, x = _Model(), normal((4, 16, 32), 0, jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]
    cache = cache_weights(params, model=model, inputs=(x[:1],))
    assert set(cache) == {"qkv", "out", "mlp"}  # the NVFP4 layers, not the bf16 head
    stored = cache["qkv"]["NVFP4DotGeneral_0"]["kernel"]
    assert stored.dtype == jnp.bfloat16 and stored.shape == params["qkv"]["kernel"].shape  # as the layer promotes it

    def loss(params, extra):
        y = model.apply({"params": params, **extra}, x, rngs={"nvfp4": jax.random.key(1)})
        return jnp.sum(y.astype(jnp.float32) ** 2)

    want = jax.jit(jax.value_and_grad(loss))(params, {})
    got = jax.jit(jax.value_and_grad(loss))(params, {CACHE: cache})
    assert_same_bytes(got[0], want[0])
    # The same quantized operands; the float32 gradients of the kernels are sums that XLA's CPU dot may order
    # differently in two programs (a few units in their last place).
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(w))))
    # The two 16x16-block kernels are not quantized again; the 1x16 one still is along its other axis.
    count = [
        len(eqns_named(jax.make_jaxpr(jax.grad(loss))(params, extra), "nvfp4_quantize"))
        for extra in ({}, {CACHE: cache})
    ]
    assert count[1] == count[0] - 2, count


def test_nnx_cache_weights_give_the_same_gradients_quantizing_each_weight_once():
    """Two micro-batches in one step: inside cache_weights each layer's kernel is quantized once (on entry, in the
    layer's dtype), not in each micro-batch, with the same gradients bit for bit; the caches are gone after."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_nvfp4.flax import nnx as nvfp4_nnx

    recipe = Recipe(stochastic_rounding=False)
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        nvfp4_nnx.NVFP4Linear(32, 48, recipe=recipe, dtype=jnp.bfloat16, rngs=rngs),
        nvfp4_nnx.NVFP4LinearGeneral(48, (2, 16), recipe=recipe, rngs=rngs),
    )
    xs = normal((2, 8, 32), 1, jnp.bfloat16)
    graphdef, state = nnx.split(model)

    def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) ** 2)

    def step(state, cached: bool):
        model = nnx.merge(graphdef, state)
        with nvfp4_nnx.cache_weights(model) if cached else contextlib.nullcontext():
            grads = [nnx.grad(loss)(model, xs[i]) for i in range(2)]
        assert not hasattr(model.layers[0].dot_general, "weight_cache")
        return jax.tree.map(jnp.add, *grads)

    for got, want in zip(jax.tree.leaves(step(state, True)), jax.tree.leaves(step(state, False)), strict=True):
        assert_same_bytes(got, want)
    count = [len(eqns_named(jax.make_jaxpr(lambda s, c=c: step(s, c))(state), "nvfp4_quantize")) for c in (False, True)]
    assert count[0] - count[1] == 2, count  # each W: once instead of once per micro-batch


def test_linen_remat_quantizes_each_weight_once():
    """nn.remat recomputes the layers in the backward pass but not their weights' quantizes, whose copies every
    policy saves (its default, nothing saveable, jax_nvfp4.remat_policy()). Counted in the traced step (W [1, K, N])."""
    x = normal((4, 4, 32), 1)  # 16 tokens: no activation or gradient has a weight's shape
    weights = {(1, 32, 32), (1, 32, 48)}  # W of qkv and out, and of mlp (1x16 blocks: both copies in one call)
    counts = []
    for policy in (None, jax.checkpoint_policies.nothing_saveable, remat_policy()):
        model = flax_nn.remat(_Model, policy=policy)()
        params = model.init(jax.random.key(0), x)["params"]
        loss = lambda p, m=model: jnp.sum(m.apply({"params": p}, x, rngs={"nvfp4": jax.random.key(3)}) ** 2)  # noqa: E731
        counts.append(sum(s in weights for s in quantized_shapes(jax.make_jaxpr(jax.grad(loss))(params))))
    assert counts == [3, 3, 3], counts  # [6, 6, 3] before the copies were saved under every policy
