"""Flax NNX: ``NVFP4DotGeneral``, an NVFP4 ``dot_general`` that keeps its own RNG stream.

Pass it as ``dot_general=`` to ``nnx.Linear`` (or any NNX layer that calls a
``dot_general`` attribute)::

    from jax_nvfp4.flax.nnx import NVFP4DotGeneral

    rngs = nnx.Rngs(0)
    layer = nnx.Linear(64, 32, dot_general=NVFP4DotGeneral(rngs=rngs), rngs=rngs)

``nnx.Linear`` stores ``dot_general`` as an attribute, so the module, and its
stream's key and counter, are part of the layer's graph: under ``nnx.jit`` /
``nnx.value_and_grad`` the counter advances and each step rounds with a new
key, and the same seed reproduces the steps. The module is importable apart
from the linen layers (``jax_nvfp4.flax`` does not import NNX).
"""

from __future__ import annotations

from flax import nnx

from jax_nvfp4.dot import dot_general, quantize_weight
from jax_nvfp4.flax.linen import RNG_STREAM
from jax_nvfp4.flax.linen import promote_dtype as _promote_each
from jax_nvfp4.recipe import Recipe
from jax_nvfp4.tensor import QuantizedWeight

_DEFAULT_RECIPE = Recipe()


class NVFP4DotGeneral(nnx.Module):
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

    def __init__(self, recipe: Recipe = _DEFAULT_RECIPE, *, rngs: nnx.Rngs | nnx.RngStream | None = None) -> None:
        """Args:
        recipe: the NVFP4 recipe; ``Recipe()`` by default.
        rngs: an ``nnx.Rngs`` (its ``"nvfp4"`` stream, else its ``default``)
          or an ``nnx.RngStream``; used only with ``recipe.needs_rng_key``.
        """
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a jax_nvfp4.Recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        if not (rngs is None or isinstance(rngs, (nnx.Rngs, nnx.RngStream))):
            raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or None, got {type(rngs).__name__}")
        self.rngs: nnx.RngStream | None = nnx.data(None)
        if rngs is not None and recipe.needs_rng_key:
            if isinstance(rngs, nnx.Rngs):
                if RNG_STREAM not in rngs and "default" not in rngs:
                    raise ValueError(
                        f"NVFP4DotGeneral takes its stochastic-rounding keys from the {RNG_STREAM!r} stream of "
                        f"rngs (else its 'default' stream), and rngs has only {sorted(rngs)}: pass e.g. "
                        f"nnx.Rngs(..., {RNG_STREAM}=seed)"
                    )
                rngs = rngs[RNG_STREAM]
            # A fork of the stream (one key from it), tagged "nvfp4" whichever stream it came from.
            self.rngs = nnx.RngStream(rngs(), tag=RNG_STREAM)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        """``jax_nvfp4.dot_general`` with this module's recipe and, if it rounds stochastically, a new key."""
        if self.recipe.needs_rng_key and self.rngs is not None and kwargs.get("rng_key") is None:
            kwargs["rng_key"] = self.rngs()
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=self.recipe, **kwargs)


def promote_dtype(args: tuple, /, *, dtype=None, inexact: bool = True) -> tuple:
    """NNX's ``promote_dtype`` (one tuple of values), passing a ``QuantizedWeight`` through as it is."""
    return tuple(_promote_each(*args, dtype=dtype, inexact=inexact))


def quantize_params(model: nnx.Module, recipe: Recipe | None = None) -> nnx.Module:
    """Store the kernel of every NVFP4 layer of ``model`` as a ``QuantizedWeight``, in place; returns ``model``.

    NVFP4 layers are the ``nnx.Linear`` / ``nnx.LinearGeneral`` whose ``dot_general`` is an
    ``NVFP4DotGeneral``. Each kernel is quantized as that module's forward GEMM does (with ``recipe``,
    else the module's own), and the layer then applies it directly, quantizing only its inputs.
    """
    for _, node in nnx.iter_graph(model):
        if not (isinstance(node, nnx.Linear | nnx.LinearGeneral) and isinstance(node.dot_general, NVFP4DotGeneral)):
            continue
        kernel = node.kernel[...]
        if isinstance(kernel, QuantizedWeight):
            continue
        if isinstance(node, nnx.LinearGeneral):
            if node.batch_axis:
                raise ValueError("quantize_params: an nnx.LinearGeneral with batch_axis has no quantized path")
            contract_ndim = len(node.in_features)
        else:
            contract_ndim = 1
        node.kernel = nnx.Param(quantize_weight(kernel, recipe or node.dot_general.recipe, contract_ndim=contract_ndim))
        node.promote_dtype = promote_dtype
    return model


__all__ = ["RNG_STREAM", "NVFP4DotGeneral", "quantize_params"]
