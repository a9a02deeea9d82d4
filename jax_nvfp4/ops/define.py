"""One helper that declares a kernel-backed, partitionable JAX primitive.

Each op (one file of this package) is declared once: its name, abstract
evaluation, the pure-JAX reference that defines it, its FFI attributes, and
how it shards (a ``Partitioning``). The helper wires the rest:

- a *kernel* primitive that runs on one device: lowered to the FFI kernel on
  every platform that has one, to the reference elsewhere;
- the public primitive (eager dispatch, abstract eval, batching), lowered
  through ``custom_partitioning`` with a Shardy rule, so under ``jit`` on a
  mesh the kernel runs on local shards and only the collectives the
  ``Partitioning`` asks for are added. On one device, or inside a fully
  manual ``shard_map``, it lowers straight to the kernel.
- a JVP rule that raises ``core.autodiff.not_differentiable``: the ops
  have no derivative, and the error says what to use instead.

Contract shared by every op: each operand and each result has a leading batch
axis [B, ...] of independent problems, so ``vmap`` folds its axis into B.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch  # no public hook: see the note in define()
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_nvfp4.core.autodiff import not_differentiable
from jax_nvfp4.ops import ffi
from jax_nvfp4.sharding.explicit import auto_mesh

Dims = tuple[tuple[str, ...], ...]
"""A sharding as the mesh axes of each dimension: ((), ("data", "fsdp"), ...)."""


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """How an op shards.

    rule: (mesh axis sizes, in_shapes, out_shapes, **params) -> (einsum-like Shardy
      rule, its keyword arguments: factor sizes and special factors).
    partition: (mesh, in_dims, out_dims, in_shapes, kernel, **params) ->
      (in_dims, out_dims, local_fn). ``in_dims``/``out_dims`` are the shardings
      chosen by propagation (``out_dims`` is None when unknown); the op returns
      the shardings it runs with, and ``local_fn`` maps local shards to local
      results (calling ``kernel(*args, **param_overrides)``, plus collectives).
    """

    rule: Callable
    partition: Callable


def define(
    name: str,
    *,
    abstract_eval: Callable,
    reference: Callable,
    partitioning: Partitioning,
    ffi_attrs: Callable[..., dict] = lambda **_: {},
    adapt: Callable | None = None,
    shared: Sequence[int] = (),
    xla_on_gpu: Callable[..., bool] = lambda **_: False,
    resolve: Callable[..., dict] | None = None,
) -> Primitive:
    """Declare primitive ``name`` backed by FFI target ``name`` (multiple results).

    Args:
      abstract_eval: (*avals, **params) -> tuple of ShapedArray.
      reference: (*arrays, **params) -> tuple of arrays; the pure-JAX definition.
      partitioning: the op's Shardy rule and partition function.
      ffi_attrs: (**params) -> the kernel's FFI attributes (params such as the
        output dtype are carried by the result types instead).
      adapt: (bind, *arrays, **params) -> results: runs the kernel (``bind``)
        on operands the public op accepts but the kernel does not as is
        (e.g. reshaped); by default the operands go to the kernel unchanged.
      shared: indices of operands without the leading batch axis, which all
        entries share (e.g. a random seed).
      xla_on_gpu: (**params) -> whether to lower the op through the reference
        (XLA's own ops) on a GPU even where the kernel is built: for ops XLA
        fuses into the op that produces their input, saving the kernel's read.
      resolve: (devices, **params) -> params: parameters decided while the op is lowered, for the devices
        of that compilation (None where the lowering has none), such as the GEMM's ``impl="auto"``.
    """
    kernel_prim = Primitive(name + "_kernel")
    kernel_prim.multiple_results = True
    kernel_prim.def_abstract_eval(abstract_eval)
    # Default lowering everywhere: the reference, which is exact on any backend.
    reference_lowering = mlir.lower_fun(lambda *a, **p: tuple(reference(*a, **p)))
    mlir.register_lowering(kernel_prim, reference_lowering)
    ffi_rule = jax.ffi.ffi_lowering(name)

    def kernel_lowering(ctx, *args, **params):
        return ffi_rule(ctx, *args, **ffi_attrs(**params))

    def cuda_kernel_lowering(ctx, *args, **params):
        if xla_on_gpu(**params):
            return reference_lowering(ctx, *args, **params)
        ffi.check_cuda_devices()  # a GPU the build lacks: a clear error here, not a failed launch
        return kernel_lowering(ctx, *args, **params)

    for platform in ffi.platforms_with(name):
        rule = cuda_kernel_lowering if platform == "cuda" else kernel_lowering
        mlir.register_lowering(kernel_prim, rule, platform=platform)

    prim = Primitive(name)
    prim.multiple_results = True
    prim.ffi_attrs = ffi_attrs  # for whoever calls the FFI target directly (tests/helpers/cuda_host.py)

    @functools.cache
    def jitted(params: tuple) -> Callable:
        return jax.jit(functools.partial(prim.bind, **dict(params)))

    prim.def_impl(lambda *args, **params: jitted(tuple(sorted(params.items())))(*args))
    prim.def_abstract_eval(abstract_eval)

    @functools.cache
    def partitioned(params: tuple) -> Callable:
        return _custom_partitioned(kernel_prim, dict(params), partitioning, adapt)

    def lowering(ctx, *args, **params):
        if resolve is not None:
            params = resolve(_lowering_devices(ctx), **params)
        fn = partitioned(tuple(sorted(params.items())))
        return mlir.lower_fun(lambda *a: fn(*a), multiple_results=True)(ctx, *args)

    mlir.register_lowering(prim, lowering)
    # custom_partitioning needs the device assignment while lowering; jit only
    # passes it for primitives in this set (custom_partitioning's own is there,
    # but ours hides it inside a lowering rule, as TransformerEngine's do).
    dispatch.prim_requires_devices_during_lowering.add(prim)

    def batch_rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        if any(dims[i] is not None for i in shared):
            # A mapped operand that all entries share (a seed): one kernel call per map entry.
            moved = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]
            outs = lax.map(lambda xs: tuple(prim.bind(*xs, **params)), moved)
            return list(outs), [0] * len(outs)
        merged = []
        for i, (a, d) in enumerate(zip(args, dims, strict=True)):
            if i in shared:
                merged.append(a)
                continue
            a = batching.bdim_at_front(a, d, size)  # [size, B, ...]
            merged.append(a.reshape(size * a.shape[1], *a.shape[2:]))
        outs = prim.bind(*merged, **params)
        return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs], [0] * len(outs)

    batching.primitive_batchers[prim] = batch_rule

    def no_jvp(primals, tangents, **params):
        raise not_differentiable(name)  # JAX calls this only where a tangent is nonzero

    ad.primitive_jvps[prim] = no_jvp
    return prim


def _lowering_devices(ctx) -> list | None:
    """The devices a lowering compiles for: jit's device assignment (compile-only devices for an AOT target),
    or a shard_map's mesh; None where the lowering has none (``jax.export``)."""
    context = ctx.module_context.axis_context
    devices = getattr(context, "device_assignment", None)
    if devices is None and isinstance(getattr(context, "mesh", None), jax.sharding.Mesh):
        devices = context.mesh.devices.flat
    return None if devices is None else list(devices)


def _dims(sharding, ndim: int) -> Dims:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    spec = spec + (None,) * (ndim - len(spec))
    return tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec)


def _named(mesh, dims: Dims) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(d if d else None for d in dims)))


def _on_auto_axes(local_fn: Callable) -> Callable:
    """``local_fn`` traced with the current mesh's Explicit axes as Auto.

    custom_partitioning traces the per-shard function while XLA compiles, under whatever mesh is
    current (``jax.set_mesh``). With Explicit axes its ops would carry sharding annotations of the
    global mesh inside a per-device program, which XLA cannot compile (a leftover "Sharding" custom
    call, or a collective whose reduction holds one). The per-shard program has no global layout.
    """

    @functools.wraps(local_fn)
    def traced(*args):
        mesh = auto_mesh()
        if mesh is None:
            return local_fn(*args)
        with jax.sharding.use_abstract_mesh(mesh):
            return local_fn(*args)

    return traced


def _custom_partitioned(kernel_prim: Primitive, params: dict, partitioning: Partitioning, adapt) -> Callable:
    def kernel(*args, **overrides):
        p = {**params, **overrides}
        if adapt is None:
            return tuple(kernel_prim.bind(*args, **p))
        return tuple(adapt(lambda *a: kernel_prim.bind(*a, **p), *args, **p))

    fn = custom_partitioning(kernel)

    def shapes(types) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in types]

    def sharding_rule(mesh, value_types, result_types):
        return partitioning.rule(tuple(mesh.shape.values()), shapes(value_types), shapes(result_types), **params)

    def choose(mesh, arg_shapes, result_shape):
        in_dims = [_dims(a.sharding, len(a.shape)) for a in arg_shapes]
        out_dims = None if result_shape is None else [_dims(r.sharding, len(r.shape)) for r in result_shape]
        in_shapes = [tuple(a.shape) for a in arg_shapes]
        return partitioning.partition(mesh, in_dims, out_dims, in_shapes, kernel, **params)

    def partition(mesh, arg_shapes, result_shape):
        in_dims, out_dims, local_fn = choose(mesh, arg_shapes, result_shape)
        out = tuple(_named(mesh, d) for d in out_dims)
        return mesh, _on_auto_axes(local_fn), out, tuple(_named(mesh, d) for d in in_dims)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        del result_shape  # only the GSPMD partitioner (Shardy off) calls this
        _, out_dims, _ = choose(mesh, arg_shapes, None)
        return tuple(_named(mesh, d) for d in out_dims)

    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=sharding_rule,
    )
    return fn


def shaped(shape, dtype) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))
