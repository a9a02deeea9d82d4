"""Flax NNX: ``NVFP4DotGeneral``, an NVFP4 ``dot_general`` that keeps its own RNG stream.

Pass it as ``dot_general=`` to ``nnx.Linear`` (or any NNX layer that calls a
``dot_general`` attribute)::

    from jax_nvfp4.flax.nnx.layers import NVFP4DotGeneral

    rngs = nnx.Rngs(0)
    layer = nnx.Linear(64, 32, dot_general=NVFP4DotGeneral(rngs=rngs), rngs=rngs)

``nnx.Linear`` stores ``dot_general`` as an attribute, so the module, and its
stream's key and counter, are part of the layer's graph: under ``nnx.jit`` /
``nnx.value_and_grad`` the counter advances and each step rounds with a new
key, and the same seed reproduces the steps. The module is importable apart
from the linen layers (``jax_nvfp4.flax`` does not import NNX).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jax_nvfp4.core.tensor import CachedWeight, QuantizedWeight
from jax_nvfp4.flax.linen.layers import RNG_STREAM
from jax_nvfp4.flax.linen.layers import promote_dtype as _promote_each
from jax_nvfp4.flax.rules import OnUnmatched, check_layer_operands, check_rules, recipe_for, report_unmatched
from jax_nvfp4.linear.dot_general import dot_general, quantize_weight
from jax_nvfp4.linear.einsum import contracted_sizes, einsum
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.moe.ragged_dot import ragged_dot
from jax_nvfp4.mxfp8 import MXFP8

DEFAULT_RECIPE = Recipe()

# The NVFP4DotGeneral modules observed in the current context (``observing``), by id, each with the callable
# that runs its GEMM meanwhile. Empty outside ``observing``: a plain call traces nothing more.
_OBSERVERS: contextvars.ContextVar[Mapping[int, Callable[..., jax.Array]]] = contextvars.ContextVar(
    "nvfp4_nnx_observers", default=types.MappingProxyType({})
)


@contextlib.contextmanager
def observing(observers: Mapping[NVFP4DotGeneral, Callable[..., jax.Array]]) -> Iterator[None]:
    """Within the block (this thread or task only), each ``NVFP4DotGeneral`` in ``observers`` runs its GEMM by
    calling ``observer(module, lhs, rhs, dims, precision, preferred_element_type, kwargs)`` instead
    (``jax_nvfp4.flax.nnx.diagnostics.collect_stats`` records operands this way)."""
    token = _OBSERVERS.set(types.MappingProxyType({**_OBSERVERS.get(), **{id(m): o for m, o in observers.items()}}))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


def observer_of(module: NVFP4DotGeneral) -> Callable[..., jax.Array] | None:
    """The callable that runs ``module``'s GEMM in the current ``observing`` block, or None."""
    return _OBSERVERS.get().get(id(module))


def nvfp4_stream(rngs: nnx.Rngs) -> nnx.RngStream:
    """The stream of ``rngs`` that NVFP4's stochastic-rounding keys come from: its ``"nvfp4"`` one, else its
    ``default`` (ValueError, saying what to pass, with neither)."""
    if RNG_STREAM not in rngs and "default" not in rngs:
        raise ValueError(
            f"NVFP4 layers take their stochastic-rounding keys from the {RNG_STREAM!r} stream of rngs (else its "
            f"'default' stream), and rngs has only {sorted(rngs)}: pass e.g. nnx.Rngs(..., {RNG_STREAM}=seed)"
        )
    return rngs[RNG_STREAM]


class NVFP4Op(nnx.Module):
    """An NVFP4 operation as an NNX module: its recipe and, with stochastic rounding, its own RNG stream."""

    def __init__(
        self,
        recipe: Recipe = DEFAULT_RECIPE,
        *,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        stack: tuple[int, ...] = (),
        path: str | None = None,
    ) -> None:
        """Args:
        recipe: the NVFP4 recipe; ``Recipe()`` by default (``MXFP8()``: the GEMMs in MXFP8).
        rngs: an ``nnx.Rngs`` (its ``"nvfp4"`` stream, else its ``default``)
          or an ``nnx.RngStream``; used only with ``recipe.needs_rng_key``.
        stack: the leading axes of a layer stacked by ``nnx.vmap`` (its parameters' extra axes): the stream
          holds a key a layer, so that ``nnx.scan`` over the stack hands each layer its own.
        path: the layer's path in its model (``quantize_model`` gives it), for errors that name the layer.
        """
        if not isinstance(recipe, (Recipe, MXFP8)):
            raise TypeError(f"recipe must be a jax_nvfp4.Recipe or a jax_nvfp4.MXFP8, got {type(recipe).__name__}")
        self.recipe = recipe
        self.path = path
        if not (rngs is None or isinstance(rngs, (nnx.Rngs, nnx.RngStream))):
            raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or None, got {type(rngs).__name__}")
        self.rngs: nnx.RngStream | None = nnx.data(None)
        if rngs is not None and recipe.needs_rng_key:
            if isinstance(rngs, nnx.Rngs):
                rngs = nvfp4_stream(rngs)
            # A fork of the stream (one key from it), tagged "nvfp4" whichever stream it came from.
            key = rngs()
            self.rngs = nnx.RngStream(jax.random.split(key, stack) if stack else key, tag=RNG_STREAM)

    def next_key(self) -> jax.Array | None:
        """A fresh stochastic-rounding key from the stream when the recipe needs one and the stream is given."""
        return self.rngs() if self.recipe.needs_rng_key and self.rngs is not None else None

    def _check(self, lhs, rhs, contracted) -> None:
        """A clear error, naming the layer, for operands NVFP4 cannot take."""
        check_layer_operands("the NVFP4 layer", self.path, lhs, rhs, contracted)

    def _key(self, kwargs: dict) -> None:
        """Put a fresh stochastic-rounding key in ``kwargs`` when none is given."""
        if kwargs.get("rng_key") is None:
            kwargs["rng_key"] = self.next_key()


class NVFP4DotGeneral(NVFP4Op):
    """``lax.dot_general`` in NVFP4, as an NNX module for ``dot_general=``.

    With ``recipe.needs_rng_key`` (the default) it forks a stream from
    ``rngs["nvfp4"]`` (``RNG_STREAM``) at construction, as ``nnx.Dropout``
    does, and passes a fresh key from it to each call. ``nnx.Rngs`` falls back
    to its ``default`` stream when it has no ``"nvfp4"`` one (with neither it
    raises); forking draws one key from that stream, so to leave the other
    layers' initialization as without NVFP4, give the stream its own seed:
    ``nnx.Rngs(0, nvfp4=1)``. The forked stream is tagged ``"nvfp4"`` either
    way, so ``nnx.reseed(model, nvfp4=seed)`` reseeds it.

    Without ``rngs`` the forward pass runs, and taking gradients with
    stochastic rounding raises an error that says what to pass. An explicit
    ``rng_key=`` in a call takes precedence over the stream.
    """

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        """``jax_nvfp4.dot_general`` with this module's recipe and, if it rounds stochastically, a new key."""
        observer = observer_of(self)
        if observer is not None:
            return observer(self, lhs, rhs, dimension_numbers, precision, preferred_element_type, kwargs)
        self._check(lhs, rhs, [lhs.shape[int(d)] for d in dimension_numbers[0][0]])
        self._key(kwargs)
        cache = getattr(self, "weight_cache", None)
        if cache is not None and not isinstance(rhs, QuantizedWeight):
            rhs = CachedWeight(rhs, cache[...])
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=self.recipe, **kwargs)


class NVFP4Einsum(NVFP4Op):
    """``jnp.einsum`` of two operands (activations, weights) in NVFP4, as an NNX module for ``nnx.Einsum``'s
    ``einsum_op=``: ``jax_nvfp4.einsum`` with this module's recipe; RNG stream as ``NVFP4DotGeneral``'s."""

    def __call__(self, subscripts: str, lhs, rhs, **kwargs):
        """``jax_nvfp4.einsum`` (every keyword of ``jnp.einsum``) with this module's recipe and, if it rounds
        stochastically, a new key."""
        self._check(lhs, rhs, contracted_sizes(subscripts, lhs, rhs))
        self._key(kwargs)
        return einsum(subscripts, lhs, rhs, recipe=self.recipe, **kwargs)


class NVFP4RaggedDot(NVFP4Op):
    """``lax.ragged_dot`` (mixture of experts) in NVFP4, as an NNX module: ``jax_nvfp4.ragged_dot`` with this
    module's recipe; RNG stream as ``NVFP4DotGeneral``'s."""

    def __call__(self, lhs, rhs, group_sizes, *args, **kwargs):
        """``jax_nvfp4.ragged_dot`` (every argument of ``lax.ragged_dot``) with this module's recipe and a new key."""
        self._check(lhs, rhs, lhs.shape[-1:])
        self._key(kwargs)
        return ragged_dot(lhs, rhs, group_sizes, *args, recipe=self.recipe, **kwargs)


def promote_dtype(args: tuple, /, *, dtype=None, inexact: bool = True) -> tuple:
    """NNX's ``promote_dtype`` (one tuple of values), passing a ``QuantizedWeight`` through as it is."""
    return tuple(_promote_each(*args, dtype=dtype, inexact=inexact))


def quantize_weights(model: nnx.Module, recipe: Recipe | None = None) -> nnx.Module:
    """Store the kernel of every NVFP4 layer of ``model`` as a ``QuantizedWeight``, in place; returns ``model``.

    NVFP4 layers are the ``nnx.Linear`` / ``nnx.LinearGeneral`` whose ``dot_general`` is an
    ``NVFP4DotGeneral`` with an NVFP4 recipe (MXFP8 layers keep their kernels). Each kernel is quantized as that
    module's forward GEMM does (with ``recipe``, else the module's own), and the layer then applies it directly,
    quantizing only its inputs.
    """
    for node, contract_ndim in list(_nvfp4_layers(model)):  # listed first: the loop changes the graph
        if contract_ndim is None:
            raise ValueError("quantize_weights: an nnx.LinearGeneral with batch_axis has no quantized path")
        kernel = node.kernel[...]
        node.kernel = nnx.Param(quantize_weight(kernel, recipe or node.dot_general.recipe, contract_ndim=contract_ndim))
        node.promote_dtype = promote_dtype
    return model


class WeightCache(nnx.Variable):
    """An ``NVFP4DotGeneral``'s weight quantized once for a training step (``cache_weights``): not a parameter,
    so ``nnx.grad`` does not differentiate it; the gradients flow to the layer's kernel."""


def _nvfp4_layers(model: nnx.Module) -> Iterator[tuple[nnx.Module, int | None]]:
    """The NVFP4 ``nnx.Linear`` / ``nnx.LinearGeneral`` layers of ``model`` whose kernel is not quantized yet
    (not MXFP8), each with the number of leading kernel axes it contracts (None: batch axes, no stored form)."""
    for _, node in nnx.iter_graph(model):
        if not (isinstance(node, nnx.Linear | nnx.LinearGeneral) and isinstance(node.dot_general, NVFP4DotGeneral)):
            continue
        if isinstance(node.dot_general.recipe, MXFP8) or isinstance(node.kernel[...], QuantizedWeight):
            continue
        if isinstance(node, nnx.LinearGeneral):
            yield node, None if node.batch_axis else len(node.in_features)
        else:
            yield node, 1


@contextlib.contextmanager
def cache_weights(model: nnx.Module) -> Iterator[nnx.Module]:
    """Within the block, every NVFP4 layer of ``model`` reads its weight quantized once, on entry.

    For gradient accumulation: enter it once per optimizer step (inside the jitted step), run the micro-batches'
    forward and backward passes in it, and update the parameters after it. Each ``NVFP4DotGeneral`` then reads
    its layer's kernel quantized on entry (a ``WeightCache`` variable, which ``nnx.grad`` does not differentiate)
    and its gradient still flows to the kernel, as without the cache (the same quantized operands). The kernel
    is cached in the layer's ``dtype`` where it has one (as the layer promotes it), else as stored; a layer
    whose call promotes it otherwise raises. The caches are removed on exit, so no stale copy outlives the
    step. ``nnx.LinearGeneral`` layers with ``batch_axis`` and MXFP8 layers are not cached.
    """
    ops = []
    for layer, contract_ndim in list(_nvfp4_layers(model)):  # listed first: the loop changes the graph
        if contract_ndim is None:
            continue
        kernel = layer.kernel[...]
        kernel = kernel if layer.dtype is None else kernel.astype(layer.dtype)
        op = layer.dot_general
        op.weight_cache = WeightCache(
            quantize_weight(jax.lax.stop_gradient(kernel), op.recipe, contract_ndim=contract_ndim)
        )
        ops.append(op)
    try:
        yield model
    finally:
        for op in ops:
            del op.weight_cache


class NVFP4Linear(nnx.Linear):
    """``nnx.Linear`` whose GEMM (forward and backward) runs in NVFP4 with ``recipe``.

    Same arguments and parameters as ``nnx.Linear`` (and the same initial values for the same ``rngs``: the
    NVFP4 stream is forked after the parameters are made), plus ``recipe``. Its ``dot_general`` is an
    ``NVFP4DotGeneral`` that takes its stochastic-rounding keys from ``rngs`` (see there).
    """

    def __init__(
        self, in_features: int, out_features: int, *, recipe: Recipe = DEFAULT_RECIPE, rngs: nnx.Rngs, **kwargs
    ):
        if "dot_general" in kwargs:
            raise ValueError("NVFP4Linear computes its GEMM in NVFP4; do not pass dot_general")
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.dot_general = nnx.data(NVFP4DotGeneral(recipe, rngs=rngs))


class NVFP4LinearGeneral(nnx.LinearGeneral):
    """``nnx.LinearGeneral`` whose GEMM (forward and backward) runs in NVFP4 with ``recipe`` (as ``NVFP4Linear``)."""

    def __init__(self, in_features, out_features, *, recipe: Recipe = DEFAULT_RECIPE, rngs: nnx.Rngs, **kwargs):
        if "dot_general" in kwargs or kwargs.get("dot_general_cls") is not None:
            raise ValueError("NVFP4LinearGeneral computes its GEMM in NVFP4; do not pass dot_general(_cls)")
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.dot_general = nnx.data(NVFP4DotGeneral(recipe, rngs=rngs))


def _node_path(path) -> str:
    return "/".join(str(part) for part in path)


def quantize_model(
    model: nnx.Module,
    rules,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    replace: bool = False,
    on_unmatched: OnUnmatched = "warn",
) -> nnx.Module:
    """Route the GEMMs of an unmodified NNX model's layers that ``rules`` match through NVFP4, in place;
    returns ``model``.

    Every ``nnx.Linear`` and ``nnx.LinearGeneral`` (also the projections of ``nnx.MultiHeadAttention``) whose
    path (attribute names joined by ``/``, e.g. ``"blocks/0/attn/query"``) a rule matches gets an
    ``NVFP4DotGeneral`` with that rule's recipe as its ``dot_general``, and every such ``nnx.Einsum`` an
    ``NVFP4Einsum`` as its ``einsum_op``. The parameters are untouched (a checkpoint of the model still
    applies); each converted layer gains the state of its NVFP4 RNG stream, forked from ``rngs`` (its
    ``"nvfp4"`` stream, else ``default``), which stochastic rounding needs for gradients (without it the
    forward pass runs and taking gradients raises). Layers already in NVFP4 are left as they are, unless
    ``replace``: then the rules decide them too, a rule's recipe replacing the layer's (the layer keeps its RNG
    stream) and ``None`` restoring the plain ``dot_general`` / ``einsum``. That is a precision schedule: the
    same model, its parameters and an ``nnx.Optimizer``'s state carried over, switched to other rules part-way
    through training (e.g. to bf16 for the last steps).

    A rule that matches none of these layers' paths is reported before anything changes:
    ``on_unmatched="warn"`` (an ``UnmatchedRuleWarning`` naming the paths and, where the model has numbered
    blocks, the ``keep_ends(block=...)`` pattern they suggest), ``"raise"`` (ValueError) or ``"ignore"``.
    """
    rules = check_rules(rules)
    found = [
        (_node_path(path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Einsum | nnx.Linear | nnx.LinearGeneral)
    ]
    report_unmatched(rules, [path for path, _ in found], on_unmatched, f"quantize_model({type(model).__name__})")
    for path, node in found:
        if isinstance(node, nnx.Einsum):
            _route(node, "einsum_op", path, rules, NVFP4Einsum, jnp.einsum, rngs, replace)
        else:
            _route(node, "dot_general", path, rules, NVFP4DotGeneral, jax.lax.dot_general, rngs, replace)
    return model


def _route(node, attr: str, path: str, rules, op_cls: type, plain, rngs, replace: bool) -> None:
    """Set layer ``node``'s GEMM (its attribute ``attr``: ``plain`` or an ``op_cls``) as ``quantize_model``
    decides by the first of ``rules`` that matches ``path``."""
    recipe, op = recipe_for(rules, path), getattr(node, attr)
    if isinstance(op, op_cls):
        if not replace or (recipe is not None and recipe == op.recipe):
            return
        if recipe is None:
            setattr(node, attr, nnx.static(plain))  # a function again, not data as the op was
            return
        carried = op.rngs is not None and recipe.needs_rng_key
        new = op_cls(recipe, rngs=None if carried else rngs, stack=_stack(node), path=path)
        if carried:
            new.rngs = op.rngs  # the layer's stream goes on where it was
        setattr(node, attr, nnx.data(new))
        return
    if recipe is None:
        return
    if op not in (None, plain) or getattr(node, "dot_general_cls", None) is not None:
        raise ValueError(
            f"{type(node).__name__} at {path!r} has its own {attr}; a rule cannot replace it "
            f"(exclude it with Rule({path!r}, None))"
        )
    setattr(node, attr, nnx.data(op_cls(recipe, rngs=rngs, stack=_stack(node), path=path)))


def _stack(layer: nnx.Linear | nnx.LinearGeneral | nnx.Einsum) -> tuple[int, ...]:
    """The leading axes of a layer made by ``nnx.vmap`` (a stack of layers for ``nnx.scan``): its kernel's axes
    before the ones the layer declares."""
    if isinstance(layer, nnx.Einsum):
        declared = len(layer.kernel_shape)
    elif isinstance(layer, nnx.LinearGeneral):
        declared = len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
    else:
        declared = 2
    shape = layer.kernel[...].shape
    return tuple(shape[: len(shape) - declared])


__all__ = [
    "RNG_STREAM",
    "NVFP4DotGeneral",
    "NVFP4Einsum",
    "NVFP4Linear",
    "NVFP4LinearGeneral",
    "NVFP4RaggedDot",
    "WeightCache",
    "cache_weights",
    "nvfp4_stream",
    "quantize_model",
    "quantize_weights",
]
