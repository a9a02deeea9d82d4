"""NVFP4 for a linen model you did not write: its layers' GEMMs rerouted by rules, without editing it.

``quantize_model(model, rules)`` wraps an unmodified linen model; inside it (or inside the
``nvfp4_rules(rules)`` context) every ``nn.Dense``, ``nn.DenseGeneral`` (also the projections of
``nn.MultiHeadDotProductAttention``, which are ``DenseGeneral``) and ``nn.Einsum`` whose path a rule
matches runs its GEMM through ``jax_nvfp4.dot_general`` (``nn.Einsum``: ``jax_nvfp4.einsum``) with that
rule's recipe. The parameters are the original model's (same tree, names, shapes, initializers), so a
checkpoint of it applies unchanged. Stochastic rounding draws its keys from the ``"nvfp4"`` RNG stream,
as the NVFP4 layers do. Built on ``nn.intercept_methods``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jax_nvfp4.flax.linen import diagnostics
from jax_nvfp4.flax.linen.layers import NVFP4Layer, stream_key
from jax_nvfp4.flax.rules import (
    OnUnmatched,
    Rule,
    check_layer_operands,
    check_on_unmatched,
    check_rules,
    recipe_for,
    report_unmatched,
)
from jax_nvfp4.linear.dot_general import dot_general
from jax_nvfp4.linear.einsum import contracted_sizes, einsum
from jax_nvfp4.linear.recipe import Recipe

_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum)


def module_path(module: nn.Module) -> str:
    """A linen module's path as the rules match it: its names from the root joined by ``/``."""
    return "/".join(str(name) for name in module.path)


@contextlib.contextmanager
def _fields(module: nn.Module, **values: Any) -> Iterator[None]:
    """Set fields of the (frozen) bound module for the length of one call."""
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            object.__setattr__(module, name, value)


def layer_dot_general(module: nn.Module, recipe: Recipe):
    """The ``dot_general`` a linen layer's GEMM runs in NVFP4 with: ``jax_nvfp4.dot_general`` with ``recipe``, a key
    from the layer's ``"nvfp4"`` stream, and the diagnostics' observer (``quantize_model`` and the Qwix provider)."""

    def nvfp4_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        contracted = [lhs.shape[int(d)] for d in dimension_numbers[0][0]]
        check_layer_operands(type(module).__name__, module_path(module), lhs, rhs, contracted)
        key = stream_key(module, recipe)
        y = dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=recipe, rng_key=key, **kw
        )
        return diagnostics.observe(module, lhs, rhs, dimension_numbers, recipe, y)

    return nvfp4_dot_general


def _dense_call(module: nn.Dense | nn.DenseGeneral, recipe: Recipe, next_fun, args, kwargs):
    """Flax's own ``__call__`` with ``dot_general`` set to NVFP4's."""
    if module.dot_general is not None or module.dot_general_cls is not None:
        raise ValueError(
            f"{type(module).__name__} at {module_path(module)!r} has its own dot_general; a rule cannot replace it "
            f"(exclude it with Rule({module_path(module)!r}, None))"
        )
    with _fields(module, dot_general=layer_dot_general(module, recipe)):
        return next_fun(*args, **kwargs)


def _einsum_call(module: nn.Einsum, recipe: Recipe, inputs, einsum_str: str | None = None):
    """``nn.Einsum.__call__`` with ``jax_nvfp4.einsum`` where Flax calls ``jnp.einsum`` (same parameters, bias
    and dtype promotion)."""
    einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    if "->" not in einsum_str or einsum_str.count(",") != 1:
        raise ValueError(f"nn.Einsum's einsum_str must be explicit ('->') with two operands, got {einsum_str!r}")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    check_layer_operands("nn.Einsum", module_path(module), inputs, kernel, contracted_sizes(einsum_str, inputs, kernel))
    y = einsum(
        einsum_str,
        inputs,
        kernel,
        precision=module.precision,
        preferred_element_type=getattr(module, "preferred_element_type", None),
        recipe=recipe,
        rng_key=stream_key(module, recipe),
    )
    return y if bias is None else y + jnp.reshape(bias, broadcast_shape)


def interceptor(rules: Iterable[Rule], seen: set[str] | None = None):
    """The ``nn.intercept_methods`` interceptor that applies ``rules`` (see ``nvfp4_rules``); it adds the path of
    every layer the rules decide to ``seen``, if given."""
    rules = check_rules(rules)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, _LAYERS) or isinstance(module, NVFP4Layer):
            return next_fun(*args, **kwargs)
        path = module_path(module)
        if seen is not None:
            seen.add(path)
        recipe = recipe_for(rules, path)
        if recipe is None:
            return next_fun(*args, **kwargs)
        if isinstance(module, nn.Einsum):
            return _einsum_call(module, recipe, *args, **kwargs)
        return _dense_call(module, recipe, next_fun, args, kwargs)

    return intercept


@contextlib.contextmanager
def nvfp4_rules(rules: Iterable[Rule], *, on_unmatched: OnUnmatched = "warn") -> Iterator[None]:
    """Inside, the linen ``Dense`` / ``DenseGeneral`` / ``Einsum`` layers that ``rules`` match run in NVFP4.

    For instance::

      with nvfp4_rules([Rule(".*mlp.*", Recipe())]):
          y = model.apply(variables, x, rngs={"nvfp4": key})

    On leaving, a rule that matched none of the layers called inside is reported: ``on_unmatched="warn"`` (an
    ``UnmatchedRuleWarning`` naming the paths seen), ``"raise"`` (ValueError) or ``"ignore"``.
    """
    rules, seen = check_rules(rules), set()
    check_on_unmatched(on_unmatched)  # before the body runs, not after it
    with nn.intercept_methods(interceptor(rules, seen)):
        yield
    report_unmatched(rules, seen, on_unmatched, "nvfp4_rules")


class NVFP4Model(nn.Module):
    """``module`` with ``rules`` applied to its layers (``quantize_model``); the same parameters as ``module``."""

    module: nn.Module
    rules: tuple[Rule, ...]
    on_unmatched: OnUnmatched = "warn"

    def setup(self) -> None:
        nn.share_scope(self, self.module)  # the wrapped model's parameter tree, not nested under "module"

    def __call__(self, *args, **kwargs):
        seen: set[str] = set()
        with nn.intercept_methods(interceptor(self.rules, seen)):
            out = self.module(*args, **kwargs)
        report_unmatched(self.rules, seen, self.on_unmatched, f"quantize_model({type(self.module).__name__})")
        return out


def quantize_model(module: nn.Module, rules: Iterable[Rule], *, on_unmatched: OnUnmatched = "warn") -> NVFP4Model:
    """An unmodified linen model whose layers ``rules`` match run in NVFP4 (see the module docstring).

    ``quantize_model(model, rules).init`` / ``.apply`` take and give ``model``'s own variables; pass the
    ``"nvfp4"`` RNG stream (``rngs={"nvfp4": key}``) for stochastic rounding when training. Each call (``init``
    and ``apply``; under ``jax.jit``, when traced) reports a rule that matched none of the layers it ran:
    ``on_unmatched="warn"`` (an ``UnmatchedRuleWarning`` naming the layers' paths and, where the model has
    numbered blocks, the ``keep_ends(block=...)`` pattern they suggest), ``"raise"`` (ValueError) or
    ``"ignore"``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"quantize_model takes a flax.linen Module, got {type(module).__name__}")
    return NVFP4Model(module, check_rules(rules), check_on_unmatched(on_unmatched))


__all__ = ["NVFP4Model", "interceptor", "layer_dot_general", "module_path", "nvfp4_rules", "quantize_model"]
