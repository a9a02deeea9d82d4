"""``nvfp4_amax``: x [B, *R, N] -> amax float32 [B] (and with ``rht_amax`` the amax of the Random Hadamard
Transform of x^T, from the same pass); ``per_row``: the amax of each row, [B, *R], and of each row of x^T
(of its transform with ``rht_amax``), [B, N]. Sharded, the results are reduced (max) over the mesh axes
``amax_mesh_axes`` (None: all) that split what they are the max of. On a GPU, an amax without the transform
is XLA's reduction (the reference), which XLA fuses into the op producing x; the CPU runs the kernel.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_nvfp4.core.backend import amax_on_rows
from jax_nvfp4.core.checks import unknown_mesh_axes
from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.ops.define import Partitioning, define, shaped
from jax_nvfp4.ops.partition import fits, pmax_bits, row_factors
from jax_nvfp4.reference import kernels


def abstract(x, *, amax_mesh_axes, rht_amax, per_row):
    del amax_mesh_axes
    if per_row:  # one per row of x [B, *R] and one per row of x^T [B, N]
        return shaped(x.shape[:-1], jnp.float32), shaped((x.shape[0], x.shape[-1]), jnp.float32)
    return (shaped(x.shape[:1], jnp.float32),) * (2 if rht_amax else 1)


def _rule(axis_sizes, in_shapes, out_shapes, *, amax_mesh_axes, rht_amax, per_row):
    rows = row_factors(len(in_shapes[0]) - 2)
    x = " ".join(["b", *rows, "n"])
    if per_row:  # each result keeps its own dimension; the other is reduced by the partition
        return f"{x} -> " + " ".join(["b", *rows]) + ", b n", {}
    outs = ", ".join(["b"] * len(out_shapes))
    return x + " -> " + outs, {"reduction_factors": (*rows, "n")}


def _partition(mesh, in_dims, out_dims, in_shapes, kernel, *, amax_mesh_axes, rht_amax, per_row):
    # The mesh may first be known here (jit of an x typed without one, e.g. through in_shardings=).
    unknown_mesh_axes("amax_mesh_axes", amax_mesh_axes, tuple(mesh.axis_names))
    # The transform mixes 16 consecutive rows: the last row axis stays in whole chunks.
    blocks = [1] * (len(in_shapes[0]) - 2) + [BLOCK if rht_amax else 1, 1]
    dims = tuple(fits(mesh, n, d, k) for n, d, k in zip(in_shapes[0], in_dims[0], blocks, strict=True))

    def scope(dim_axes) -> tuple[str, ...]:
        return tuple(a for d in dim_axes for a in d if amax_mesh_axes is None or a in amax_mesh_axes)

    if per_row:
        # A row's amax is reduced over the shards of its columns, a column's over the shards of the rows.
        reduces = (scope(dims[-1:]), scope(dims[1:-1]))
        outs = [dims[:-1], (dims[0], dims[-1])]
    else:
        reduces = (scope(dims[1:]),) * (2 if rht_amax else 1)
        outs = [dims[:1]] * (2 if rht_amax else 1)

    def local(x):
        return tuple(pmax_bits(a, r) if r else a for a, r in zip(kernel(x), reduces, strict=True))

    return [dims], outs, local


amax_p = define(
    "nvfp4_amax",
    abstract_eval=abstract,
    reference=lambda x, *, amax_mesh_axes, rht_amax, per_row: kernels.amax_core(x, rht_amax=rht_amax, per_row=per_row),
    partitioning=Partitioning(_rule, _partition),
    adapt=lambda bind, x, **params: amax_on_rows(lambda x3, **_: bind(x3))(x, **params),
    ffi_attrs=lambda *, amax_mesh_axes, rht_amax, per_row: {"rht_amax": rht_amax, "per_row": per_row},
    # Without the transform the amax is a max over the integer bits, which XLA's GPU compiler fuses into the op
    # that produces x (one multi-output fusion; checked offline for sm_90): no pass of its own, where the
    # kernel reads x again. The transform's amax (a 16-row mix) stays the kernel's.
    xla_on_gpu=lambda *, amax_mesh_axes, rht_amax, per_row: not rht_amax,
)


def amax(x, *, amax_mesh_axes=None, rht_amax: bool = False, per_row: bool = False) -> tuple:
    """The kernel backend's amax (see ``core.backend.Backend``)."""
    return tuple(amax_p.bind(x, amax_mesh_axes=amax_mesh_axes, rht_amax=rht_amax, per_row=per_row))
