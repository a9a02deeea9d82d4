"""A mixture-of-experts MLP (linen) in NVFP4, its routing and its two dispatches.

Each token goes to its ``top_k`` experts by a float32 router (not quantized: it is small and
decides discrete choices); each expert's GELU MLP runs its two projections in NVFP4 (or in bf16 with
``recipe=None``, the baseline), and the outputs
are summed back per token with the router's weights (softmax over the chosen experts' logits), in
float32. Two dispatches:

- ``"ragged"`` (the default): the rows sorted by expert, one grouped GEMM per projection
  (``jax_nvfp4.ragged_dot`` over all experts' rows); every (token, choice) pair is computed.
- ``"capacity"`` (Switch Transformer, GShard, MaxText): each expert takes at most
  C = ceil(capacity_factor * T * top_k / E) pairs (T tokens, E experts), the first ones in token
  order; the others are dropped (they add 0 to their token's output, their gate weight is lost).
  The kept tokens are scattered into a buffer [E, C, d] (C rounded up to a multiple of 16 rows in
  NVFP4, the extra rows empty) and each projection is ONE batched ``jax_nvfp4.dot_general`` with the
  experts as its batch axis: static shapes, dense GEMMs. Unlike ``ragged_dot``, which gives each
  expert's weight its own amax, the batched GEMM quantizes all experts' weights with one amax (as it
  does every batched operand), so the two dispatches differ in NVFP4 even when nothing is dropped.

The routing and dispatch functions (``jax_nvfp4.moe.dispatch``) are shared with the NNX layer
(``jax_nvfp4.flax.nnx.moe``).

On a mesh with Explicit axes (``jax.set_mesh``) the routing sorts all the tokens together, which JAX
types only for unsharded arrays: the layer takes its tokens unsharded for the routing and the
experts (moving them, as any MoE dispatch does) and gives its output the sharding of its input. With
capacity dispatch the buffer takes the experts' kernels' sharding of E (expert parallelism where they are
sharded) and the experts' outputs come back unsharded. ``expert_axis=`` gives capacity dispatch the GShard /
MaxText layout instead (``jax_nvfp4.moe.expert_parallel``): tokens and experts sharded over that mesh axis,
each token shard routed with its own capacity, its slots sent to the experts by an all-to-all of NVFP4 codes
and scales (uint8), the outputs brought back by a second all-to-all.

The load-balancing loss of Switch Transformer (num_experts * sum_e f_e p_e: f_e the share of
routed rows expert e gets, p_e its mean router probability; 1 when balanced) is sown as
``("losses", "load_balance")``: add ``weight * sum`` of that collection to the training loss.
With capacity dispatch the layer also sows ``("intermediates", "dropped")``, the number of dropped
(token, choice) pairs (int32), and ``("intermediates", "dropped_fraction")``, that number over T * top_k
(float32); apply with ``mutable=["intermediates"]`` to read them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_nvfp4.flax.linen.layers import stream_key
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.moe.dispatch import Dispatch, check_dispatch, check_expert_axis, like, mixture, route, tokens_of
from jax_nvfp4.moe.expert_parallel import expert_parallel_mlp


class MoEMLP(nn.Module):
    """A top-k mixture of GELU MLP experts on the last axis, in NVFP4 (or bf16 with ``recipe=None``).

    Attributes:
      num_experts: E.
      hidden: each expert's hidden width.
      top_k: experts per token.
      recipe: the NVFP4 recipe of the experts' GEMMs; None runs them with ``lax.ragged_dot`` (or
        ``lax.dot_general``, capacity dispatch): the baseline. Stochastic rounding takes its keys from the
        ``"nvfp4"`` RNG stream.
      dtype: the activations' dtype in the GEMMs (parameters stay float32).
      kernel_init: the experts' kernels' initializer (for [E, in, out]).
      activation: the experts' nonlinearity (exact GELU by default).
      dispatch: ``"ragged"`` (every pair, grouped GEMMs ``ragged_dot``) or ``"capacity"`` (at most C pairs
        per expert, batched GEMMs ``dot_general``; see the module's docstring).
      capacity_factor: with capacity dispatch, C = ceil(capacity_factor * T * top_k / E) (at most T).
      expert_axis: with capacity dispatch, expert parallelism: the experts sharded over this axis of the
        current mesh (``jax.set_mesh``), the tokens over ``(*data_axes, expert_axis)``, each token shard
        routed with its own capacity and its slots moved to the experts by all-to-alls that carry NVFP4
        codes (``jax_nvfp4.moe.expert_parallel``). None (default): no expert parallelism.
      data_axes: with ``expert_axis``, the other mesh axes the tokens are sharded on.

    Parameters: ``router`` (a float32 ``nn.Dense`` without bias, [d, E]), ``up`` [E, d, hidden],
    ``down`` [E, hidden, d]. Sows ``("losses", "load_balance")`` and, with capacity dispatch,
    ``("intermediates", "dropped")`` and ``("intermediates", "dropped_fraction")``.
    """

    num_experts: int
    hidden: int
    top_k: int = 2
    recipe: Recipe | None = Recipe()
    dtype: jnp.dtype = jnp.bfloat16
    kernel_init: Callable = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2)
    activation: Callable[[jax.Array], jax.Array] = functools.partial(nn.gelu, approximate=False)
    dispatch: Dispatch = "ragged"
    capacity_factor: float = 1.25
    expert_axis: str | None = None
    data_axes: tuple[str, ...] = ()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        dispatch, capacity_factor = check_dispatch(self.dispatch, self.capacity_factor)
        check_expert_axis(self.expert_axis, dispatch)
        d = x.shape[-1]
        tokens = tokens_of(x) if self.expert_axis is None else x.reshape(-1, d)
        logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32, name="router")(tokens)
        routing = route(logits, self.top_k) if self.expert_axis is None else None
        up = self.param("up", self.kernel_init, (self.num_experts, d, self.hidden))
        down = self.param("down", self.kernel_init, (self.num_experts, self.hidden, d))
        keys = (None, None) if self.recipe is None else tuple(stream_key(self, self.recipe) for _ in range(2))
        if self.expert_axis is not None:
            y, dropped, balance = expert_parallel_mlp(
                tokens.astype(self.dtype),
                logits,
                up,
                down,
                top_k=self.top_k,
                recipe=self.recipe,
                keys=keys,
                activation=self.activation,
                capacity_factor=capacity_factor,
                expert_axis=self.expert_axis,
                data_axes=self.data_axes,
            )
            self.sow("losses", "load_balance", balance)
            self.sow("intermediates", "dropped", dropped)
            self.sow("intermediates", "dropped_fraction", dropped.astype(jnp.float32) / (tokens.shape[0] * self.top_k))
            return like(y.astype(self.dtype), x)
        self.sow("losses", "load_balance", routing.load_balance)
        y, dropped = mixture(
            tokens.astype(self.dtype), routing, up, down, self.recipe, keys, self.activation, dispatch, capacity_factor
        )
        if dropped is not None:
            self.sow("intermediates", "dropped", dropped)
            self.sow("intermediates", "dropped_fraction", dropped.astype(jnp.float32) / routing.order.size)
        return like(y.astype(self.dtype), x)
