"""Opt-in diagnostics of a linen model's NVFP4 layers: per layer and operand (x, W, dy), how well NVFP4 holds it.

The NVFP4 layers (``NVFP4Dense``, ``NVFP4DenseGeneral``, ``NVFP4DotGeneral`` and the layers rules convert)
sow ``jax_nvfp4.diagnostics.quantization_stats`` of x and W into the ``"nvfp4_stats"`` collection when it is
mutable, and of dy when the ``"nvfp4_dy"`` collection holds the layer's output gradient. Nothing is
computed otherwise: a plain ``apply`` traces the same program as without diagnostics.
``collect_stats(model, variables, loss_fn, *args)`` runs the passes that needs (the output gradients come
from Flax's ``perturb``) and returns ``{layer path: {operand: {stat: float}}}``; ``stats_table`` and
``plot_stats`` show it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jax_nvfp4.diagnostics import STATS, quantization_stats
from jax_nvfp4.linear.recipe import Recipe

STATS_COLLECTION = "nvfp4_stats"
DY_COLLECTION = "nvfp4_dy"  # the layers' output gradients, in; Flax perturbations while collecting them
_DY = "dy"
_DOT_MODULE = "NVFP4DotGeneral_0"  # the dot module an NVFP4 layer makes: its stats are the layer's


def _rows(a: jax.Array, contract: tuple[int, ...]) -> jax.Array:
    """An operand as the GEMM sees it: [every other axis flattened, contracted axes flattened]."""
    keep = [d for d in range(a.ndim) if d not in contract]
    k = math.prod(a.shape[d] for d in contract)
    return a.transpose(*keep, *contract).reshape(-1, k)


def gemm_operand_stats(
    lhs: jax.Array, rhs: jax.Array, dims, recipe: Recipe, dy: jax.Array | None = None, *, rng_key=None
) -> dict[str, dict[str, jax.Array]]:
    """``quantization_stats`` of a GEMM's x and W, and of dy (the gradient of its output) if given, each as the
    recipe's GEMM quantizes it: {"x" | "w" | "dy": {stat: value}}. ``rng_key``: dy's stochastic rounding."""
    (lc, rc), _ = dims
    operands = {"x": _rows(lhs, tuple(lc)), "w": _rows(rhs, tuple(rc))}
    if dy is not None:
        n_out = dy.ndim - (lhs.ndim - len(lc))  # the output's trailing axes that come from rhs
        operands[_DY] = dy.reshape(-1, math.prod(dy.shape[dy.ndim - n_out :]))
    return {
        op: quantization_stats(t, recipe.spec(op, columnwise=False, tokens=t.shape[0]), rng_key=rng_key)
        for op, t in operands.items()
    }


def observe(module: nn.Module, lhs: jax.Array, rhs: jax.Array, dims, recipe: Recipe, y: jax.Array) -> jax.Array:
    """Called by an NVFP4 layer with its GEMM's operands and output ``y``; returns ``y`` (with a perturbation
    while output gradients are collected). Does nothing unless a diagnostics collection is in use."""
    if module.is_initializing() or not isinstance(recipe, Recipe):  # init makes every collection mutable; MXFP8
        return y
    if module.is_mutable_collection(STATS_COLLECTION):
        dy = module.get_variable(DY_COLLECTION, _DY) if module.has_variable(DY_COLLECTION, _DY) else None
        for operand, stats in gemm_operand_stats(lhs, rhs, dims, recipe, dy).items():
            module.sow(STATS_COLLECTION, operand, stats)
    if module.is_mutable_collection(DY_COLLECTION):
        y = module.perturb(_DY, y, collection=DY_COLLECTION)
    return y


def _layer_path(keys: tuple[str, ...]) -> str:
    keys = keys[:-1] if keys and keys[-1] == _DOT_MODULE else keys
    return "/".join(keys)


def collect_stats(
    model: nn.Module, variables: dict, loss_fn: Callable[[Any], jax.Array], *args, rngs=None, **kwargs
) -> dict[str, dict[str, dict[str, float]]]:
    """The NVFP4 statistics of every NVFP4 layer of ``model`` on one batch: ``{layer path: {"x" | "w" | "dy":
    {stat: value}}}``, ``loss_fn(model.apply(variables, *args, **kwargs))`` giving the output gradients.

    Three passes: the output gradients' shapes, the gradients themselves (through Flax's ``perturb``), then a
    forward pass that sows the statistics of x, W and dy (dy quantized with the recipe's spec, stochastic
    rounding with a fixed key)."""
    make_zeros = jax.jit(lambda v, *a: model.apply(v, *a, rngs=rngs, mutable=[DY_COLLECTION], **kwargs))
    _, zeros = make_zeros(variables, *args)

    def loss(dy):
        out, _ = model.apply({**variables, DY_COLLECTION: dy}, *args, rngs=rngs, mutable=[DY_COLLECTION], **kwargs)
        return loss_fn(out)

    dys = jax.jit(jax.grad(loss))(zeros[DY_COLLECTION])
    sow = jax.jit(
        lambda v, dy, *a: model.apply({**v, DY_COLLECTION: dy}, *a, rngs=rngs, mutable=[STATS_COLLECTION], **kwargs)
    )
    _, state = sow(variables, dys, *args)
    stats = {}
    for keys, value in jax.tree_util.tree_flatten_with_path(state[STATS_COLLECTION])[0]:
        names = [k.key for k in keys if isinstance(k, jax.tree_util.DictKey)]
        # .../<layer>[/NVFP4DotGeneral_0]/<operand>/<stat>, the sown tuple's one element in between
        *layer, operand, stat = names
        stats.setdefault(_layer_path(tuple(layer)), {}).setdefault(operand, {})[stat] = float(value)
    return stats


def stats_table(stats: dict[str, dict[str, dict[str, float]]]) -> str:
    """A markdown table: one row per layer and operand, one column per statistic (shares in %)."""
    lines = [
        "| layer | operand | rel. error | underflow | saturated | amax | zero |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for layer, operands in stats.items():
        for operand in ("x", "w", _DY):
            if operand in operands:
                s = operands[operand]
                shares = " | ".join(f"{100 * s[k]:.2f}%" for k in ("underflow", "saturated"))
                zero = f"{100 * s['zero']:.2f}%"
                lines.append(f"| {layer} | {operand} | {s['rel_error']:.4f} | {shares} | {s['amax']:.3g} | {zero} |")
    return "\n".join(lines)


OPERAND_COLORS = {"x": "tab:blue", "w": "tab:orange", _DY: "tab:red"}


def bar_chart(ax, stats: dict[str, dict[str, dict[str, float]]], stat: str = "rel_error") -> None:
    """One statistic per layer on the matplotlib axes ``ax``, a bar per operand, the layers as tick labels."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
    layers = list(stats)
    width = 0.27
    for i, (operand, color) in enumerate(OPERAND_COLORS.items()):
        values = [stats[layer].get(operand, {}).get(stat, np.nan) for layer in layers]
        ax.bar(np.arange(len(layers)) + (i - 1) * width, values, width, color=color, label=operand)
    ax.set_xticks(np.arange(len(layers)), layers, rotation=60, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()


def plot_stats(
    stats: dict[str, dict[str, dict[str, float]]], path: str, *, stat: str = "rel_error", title: str = ""
) -> None:
    """A bar chart of one statistic per layer, a bar per operand; written to ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(stats) + 2), 4.5))
    try:
        bar_chart(ax, stats, stat)
        ax.set(ylabel=stat, title=title or f"NVFP4 {stat} per layer and operand")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)


__all__ = [
    "DY_COLLECTION",
    "OPERAND_COLORS",
    "STATS_COLLECTION",
    "bar_chart",
    "collect_stats",
    "gemm_operand_stats",
    "observe",
    "plot_stats",
    "stats_table",
]
