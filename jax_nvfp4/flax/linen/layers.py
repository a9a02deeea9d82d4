"""Flax linen layers: ``nn.Dense`` / ``nn.DenseGeneral`` with NVFP4 GEMMs.

The layers subclass Flax's, so constructor arguments, parameter names, shapes
and initializers are exactly Flax's (a checkpoint of ``nn.Dense`` loads
unchanged); only the GEMM differs. ``NVFP4DotGeneral`` plugs the same GEMM
into any Flax module that takes a ``dot_general_cls``.

For sharded training the layers take logical axis names for their kernel and
bias (``kernel_axes``, ``bias_axes``), as ``nn.with_logical_partitioning``
annotations that ``nn.logical_to_mesh_sharding`` maps onto a mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes as flax_dtypes
from jax import lax

from jax_nvfp4.core.tensor import CachedWeight, QuantizedWeight
from jax_nvfp4.flax.linen import diagnostics
from jax_nvfp4.linear.dot_general import dot_general, quantize_weight
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.mxfp8 import MXFP8

RNG_STREAM = "nvfp4"
"""The Flax RNG stream the layers draw their stochastic-rounding keys from: train with
``model.apply(variables, x, rngs={"nvfp4": key})`` (a fresh key each step)."""

CACHE = "nvfp4_cache"
"""The Flax variable collection of the quantized weights ``cache_weights`` makes: apply the model with
``{"params": params, "nvfp4_cache": cache}`` and its NVFP4 GEMMs read them instead of quantizing the kernels."""


def stream_key(module: nn.Module, recipe: Recipe) -> jax.Array | None:
    """A stochastic-rounding key from the module's ``"nvfp4"`` stream, when the recipe needs one and it is given."""
    return module.make_rng(RNG_STREAM) if recipe.needs_rng_key and module.has_rng(RNG_STREAM) else None


class NVFP4DotGeneral(nn.Module):
    """``lax.dot_general`` in NVFP4, as a module for ``dot_general_cls=``.

    For ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.MultiHeadDotProductAttention``
    (``qkv_dot_general_cls`` / ``out_dot_general_cls``); pass
    ``functools.partial(NVFP4DotGeneral, recipe=...)`` to change the recipe.
    It holds no variables. With ``recipe.needs_rng_key`` it takes a key
    from the ``"nvfp4"`` RNG stream (``RNG_STREAM``) when the stream is given;
    without it, taking gradients raises an error that says so.
    """

    recipe: Recipe = Recipe()

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        """``jax_nvfp4.dot_general`` with this module's recipe (and its cached weight, where ``CACHE`` has one)."""
        if "rng_key" not in kwargs:
            kwargs["rng_key"] = stream_key(self, self.recipe)
        operand = rhs
        if self.has_variable(CACHE, "kernel") and not isinstance(rhs, QuantizedWeight):
            operand = CachedWeight(rhs, self.get_variable(CACHE, "kernel"))
        y = dot_general(
            lhs, operand, dimension_numbers, precision, preferred_element_type, recipe=self.recipe, **kwargs
        )
        if isinstance(rhs, QuantizedWeight):
            return y
        return diagnostics.observe(self, lhs, rhs, dimension_numbers, self.recipe, y)


LogicalAxes = Sequence[str | None]


class _FlatThenReshaped(nn.LogicallyPartitioned):
    """The box of a kernel that ``nn.DenseGeneral`` initializes flat (2-D) and then reshapes.

    Flax constrains the flat value to the kernel's axes when it unboxes it to
    reshape, which fails under ``jax.set_mesh`` (google/flax#3676). This box
    skips the constraint while the ranks differ, and once reshaped it becomes
    Flax's own ``LogicallyPartitioned``, so the parameters hold no type of ours.
    """

    def unbox(self, apply_constraint: bool = True):
        return super().unbox(apply_constraint and jnp.ndim(self.value) == len(self.names))

    def replace_boxed(self, val) -> nn.LogicallyPartitioned:
        return nn.LogicallyPartitioned(val, self.names, mesh=self.mesh, rules=self.rules)


def _logically_partitioned(init: Callable, axes: LogicalAxes | None) -> Callable:
    """``init`` annotated with logical ``axes`` (None: none); idempotent, so clones keep one annotation."""
    init = getattr(init, "_nvfp4_unannotated", init)
    if axes is None:
        return init

    @functools.wraps(init)
    def annotated(*args, **kwargs) -> nn.LogicallyPartitioned:
        value = init(*args, **kwargs)
        box = _FlatThenReshaped if jnp.ndim(value) != len(axes) else nn.LogicallyPartitioned
        return box(value, tuple(axes))

    annotated._nvfp4_unannotated = init
    return annotated


def promote_dtype(*args, dtype=None, inexact: bool = True) -> list:
    """Flax's ``promote_dtype``, passing a ``QuantizedWeight`` through as it is (promoted as its kernel's dtype)."""
    stand_ins = [jnp.zeros((), a.dtype) if isinstance(a, QuantizedWeight) else a for a in args]
    promoted = flax_dtypes.promote_dtype(*stand_ins, dtype=dtype, inexact=inexact)
    return [a if isinstance(a, QuantizedWeight) else p for a, p in zip(args, promoted, strict=True)]


class NVFP4Layer:
    """Mixin: route the parent layer's GEMM through ``NVFP4DotGeneral(recipe)``; annotate its params;
    apply a kernel stored as a ``QuantizedWeight`` (``quantize_weights``) as it is."""

    def param(self, name: str, init_fn, *init_args, **init_kwargs):
        """Flax's ``param``, but a stored ``QuantizedWeight`` kernel is returned without Flax's shape check
        (its arrays are the packed W^T, not the kernel's shape; the weight records that shape)."""
        if name == "kernel" and self.has_variable("params", name):
            stored = self.get_variable("params", name)
            if isinstance(stored, QuantizedWeight):
                return stored
        return super().param(name, init_fn, *init_args, **init_kwargs)

    def _contracted_kernel_axes(self) -> int:
        """How many leading kernel axes the layer contracts (``nn.Dense``: 1)."""
        return 1

    def __post_init__(self) -> None:
        ours = isinstance(self.dot_general_cls, functools.partial) and self.dot_general_cls.func is NVFP4DotGeneral
        if self.dot_general is not None or (self.dot_general_cls is not None and not ours):
            raise ValueError(f"{type(self).__name__} computes its GEMM in NVFP4; do not pass dot_general(_cls)")
        # Flax modules are frozen dataclasses; set the fields before Module initializes.
        object.__setattr__(self, "dot_general_cls", functools.partial(NVFP4DotGeneral, recipe=self.recipe))
        object.__setattr__(self, "kernel_init", _logically_partitioned(self.kernel_init, self.kernel_axes))
        object.__setattr__(self, "bias_init", _logically_partitioned(self.bias_init, self.bias_axes))
        object.__setattr__(self, "promote_dtype", promote_dtype)
        super().__post_init__()


class NVFP4Dense(NVFP4Layer, nn.Dense):
    """``nn.Dense`` whose GEMM (forward and backward) runs in NVFP4.

    Same arguments and parameters as ``nn.Dense``, plus the attributes below.

    Attributes:
      recipe: the NVFP4 recipe.
      kernel_axes: logical axis names of the kernel [in, out], e.g.
        ``("embed", "mlp")``; None leaves ``kernel_init`` unannotated.
      bias_axes: logical axis names of the bias [out].
    """

    recipe: Recipe = Recipe()
    kernel_axes: LogicalAxes | None = None
    bias_axes: LogicalAxes | None = None


class NVFP4DenseGeneral(NVFP4Layer, nn.DenseGeneral):
    """``nn.DenseGeneral`` whose GEMM (forward and backward) runs in NVFP4.

    Same arguments and parameters as ``nn.DenseGeneral``, plus the attributes below.

    Attributes:
      recipe: the NVFP4 recipe.
      kernel_axes: logical axis names of the kernel, one per kernel axis
        (batch axes, contracted input axes, then ``features``).
      bias_axes: logical axis names of the bias (batch axes, then ``features``).
    """

    recipe: Recipe = Recipe()
    kernel_axes: LogicalAxes | None = None
    bias_axes: LogicalAxes | None = None

    def _contracted_kernel_axes(self) -> int:
        if self.batch_dims not in ((), None):
            raise ValueError("quantize_weights: an NVFP4DenseGeneral with batch_dims has no quantized inference path")
        return len(self.axis) if isinstance(self.axis, tuple | list) else 1


def quantize_weights(params, recipe: Recipe | None = None, *, model: nn.Module, inputs: tuple = (), **kwargs):
    """``params`` with the kernel of every NVFP4 layer of ``model`` stored as a ``QuantizedWeight``.

    Runs ``model.apply({"params": params}, *inputs, **kwargs)`` once (jitted; only the inputs' shapes
    matter, a batch of one will do) to find the ``NVFP4Dense`` / ``NVFP4DenseGeneral`` layers, and
    quantizes each kernel as the layer's forward GEMM does (rowwise, with ``recipe``, else the layer's
    own): 0.5625 bytes a value. The same model then applies the returned tree directly, quantizing
    only its activations; every other parameter (embeddings, bf16 and MXFP8 layers, biases) is unchanged.
    """

    def quantize_kernels(next_fun, args, kw, context):
        module = context.module
        if (
            isinstance(module, NVFP4Layer)
            and not isinstance(module.recipe, MXFP8)
            and context.method_name == "__call__"
            and module.has_variable("params", "kernel")
        ):
            kernel = module.get_variable("params", "kernel")
            if not isinstance(kernel, QuantizedWeight):
                n = module._contracted_kernel_axes()
                module.put_variable(
                    "params", "kernel", quantize_weight(kernel, recipe or module.recipe, contract_ndim=n)
                )
        return next_fun(*args, **kw)

    @jax.jit
    def run(params, inputs, kwargs):
        with nn.intercept_methods(quantize_kernels):
            _, variables = model.apply({"params": params}, *inputs, mutable=["params"], **kwargs)
        return variables["params"]

    return run(params, tuple(inputs), kwargs)


def _cached_axes(dimension_numbers) -> int | None:
    """How many leading kernel axes a GEMM contracts, where a cache can serve it (no batch axes), else None."""
    (_, rc), (lb, rb) = dimension_numbers
    rc = tuple(int(a) for a in rc)
    return len(rc) if not lb and not rb and rc == tuple(range(len(rc))) else None


def cache_weights(params, *, model: nn.Module, inputs: tuple = (), **kwargs):
    """The ``CACHE`` collection: every NVFP4 GEMM's weight of ``model`` quantized once, for a training step.

    With gradient accumulation, make it once per optimizer step from the step's ``params`` and apply the
    model in each micro-batch with ``{"params": params, "nvfp4_cache": cache}``: the GEMMs read the cached
    copies (what quantizing the kernels there would give, bit for bit) and the gradients still flow to
    ``params``. Runs ``model.apply`` on ``inputs`` (a batch of one will do; inside a jitted step XLA drops
    everything but the weights' quantization) to find the ``NVFP4DotGeneral`` GEMMs, each cached as it
    quantizes its weight: with the kernel as the layer promotes it and the layer's recipe. GEMMs with batch
    axes (``NVFP4DenseGeneral(batch_dims=...)``) and MXFP8 layers are not cached. A cache made from other
    parameters than the ones applied is not detected: make it each step.
    """

    def cache_kernels(next_fun, args, kw, context):
        module = context.module
        if isinstance(module, NVFP4DotGeneral) and context.method_name == "__call__":
            _, rhs, dimension_numbers = args[:3]
            contract_ndim = _cached_axes(dimension_numbers)
            cacheable = not isinstance(module.recipe, MXFP8) and not isinstance(rhs, QuantizedWeight)
            if cacheable and contract_ndim is not None:
                kernel = lax.stop_gradient(rhs)
                module.put_variable(
                    CACHE, "kernel", quantize_weight(kernel, module.recipe, contract_ndim=contract_ndim)
                )
        return next_fun(*args, **kw)

    @jax.jit
    def run(params, inputs, kwargs):
        with nn.intercept_methods(cache_kernels):
            _, variables = model.apply({"params": params}, *inputs, mutable=[CACHE], **kwargs)
        return variables.get(CACHE, {})

    return run(params, tuple(inputs), kwargs)
