"""Diagnostics of an NNX model's NVFP4 layers: per layer and operand (x, W, dy), how well NVFP4 holds it.

``collect_stats(model, loss_fn, *args)`` is the NNX counterpart of ``jax_nvfp4.flax.linen.diagnostics.collect_stats``:
it runs the model eagerly twice (a forward pass that records every ``NVFP4DotGeneral``'s operands, then the
gradient of ``loss_fn(model(*args))`` with respect to each one's output) and returns ``{layer path: {"x" |
"w" | "dy": {stat: value}}}`` (see ``jax_nvfp4.diagnostics``), for ``stats_table`` and ``plot_stats``.
Outside it the layers trace nothing more. The model should be deterministic (e.g. dropout off): the passes
run it under ``jax.grad``, where other layers' RNG streams cannot advance. Stochastic rounding uses a fixed
key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_nvfp4.flax.linen.diagnostics import gemm_operand_stats, plot_stats, stats_table
from jax_nvfp4.flax.nnx.layers import NVFP4DotGeneral, observing
from jax_nvfp4.linear.dot_general import dot_general
from jax_nvfp4.linear.recipe import Recipe


class _Observer:
    """Runs one NVFP4DotGeneral's GEMM while collecting: records its operands, adds its output's probe."""

    def __init__(self, key: jax.Array) -> None:
        self.key, self.seen, self.probe = key, None, None

    def __call__(self, op: NVFP4DotGeneral, lhs, rhs, dims, precision, preferred_element_type, kwargs) -> jax.Array:
        if op.recipe.needs_rng_key and kwargs.get("rng_key") is None:
            kwargs = {**kwargs, "rng_key": self.key}  # not the layer's stream: it cannot advance under jax.grad
        y = dot_general(lhs, rhs, dims, precision, preferred_element_type, recipe=op.recipe, **kwargs)
        if self.probe is None:
            self.seen = (lhs, rhs, dims, jax.ShapeDtypeStruct(y.shape, y.dtype))
            return y
        return y + self.probe


def collect_stats(
    model: nnx.Module, loss_fn: Callable[[Any], jax.Array], *args, key: jax.Array | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """The NVFP4 statistics of every ``NVFP4DotGeneral`` layer of ``model`` on one batch (see the module
    docstring); ``key`` for stochastic rounding (default ``jax.random.key(0)``)."""
    key = jax.random.key(0) if key is None else key
    ops = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, NVFP4DotGeneral) and isinstance(node.recipe, Recipe):  # NVFP4 statistics: not MXFP8
            names = [str(p) for p in path]
            ops["/".join(names[:-1] if names and names[-1] == "dot_general" else names)] = node
    observers = {layer: _Observer(key) for layer in ops}
    try:
        with observing({op: observers[layer] for layer, op in ops.items()}):
            loss_fn(model(*args))
            seen = {layer: o.seen for layer, o in observers.items() if o.seen is not None}

            def loss(probes):
                for layer, probe in probes.items():
                    observers[layer].probe = probe
                return loss_fn(model(*args))

            dys = jax.grad(loss)({layer: jnp.zeros(s[3].shape, s[3].dtype) for layer, s in seen.items()})
    finally:
        for o in observers.values():
            o.probe = None
    stats = {}
    for layer, (lhs, rhs, dims, _) in seen.items():
        operands = gemm_operand_stats(lhs, rhs, dims, ops[layer].recipe, dys[layer], rng_key=key)
        stats[layer] = {op: {k: float(v) for k, v in values.items()} for op, values in operands.items()}
    return stats


__all__ = ["collect_stats", "plot_stats", "stats_table"]
