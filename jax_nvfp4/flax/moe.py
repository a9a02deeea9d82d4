"""A mixture-of-experts MLP (linen) whose grouped GEMMs are ``jax_nvfp4.ragged_dot``, and its routing.

Each token goes to its ``top_k`` experts by a float32 router (not quantized: it is small and
decides discrete choices); the rows are sorted by expert, each expert's GELU MLP runs as one
grouped GEMM per projection (``ragged_dot`` over all experts' rows), and the outputs are summed
back per token with the router's weights (softmax over the chosen experts' logits). The routing
functions are shared with the NNX layer (``jax_nvfp4.flax.nnx_moe``).

On a mesh with Explicit axes (``jax.set_mesh``) the routing sorts all the tokens together, which JAX
types only for unsharded arrays: the layer takes its tokens unsharded for the routing and the
experts (moving them, as any MoE dispatch does) and gives its output the sharding of its input.

The load-balancing loss of Switch Transformer (num_experts * sum_e f_e p_e: f_e the share of
routed rows expert e gets, p_e its mean router probability; 1 when balanced) is sown as
``("losses", "load_balance")``: add ``weight * sum`` of that collection to the training loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jax_nvfp4._explicit import auto_mesh, spec_of
from jax_nvfp4.flax.linen import stream_key
from jax_nvfp4.ragged import ragged_dot
from jax_nvfp4.recipe import Recipe


class Routing(NamedTuple):
    """Where each routed row comes from and goes: rows sorted by expert."""

    order: jax.Array  # int32 [T * k]: the (token, choice) index of each sorted row
    group_sizes: jax.Array  # int32 [E]: the rows of each expert
    gates: jax.Array  # float32 [T, k]: each token's weights over its k experts
    load_balance: jax.Array  # float32 []: Switch Transformer's auxiliary loss


def route(logits: jax.Array, top_k: int) -> Routing:
    """Top-``top_k`` routing of float32 router logits [T, E]."""
    experts = logits.shape[-1]
    top, chosen = lax.top_k(logits, top_k)  # [T, k]
    flat = chosen.reshape(-1)  # the expert of each (token, choice)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    share = group_sizes.astype(jnp.float32) / chosen.size
    mean_prob = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)
    return Routing(order, group_sizes, jax.nn.softmax(top, axis=-1), experts * jnp.sum(share * mean_prob))


def tokens_of(x: jax.Array) -> jax.Array:
    """x [..., d] as tokens [T, d] to route: on Explicit axes unsharded (the routing sorts them all)."""
    tokens = x.reshape(-1, x.shape[-1])
    return tokens if auto_mesh() is None else jax.sharding.reshard(tokens, PartitionSpec())


def like(y: jax.Array, x: jax.Array) -> jax.Array:
    """The layer's output [T, d] in the shape, and on Explicit axes the sharding, of its input x."""
    y = y.reshape(x.shape)
    return y if auto_mesh() is None else jax.sharding.reshard(y, spec_of(x))


def experts_mlp(
    x: jax.Array,
    routing: Routing,
    up: jax.Array,
    down: jax.Array,
    ragged: tuple[Callable[..., jax.Array], Callable[..., jax.Array]],
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Tokens x [T, d] through their experts' MLPs (up [E, d, h], down [E, h, d]), combined: [T, d].

    ``ragged``: the grouped GEMMs of the two projections (each with its own rounding key).
    """
    tokens, top_k = routing.gates.shape
    rows = x[routing.order // top_k]  # [T * k, d], sorted by expert
    h = activation(ragged[0](rows, up.astype(x.dtype), routing.group_sizes))
    out = ragged[1](h, down.astype(x.dtype), routing.group_sizes)
    out = jnp.zeros_like(out).at[routing.order].set(out).reshape(tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", out.astype(jnp.float32), routing.gates)  # the weighting in float32


def nvfp4_or_bf16(recipe: Recipe | None, key: jax.Array | None) -> Callable[..., jax.Array]:
    """``jax_nvfp4.ragged_dot`` with ``recipe`` and ``key``, or ``lax.ragged_dot`` for ``recipe=None``."""
    if recipe is None:
        return lax.ragged_dot
    return functools.partial(ragged_dot, recipe=recipe, rng_key=key)


class MoEMLP(nn.Module):
    """A top-k mixture of GELU MLP experts on the last axis, in NVFP4 (or bf16 with ``recipe=None``).

    Attributes:
      num_experts: E.
      hidden: each expert's hidden width.
      top_k: experts per token.
      recipe: the NVFP4 recipe of the experts' GEMMs; None runs them with ``lax.ragged_dot`` (the
        baseline). Stochastic rounding takes its keys from the ``"nvfp4"`` RNG stream.
      dtype: the activations' dtype in the GEMMs (parameters stay float32).
      kernel_init: the experts' kernels' initializer (for [E, in, out]).
      activation: the experts' nonlinearity (exact GELU by default).

    Parameters: ``router`` (a float32 ``nn.Dense`` without bias, [d, E]), ``up`` [E, d, hidden],
    ``down`` [E, hidden, d].
    """

    num_experts: int
    hidden: int
    top_k: int = 2
    recipe: Recipe | None = Recipe()
    dtype: jnp.dtype = jnp.bfloat16
    kernel_init: Callable = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2)
    activation: Callable[[jax.Array], jax.Array] = functools.partial(nn.gelu, approximate=False)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        d = x.shape[-1]
        tokens = tokens_of(x)
        logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32, name="router")(tokens)
        routing = route(logits, self.top_k)
        self.sow("losses", "load_balance", routing.load_balance)
        up = self.param("up", self.kernel_init, (self.num_experts, d, self.hidden))
        down = self.param("down", self.kernel_init, (self.num_experts, self.hidden, d))
        keys = (None, None) if self.recipe is None else (stream_key(self, self.recipe) for _ in range(2))
        ragged = tuple(nvfp4_or_bf16(self.recipe, key) for key in keys)
        y = experts_mlp(tokens.astype(self.dtype), routing, up, down, ragged, self.activation)
        return like(y.astype(self.dtype), x)
