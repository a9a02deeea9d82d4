"""One helper that declares a kernel-backed JAX primitive.

Each op is declared once: its name, abstract evaluation, the pure-JAX
reference that defines it, and which of its parameters are FFI attributes.
The helper wires the rest: eager dispatch, the FFI lowering on every platform
with a registered kernel (the reference lowers it elsewhere, e.g. on a GPU
before the CUDA module has the op), and a batching rule.

Contract shared by every op: each operand and each result has a leading batch
axis [B, ...] of independent problems, so `vmap` folds its axis into B.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_nvfp4 import _ffi


def define(
    name: str,
    *,
    abstract_eval: Callable,
    reference: Callable,
    ffi_attrs: Sequence[str] = (),
) -> Primitive:
    """Declare primitive ``name`` backed by FFI target ``name`` (multiple results).

    Args:
      abstract_eval: (*avals, **params) -> tuple of ShapedArray.
      reference: (*arrays, **params) -> tuple of arrays; the pure-JAX definition.
      ffi_attrs: the params passed to the kernel as attributes (the others,
        e.g. output dtype, are carried by the result types).
    """
    prim = Primitive(name)
    prim.multiple_results = True

    @functools.cache
    def jitted(params: tuple) -> Callable:
        return jax.jit(functools.partial(prim.bind, **dict(params)))

    prim.def_impl(lambda *args, **params: jitted(tuple(sorted(params.items())))(*args))
    prim.def_abstract_eval(abstract_eval)

    # Default lowering everywhere: the reference, which is exact on any backend.
    mlir.register_lowering(prim, mlir.lower_fun(lambda *a, **p: tuple(reference(*a, **p))))
    ffi_rule = jax.ffi.ffi_lowering(name)

    def kernel_lowering(ctx, *args, **params):
        return ffi_rule(ctx, *args, **{k: params[k] for k in ffi_attrs})

    for platform in _ffi.platforms_with(name):
        mlir.register_lowering(prim, kernel_lowering, platform=platform)

    def batch_rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        merged = []
        for a, d in zip(args, dims, strict=True):
            a = batching.bdim_at_front(a, d, size)  # [size, B, ...]
            merged.append(a.reshape(size * a.shape[1], *a.shape[2:]))
        outs = prim.bind(*merged, **params)
        return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs], [0] * len(outs)

    batching.primitive_batchers[prim] = batch_rule
    return prim


def shaped(shape, dtype) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))
