"""Explicit sharding (``jax.set_mesh`` on a mesh with ``AxisType.Explicit`` axes) for the public functions.

Under Explicit axes an array's sharding is part of its type, and each ``lax`` op has a rule that gives
its result's. A ``custom_partitioning`` op has no such rule: its results are typed replicated, whatever
its Shardy rule and partition function then compute, so the program would gather them. JAX offers no
hook for a custom-partitioned op to type its results, so ``explicit_sharding`` wraps a public function
instead, as ``jax.sharding.auto_axes`` does: under a mesh with Explicit axes it runs the function with
those axes Auto (the primitives partition themselves as on an Auto mesh, from the inputs' actual
layout) and reshards its results to the shardings the inputs imply, which the results' types then
carry. On a mesh without Explicit axes, or with none, the function runs as it is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

F = TypeVar("F", bound=Callable)


def auto_mesh() -> AbstractMesh | None:
    """The current mesh (``jax.set_mesh``) with its Explicit axes made Auto; None if it has none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return None
    return mesh.update_axis_types(dict.fromkeys(mesh.explicit_axes, AxisType.Auto))


def spec_of(x) -> PartitionSpec:
    """The sharding an array's type carries, padded with None to one entry a dimension (a constant's: None)."""
    if not isinstance(x, jax.Array):
        return PartitionSpec(*(None,) * np.ndim(x))
    spec = tuple(jax.typeof(x).sharding.spec)
    return PartitionSpec(*spec, *(None,) * (x.ndim - len(spec)))


def dim_axes(entry) -> tuple[str, ...]:
    """A ``PartitionSpec`` entry as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def fit(entry, size: int, block: int = 1):
    """A ``PartitionSpec`` entry if its mesh axes split ``size`` into equal shards of whole ``block``s, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return entry if size % (math.prod(mesh.shape[a] for a in dim_axes(entry)) * block) == 0 else None


def merged(entries, sizes: tuple[int, ...], block: int = 1):
    """The entry of dimensions ``sizes`` (sharded as ``entries``) merged into one, row-major: their mesh axes
    in order, where each shard is then one run of whole ``block``s; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = [dim_axes(e) for e in entries]
    sharded = [i for i, a in enumerate(axes) if a]
    # A shard's rows are one run only if each dimension before the last sharded one is one entry a shard.
    if not sharded or any(sizes[i] != math.prod(mesh.shape[a] for a in axes[i]) for i in range(sharded[-1])):
        return None
    flat = tuple(a for d in axes for a in d)
    return fit(flat if len(flat) > 1 else flat[0], math.prod(sizes), block)


def unmerged(entry, sizes: tuple[int, ...]) -> list:
    """The inverse of ``merged``: entries for dimensions ``sizes`` whose row-major merge is sharded as ``entry``
    (all None where no such entries exist)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes, out = list(dim_axes(entry)), []
    for size in sizes:
        taken = []
        while axes and size % (math.prod(mesh.shape[a] for a in taken) * mesh.shape[axes[0]]) == 0:
            taken.append(axes.pop(0))
        if axes and size != math.prod(mesh.shape[a] for a in taken):
            return [None] * len(sizes)  # a shard would not be one run of the merged dimension
        out.append(tuple(taken) if len(taken) > 1 else taken[0] if taken else None)
    return [None] * len(sizes) if axes else out


def constrain(y: jax.Array, out_sharding) -> jax.Array:
    """``y`` laid out as ``out_sharding`` (None: as it is): a sharding constraint, or, for a ``NamedSharding`` that
    names Explicit axes of its mesh (a sharding constraint may name only Auto ones), a reshard to it, which is
    then ``y``'s type, as ``out_sharding`` is for ``lax.dot_general``."""
    if out_sharding is None:
        return y
    if isinstance(out_sharding, jax.sharding.NamedSharding):
        explicit = set(out_sharding.mesh.abstract_mesh.explicit_axes)
        if explicit & {a for entry in out_sharding.spec for a in dim_axes(entry)}:
            return jax.sharding.reshard(y, out_sharding)
    return jax.lax.with_sharding_constraint(y, out_sharding)


def _without(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    """``spec`` without the mesh ``axes`` (which are about to become Auto, so types no longer name them)."""
    kept = [tuple(a for a in dim_axes(e) if a not in axes) for e in spec]
    return PartitionSpec(*(k if len(k) > 1 else k[0] if k else None for k in kept))


def explicit_sharding(out_specs: Callable[..., Any], *, applies: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Decorator: let a public function built on the custom-partitioned primitives run on Explicit axes.

    ``out_specs(result, *args, **kwargs)`` returns a ``PartitionSpec`` for each array of ``result``
    (a tree of the same structure, or a prefix of it): the shardings ``args`` imply, read from their
    types (``spec_of``). Under a mesh with Explicit axes the function runs with those axes Auto, on
    inputs whose types drop them (no data moves: their layout is what the primitives partition by),
    and its results are resharded to ``out_specs``. Gradients flow back through the reshards, so each
    cotangent gets its input's sharding. ``applies``: keyword arguments that ``out_specs`` accounts for
    (``out_sharding=``), passed to the function as None on Explicit axes, where the resharding applies
    them (a sharding constraint there may name only Auto axes). Without Explicit axes the function runs
    unchanged.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            mesh = auto_mesh()
            if mesh is None:
                return fn(*args, **kwargs)
            axes = tuple(jax.sharding.get_abstract_mesh().explicit_axes)
            leaves, tree = jax.tree.flatten((args, kwargs))
            arrays = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
            specs = [_without(spec_of(leaves[i]), axes) for i in arrays]
            with jax.sharding.use_abstract_mesh(mesh):
                for i, a in zip(arrays, jax.sharding.reshard([leaves[i] for i in arrays], specs), strict=True):
                    leaves[i] = a
                inner_args, inner_kwargs = jax.tree.unflatten(tree, leaves)
                result = fn(*inner_args, **inner_kwargs | {k: None for k in applies if k in kwargs})
            return jax.sharding.reshard(result, out_specs(result, *args, **kwargs))

        return wrapper

    return decorate
