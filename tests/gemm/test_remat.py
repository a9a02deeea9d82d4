"""Rematerialization: under ``jax.checkpoint`` the backward pass quantizes again what the forward pass quantized,
unless ``remat_policy`` saves the recipe's named copies; the values and gradients are the same bytes either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import DENSE, assert_same_bytes, eqns_named, quantized_shapes

import jax_nvfp4
from jax_nvfp4 import Recipe, remat_policy

D_IN, D_HIDDEN, TOKENS = 64, 48, 32
POLICIES = {
    "none": None,
    "recompute": jax.checkpoint_policies.nothing_saveable,
    "weights": remat_policy(),
    "weights+activations": remat_policy(activations=True),
    "weights, combined": remat_policy(base=jax.checkpoint_policies.nothing_saveable),
    # jax's dots_saveable does not see NVFP4 GEMMs; outputs=True saves them as it saves lax.dot_general's.
    "dots": jax.checkpoint_policies.dots_saveable,
    "everything": remat_policy(activations=True, outputs=True),
}
# (weight quantizes, all quantizes, GEMMs) in a training step of two layers: each weight and each activation
# quantized once, each gradient dy once in the backward pass; the 2 forward and 4 backward GEMMs. Recomputed,
# the forward pass's quantizes and GEMMs again.
COUNTS = {
    "none": (2, 6, 6),
    "recompute": (4, 10, 8),
    "weights": (2, 8, 8),
    "weights+activations": (2, 6, 8),
    "weights, combined": (2, 8, 8),
    "dots": (4, 10, 8),
    "everything": (2, 6, 6),
}


def _mlp(x, w1, w2, key):
    k1, k2 = jax.random.split(key)
    # relu: its derivative is exact. With gelu, saving the GEMM outputs gave other bytes of dW1: the float math
    # of gelu's derivative, in another program, is not bit-stable (not looked into further).
    h = jax.nn.relu(jax_nvfp4.dot_general(x, w1, DENSE, rng_key=k1))
    return jax_nvfp4.dot_general(h, w2, DENSE, rng_key=k2)


def _step(policy: str):
    layers = _mlp if policy == "none" else jax.checkpoint(_mlp, policy=POLICIES[policy])
    # A cotangent that is not all ones (the gradient of a plain sum lets XLA skip work).
    loss = lambda x, w1, w2, key: jnp.sum(layers(x, w1, w2, key) * jnp.arange(D_IN, dtype=jnp.float32))  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _operands():
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(TOKENS, D_IN), (D_IN, D_HIDDEN), (D_HIDDEN, D_IN)]
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)] + [jax.random.key(5)]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_policy_saves_what_the_recipe_makes(policy):
    jaxpr = jax.make_jaxpr(_step(policy))(*_operands())
    shapes = quantized_shapes(jaxpr)
    weights = [s for s in shapes if s in ((1, D_HIDDEN, D_IN), (1, D_IN, D_HIDDEN))]  # W^T [1, N, K]
    assert (len(weights), len(shapes), len(eqns_named(jaxpr, "nvfp4_gemm"))) == COUNTS[policy], shapes


def test_rematerialized_steps_give_the_same_bytes():
    """Recomputed or saved, the quantized copies are the same (stochastic rounding's keys included)."""
    operands = _operands()
    want = jax.jit(_step("none"))(*operands)
    for policy in ("recompute", "weights", "everything"):
        jax.tree.map(assert_same_bytes, jax.jit(_step(policy))(*operands), want)


def test_a_remat_ragged_dot_quantizes_its_experts_once():
    x = jax.random.normal(jax.random.key(1), (TOKENS, D_IN), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (3, D_IN, D_HIDDEN), jnp.float32)
    sizes = jnp.asarray([10, 0, 22], jnp.int32)
    layer = lambda x, w: jnp.sum(jax_nvfp4.ragged_dot(x, w, sizes, recipe=Recipe(stochastic_rounding=False)) ** 2)  # noqa: E731
    experts = []
    for policy in (jax.checkpoint_policies.nothing_saveable, remat_policy()):
        jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(layer, policy=policy), argnums=(0, 1)))(x, w)
        # The experts' W [G, K, N], each quantized on its own (one batched quantize).
        experts.append(sum(s == (3, D_IN, D_HIDDEN) for s in quantized_shapes(jaxpr)))
    assert experts == [2, 1]


def test_a_policy_that_saves_nothing_is_refused():
    with pytest.raises(ValueError, match="saves nothing"):
        remat_policy(weights=False)
