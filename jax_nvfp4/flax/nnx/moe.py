"""The mixture-of-experts MLP for Flax NNX: ``MoEMLP``, the NNX twin of ``jax_nvfp4.flax.linen.moe.MoEMLP``.

Same routing, parameters and GEMMs (``jax_nvfp4.flax.linen.moe``); the stochastic-rounding keys come
from a stream forked at construction, as ``NVFP4DotGeneral``'s do. The load-balancing loss of the
last call is the layer's ``load_balance`` (an ``nnx.Intermediate``, overwritten by each call so
that the model's state keeps its structure under ``nnx.jit``): add ``weight *
layer.load_balance[...]`` to the loss inside the function you differentiate. With capacity dispatch
the layer also keeps the last call's dropped (token, choice) pairs, ``dropped`` (int32) and
``dropped_fraction`` (over T * top_k, float32), as ``nnx.Intermediate``s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_nvfp4.flax.nnx.layers import DEFAULT_RECIPE, NVFP4Op
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.moe.dispatch import Dispatch, check_dispatch, check_expert_axis, like, mixture, route, tokens_of
from jax_nvfp4.moe.expert_parallel import expert_parallel_mlp

_EXACT_GELU = functools.partial(nnx.gelu, approximate=False)
_KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2)


class MoEMLP(nnx.Module):
    """A top-k mixture of GELU MLP experts on the last axis, in NVFP4 (or bf16 with ``recipe=None``).

    Args:
      in_features: d.
      hidden: each expert's hidden width.
      num_experts: E.
      top_k: experts per token.
      recipe: the experts' GEMMs' NVFP4 recipe; None runs ``lax.ragged_dot`` (``lax.dot_general`` with
        capacity dispatch): the baseline.
      dtype: the activations' dtype in the GEMMs (parameters stay float32).
      activation: the experts' nonlinearity (exact GELU by default).
      dispatch: ``"ragged"`` (every pair, grouped GEMMs ``ragged_dot``) or ``"capacity"`` (at most C pairs
        per expert, batched GEMMs ``dot_general``; see ``jax_nvfp4.flax.linen.moe``).
      capacity_factor: with capacity dispatch, C = ceil(capacity_factor * T * top_k / E) (at most T).
      expert_axis: with capacity dispatch, expert parallelism over this axis of the current mesh
        (``jax.set_mesh``): see ``jax_nvfp4.flax.linen.moe.MoEMLP`` and ``jax_nvfp4.moe.expert_parallel``.
      data_axes: with ``expert_axis``, the other mesh axes the tokens are sharded on.
      rngs: initializes the router and the kernels; with stochastic rounding the layer forks its
        ``"nvfp4"`` stream (else ``default``), as ``NVFP4DotGeneral`` does.

    Parameters: ``router`` (an ``nnx.Linear`` in float32, no bias), ``up`` [E, d, hidden], ``down`` [E, hidden, d].
    Intermediates: ``load_balance`` and, with capacity dispatch, ``dropped`` and ``dropped_fraction``.
    """

    def __init__(
        self,
        in_features: int,
        hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        recipe: Recipe | None = DEFAULT_RECIPE,
        dtype: jnp.dtype = jnp.bfloat16,
        activation: Callable[[jax.Array], jax.Array] = _EXACT_GELU,
        dispatch: Dispatch = "ragged",
        capacity_factor: float = 1.25,
        expert_axis: str | None = None,
        data_axes: tuple[str, ...] = (),
        rngs: nnx.Rngs,
    ) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.dispatch, self.capacity_factor = check_dispatch(dispatch, capacity_factor)
        check_expert_axis(expert_axis, self.dispatch)
        self.expert_axis, self.data_axes = expert_axis, (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
        self.top_k, self.recipe, self.dtype, self.activation = top_k, recipe, dtype, activation
        self.router = nnx.Linear(in_features, num_experts, use_bias=False, dtype=jnp.float32, rngs=rngs)
        self.up = nnx.Param(_KERNEL_INIT(rngs.params(), (num_experts, in_features, hidden)))
        self.down = nnx.Param(_KERNEL_INIT(rngs.params(), (num_experts, hidden, in_features)))
        self.load_balance = nnx.Intermediate(jnp.zeros((), jnp.float32))
        if self.dispatch == "capacity":  # (ragged dispatch drops nothing: its state is as it was)
            self.dropped = nnx.Intermediate(jnp.zeros((), jnp.int32))
            self.dropped_fraction = nnx.Intermediate(jnp.zeros((), jnp.float32))
        # The keys of the two projections' stochastic rounding (none for bf16).
        self.keys = nnx.data(None if recipe is None else NVFP4Op(recipe, rngs=rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.expert_axis is not None:
            return self._expert_parallel(x)
        tokens = tokens_of(x)
        routing = route(self.router(tokens), self.top_k)
        self.load_balance[...] = routing.load_balance
        keys = (None, None) if self.keys is None else tuple(self.keys.next_key() for _ in range(2))
        up, down, dispatch = self.up[...], self.down[...], (self.dispatch, self.capacity_factor)
        y, dropped = mixture(
            tokens.astype(self.dtype), routing, up, down, self.recipe, keys, self.activation, *dispatch
        )
        if dropped is not None:
            self.dropped[...] = dropped
            self.dropped_fraction[...] = dropped.astype(jnp.float32) / routing.order.size
        return like(y.astype(self.dtype), x)

    def _expert_parallel(self, x: jax.Array) -> jax.Array:
        tokens = x.reshape(-1, x.shape[-1])
        keys = (None, None) if self.keys is None else tuple(self.keys.next_key() for _ in range(2))
        y, dropped, balance = expert_parallel_mlp(
            tokens.astype(self.dtype),
            self.router(tokens),
            self.up[...],
            self.down[...],
            top_k=self.top_k,
            recipe=self.recipe,
            keys=keys,
            activation=self.activation,
            capacity_factor=self.capacity_factor,
            expert_axis=self.expert_axis,
            data_axes=self.data_axes,
        )
        self.load_balance[...] = balance
        self.dropped[...] = dropped
        self.dropped_fraction[...] = dropped.astype(jnp.float32) / (tokens.shape[0] * self.top_k)
        return like(y.astype(self.dtype), x)
