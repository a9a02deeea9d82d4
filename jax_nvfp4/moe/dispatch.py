"""The routing and the two dispatches of the mixture-of-experts layers, shared by the linen layer
(``jax_nvfp4.flax.linen.moe``, whose docstring describes them) and the NNX one (``jax_nvfp4.flax.nnx.moe``), and
by expert parallelism (``jax_nvfp4.moe.expert_parallel``): pure functions of arrays, no Flax module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jax_nvfp4.core.checks import check_choice, check_positive_factor
from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.linear.dot_general import dot_general
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.moe.ragged_dot import ragged_dot
from jax_nvfp4.sharding.explicit import auto_mesh, spec_of

Dispatch = Literal["ragged", "capacity"]
DISPATCHES: tuple[Dispatch, ...] = ("ragged", "capacity")


class Routing(NamedTuple):
    """Where each routed row comes from and goes: rows sorted by expert."""

    order: jax.Array  # int32 [T * k]: the (token, choice) index of each sorted row
    group_sizes: jax.Array  # int32 [E]: the rows of each expert
    gates: jax.Array  # float32 [T, k]: each token's weights over its k experts
    load_balance: jax.Array  # float32 []: Switch Transformer's auxiliary loss
    experts: jax.Array  # int32 [T, k]: each token's chosen experts


def route(logits: jax.Array, top_k: int) -> Routing:
    """Top-``top_k`` routing of float32 router logits [T, E]."""
    experts = logits.shape[-1]
    top, chosen = lax.top_k(logits, top_k)  # [T, k]
    flat = chosen.reshape(-1)  # the expert of each (token, choice)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    share = group_sizes.astype(jnp.float32) / chosen.size
    mean_prob = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)
    balance = experts * jnp.sum(share * mean_prob)
    return Routing(order, group_sizes, jax.nn.softmax(top, axis=-1), balance, chosen.astype(jnp.int32))


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
    return combine(out, routing.gates)


def combine(out: jax.Array, gates: jax.Array) -> jax.Array:
    """Each token's expert outputs [T, k, d] weighted by its gates [T, k] and summed: float32 [T, d]."""
    return jnp.einsum("tkd,tk->td", out.astype(jnp.float32), gates)  # the weighting in float32


def nvfp4_or_bf16(recipe: Recipe | None, key: jax.Array | None) -> Callable[..., jax.Array]:
    """``jax_nvfp4.ragged_dot`` with ``recipe`` and ``key``, or ``lax.ragged_dot`` for ``recipe=None``."""
    if recipe is None:
        return lax.ragged_dot
    return functools.partial(ragged_dot, recipe=recipe, rng_key=key)


# ---- Capacity dispatch: a fixed number of slots per expert, the experts' GEMMs batched.


def check_expert_axis(expert_axis: str | None, dispatch: Dispatch) -> None:
    """ValueError unless ``expert_axis`` is None, or a mesh axis name with capacity dispatch."""
    if expert_axis is None:
        return
    if not isinstance(expert_axis, str):
        raise TypeError(f"expert_axis must be a mesh axis name (str) or None, got {expert_axis!r}")
    if dispatch != "capacity":
        raise ValueError(
            f"expert_axis={expert_axis!r} (expert parallelism) needs dispatch='capacity', got {dispatch!r}"
        )


def check_dispatch(dispatch: Dispatch, capacity_factor: float) -> tuple[Dispatch, float]:
    """``dispatch`` and ``capacity_factor`` checked (ValueError naming the bad one)."""
    dispatch = check_choice("dispatch", dispatch, DISPATCHES)
    return dispatch, check_positive_factor("capacity_factor", capacity_factor)


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * T * top_k / E) slots per expert, at most T.

    At most T: top-k picks distinct experts, so no expert gets more than one pair per token. The
    product is rounded to 6 decimals before the ceiling, so that a factor's float error (1.1 * 10 =
    11.000000000000002) does not add a slot.
    """
    return min(tokens, math.ceil(round(capacity_factor * tokens * top_k / num_experts, 6)))


def buffer_rows(capacity: int, recipe: Recipe | None) -> int:
    """Each expert's rows in the dispatch buffer: C, rounded up to a multiple of 16 for NVFP4.

    The weight gradient contracts these rows in 16-row blocks, and the recipe's Random Hadamard
    Transform applies only when they are whole blocks; the extra rows are empty slots (zeros), which
    change no amax and no product.
    """
    return capacity if recipe is None else -(-capacity // BLOCK) * BLOCK


class Slots(NamedTuple):
    """Where each (token, choice) pair sits in the capacity dispatch's buffer [E * rows, d]."""

    index: jax.Array  # int32 [T * k], in (token, choice) order: expert * rows + position; E * rows if dropped
    filled: jax.Array  # int32 [E]: the kept pairs of each expert, min(group size, C)
    dropped: jax.Array  # int32 []: the pairs beyond their expert's capacity


def capacity_slots(routing: Routing, capacity: int, rows: int) -> Slots:
    """Each pair's slot: its rank among its expert's pairs in token order; pairs ranked C or later dropped.

    ``route`` sorts the pairs by expert with a stable sort of the (token, choice) order, so a sorted row's
    rank in its expert is its distance from the expert's first row.
    """
    num_experts, pairs = routing.group_sizes.size, routing.order.size
    starts = jnp.cumsum(routing.group_sizes) - routing.group_sizes
    expert = routing.experts.reshape(-1)[routing.order]  # of each sorted row
    position = jnp.arange(pairs, dtype=jnp.int32) - starts[expert]
    sorted_index = jnp.where(position < capacity, expert * rows + position, num_experts * rows)
    index = jnp.zeros(pairs, jnp.int32).at[routing.order].set(sorted_index)
    filled = jnp.minimum(routing.group_sizes, capacity)
    return Slots(index, filled, jnp.sum(routing.group_sizes - filled))


def nvfp4_or_bf16_dot(recipe: Recipe | None, key: jax.Array | None) -> Callable[..., jax.Array]:
    """``jax_nvfp4.dot_general`` with ``recipe`` and ``key``, or ``lax.dot_general`` for ``recipe=None``."""
    if recipe is None:
        return lax.dot_general
    return functools.partial(dot_general, recipe=recipe, rng_key=key)


# Buffer [E, rows, in] . kernels [E, in, out] -> [E, rows, out]: the experts are the batch axis.
BATCHED_DIMS = (((2,), (1,)), ((0,), (0,)))


def _reshard(a: jax.Array, spec: PartitionSpec) -> jax.Array:
    """``a`` resharded to ``spec`` on Explicit axes; elsewhere unchanged."""
    return a if auto_mesh() is None else jax.sharding.reshard(a, spec)


def _like_kernel(a: jax.Array, kernel: jax.Array) -> jax.Array:
    """A buffer [E, rows, in] sharded as ``kernel`` [E, in, out] on E and ``in`` (on Explicit axes, where
    dot_general's types need its batch and contracting dimensions sharded alike): with the experts sharded,
    each shard's tokens move to their experts (expert parallelism)."""
    if auto_mesh() is None:
        return a
    experts, contracted, _ = spec_of(kernel)
    return jax.sharding.reshard(a, PartitionSpec(experts, None, contracted))


def capacity_mlp(
    x: jax.Array,
    routing: Routing,
    up: jax.Array,
    down: jax.Array,
    dots: tuple[Callable[..., jax.Array], Callable[..., jax.Array]],
    activation: Callable[[jax.Array], jax.Array],
    capacity: int,
    rows: int,
) -> tuple[jax.Array, jax.Array]:
    """Tokens x [T, d] through their experts' MLPs (up [E, d, h], down [E, h, d]) by capacity dispatch.

    Returns the float32 combination [T, d] (dropped pairs add 0) and the number of dropped pairs.
    ``dots``: the batched GEMMs of the two projections (``lax.dot_general``'s signature, each with its
    own rounding key); ``capacity``: C; ``rows`` >= C: each expert's rows in the buffer.
    """
    tokens, top_k = routing.gates.shape
    num_experts, d = up.shape[0], x.shape[-1]
    slots = capacity_slots(routing, capacity, rows)
    # Scatter each kept pair's token to its slot (dropped pairs' index is out of bounds: no write). The
    # slots are distinct, so add is set; add's transpose is a plain gather.
    pairs = jnp.repeat(x, top_k, axis=0)  # [T * k, d]: the token of each (token, choice) pair
    buffer = jnp.zeros((num_experts * rows, d), x.dtype).at[slots.index].add(pairs, mode="drop")
    buffer = buffer.reshape(num_experts, rows, d)
    h = activation(dots[0](_like_kernel(buffer, up), up.astype(x.dtype), BATCHED_DIMS))
    # Empty slots stay zero whatever activation(0) is: they would count in the hidden layer's amax.
    filled = jnp.arange(rows)[:, None] < slots.filled[:, None, None]  # [E, rows, 1]
    h = jnp.where(_reshard(filled, PartitionSpec(*spec_of(h)[:2])), h, 0)  # (sharded as h on Explicit axes)
    out = dots[1](_like_kernel(h, down), down.astype(x.dtype), BATCHED_DIMS)
    out = _reshard(out, PartitionSpec()).reshape(num_experts * rows, d)
    out = out.at[slots.index].get(mode="fill", fill_value=0)  # [T * k, d]; dropped pairs: 0
    return combine(out.reshape(tokens, top_k, d), routing.gates), slots.dropped


def mixture(
    x: jax.Array,
    routing: Routing,
    up: jax.Array,
    down: jax.Array,
    recipe: Recipe | None,
    keys: tuple[jax.Array | None, jax.Array | None],
    activation: Callable[[jax.Array], jax.Array],
    dispatch: Dispatch,
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array | None]:
    """The experts' combined output float32 [T, d] by ``dispatch``, and the dropped pairs (None for ragged).

    ``keys``: the stochastic-rounding keys of the two projections (None: none); ``recipe=None`` runs them
    in ``x``'s dtype with ``lax.ragged_dot`` / ``lax.dot_general``.
    """
    if dispatch == "ragged":
        ragged = tuple(nvfp4_or_bf16(recipe, key) for key in keys)
        return experts_mlp(x, routing, up, down, ragged, activation), None
    tokens, top_k = routing.gates.shape
    capacity = expert_capacity(tokens, top_k, up.shape[0], capacity_factor)
    dots = tuple(nvfp4_or_bf16_dot(recipe, key) for key in keys)
    return capacity_mlp(x, routing, up, down, dots, activation, capacity, buffer_rows(capacity, recipe))
