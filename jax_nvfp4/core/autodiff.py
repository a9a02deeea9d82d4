"""What JAX's autodiff meets in the NVFP4 ops: a clear error, from the kernels and the reference alike.

Quantization rounds to a handful of values, so its derivative is zero almost everywhere: a silent
zero gradient (what the reference's integer arithmetic would give) would train nothing, and JAX's
"Differentiation rule for 'nvfp4_amax' not implemented" says nothing of what to use instead. So
every primitive (``ops.define``) and every core op of the reference (``reference.kernels``) raises
``not_differentiable`` when a tangent reaches it: under ``jax.grad``, ``jax.vjp``, ``jax.jvp`` and
``jax.linearize`` alike. Values without a tangent (``lax.stop_gradient``, or inside ``dot_general``'s
custom VJP) pass as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax


def not_differentiable(op: str) -> TypeError:
    """The error for a tangent that reaches the NVFP4 op ``op`` (a primitive's name)."""
    return TypeError(
        f"{op} has no derivative: jax_nvfp4's quantize, dequantize, amax and gemm round to NVFP4 and are not "
        "differentiable. For the gradients of a GEMM in NVFP4 use jax_nvfp4.dot_general (or einsum, "
        "ragged_dot, the Flax layers), whose custom VJP is the training recipe; for quantization-aware "
        "training use jax_nvfp4.fake_quantize (dequantize(quantize(x)) with a straight-through gradient); "
        "to quantize a value without its gradient, pass jax.lax.stop_gradient(x)"
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _refuse_tangents(op: str, arrays: tuple) -> tuple:
    return arrays


@_refuse_tangents.defjvp
def _refuse_tangents_jvp(op: str, primals, tangents):
    raise not_differentiable(op)


def without_derivative(op: str, fn: Callable) -> Callable:
    """``fn(*arrays, **params)`` (a backend's core op, named ``op`` as its primitive is), raising
    ``not_differentiable(op)`` where one of ``arrays`` has a tangent."""

    @functools.wraps(fn)
    def guarded(*arrays, **params):
        return fn(*_refuse_tangents(op, arrays), **params)

    return guarded
