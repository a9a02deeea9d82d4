"""``nvfp4_quantize``: x [B, *R, N], amax, amax_t, seed uint32 [2] -> the copies ``spec`` asks for.

  rowwise:    data [B, *R, ceil(N/2)] uint8, scale [B, *R, ceil(N/16)] e4m3, scaled by amax [B]
  columnwise: data_t [B, N, *R[:-1], ceil(M/2)], scale_t [B, N, *R[:-1], ceil(M/16)] (M = R[-1]),
              the quantization of x^T (of its RHT with ``spec.rht``), scaled by amax_t [B]
Row-scaled, amax is [B, *R] (one per row of x) and amax_t [B, N] (one per row of x^T). Stochastic
rounding draws its random words from ``seed``: the key, or on a shard of a sharded tensor the key and
the shard's place in it (uint32 [4 + M], ``reference.stochastic.Place``), so that the shards draw
what the whole tensor draws. The one static parameter is the ``QuantizeSpec``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_nvfp4.core.backend import quantize_on_rows
from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.ops.define import Partitioning, define, shaped
from jax_nvfp4.ops.partition import Factors, fits, placed_seed, row_factors
from jax_nvfp4.reference import kernels
from jax_nvfp4.reference.stochastic import check_seed_shape

SCALE_DTYPE = jnp.float8_e4m3fn


def abstract(x, amax, amax_t, seed, *, spec: QuantizeSpec):
    b, *rows, n = x.shape
    spec.check_amaxes(x.shape, amax.shape, amax_t.shape)
    check_seed_shape(seed.shape, math.prod(rows))
    if len(rows) > 1 and spec.blocked_rows and rows[-1] % BLOCK:
        raise ValueError(f"rows {rows} of several axes need the last to be whole blocks of {BLOCK}")
    spec.check_rows(rows[-1])
    s = spec.copy_shapes(rows, n)
    outs = ()
    if spec.rowwise:
        outs += (shaped((b, *s.data), jnp.uint8), shaped((b, *s.scale), SCALE_DTYPE))
    if spec.columnwise:
        outs += (shaped((b, *s.data_t), jnp.uint8), shaped((b, *s.scale_t), SCALE_DTYPE))
    return outs


def _rule(axis_sizes, in_shapes, out_shapes, *, spec: QuantizeSpec):
    *_, m, n = in_shapes[0]
    lead = row_factors(len(in_shapes[0]) - 3)
    f = Factors(axis_sizes)
    mv, mp, ms = f.dim("m", m, blocked=spec.blocked_rows)
    nv, np_, ns = f.dim("n", n, blocked=spec.blocked_cols)
    rows = " ".join(["b", *lead])
    outs = []
    if spec.rowwise:
        outs += [f"{rows} {mv} {np_}", f"{rows} {mv} {ns}"]
    if spec.columnwise:
        cols = " ".join(["b", nv, *lead])
        outs += [f"{cols} {mp}", f"{cols} {ms}"]
    # A per-row amax goes with its rows, amax_t with the columns.
    amax = f"{rows} {mv}" if len(in_shapes[1]) > 1 else "b"
    amax_t = f"b {nv}" if len(in_shapes[2]) > 1 else "b"
    return f.rule(f"{rows} {mv} {nv}, {amax}, {amax_t}, seed -> " + ", ".join(outs))


def _partition(mesh, in_dims, out_dims, in_shapes, kernel, *, spec: QuantizeSpec):
    (*lead_sizes, m, n), (*lead, dm, dn) = in_shapes[0], in_dims[0]
    lead = [fits(mesh, size, d) for size, d in zip(lead_sizes, lead, strict=True)]  # B and all rows but M
    dm = fits(mesh, m, dm, BLOCK if spec.blocked_rows else 1)
    dn = fits(mesh, n, dn, BLOCK if spec.blocked_cols else 1)
    rows = (*lead, dm, dn)
    outs = [rows] * 2 * spec.rowwise + [(lead[0], dn, *lead[1:], dm)] * 2 * spec.columnwise
    amax = rows[:-1] if len(in_shapes[1]) > 1 else (lead[0],)
    amax_t = (lead[0], dn) if len(in_shapes[2]) > 1 else (lead[0],)
    local = kernel
    if spec.draws_random and any(rows):
        # The kernel numbers its shard's elements from 0: tell it where the shard sits, so that it draws the
        # random words of those positions of the whole tensor.
        def local(x, amax, amax_t, seed):
            return kernel(x, amax, amax_t, placed_seed(mesh, seed, rows, in_shapes[0]))

    return [rows, amax, amax_t, ()], outs, local


quantize_p = define(
    "nvfp4_quantize",
    abstract_eval=abstract,
    reference=kernels.quantize_core,
    partitioning=Partitioning(_rule, _partition),
    adapt=lambda bind, *args, spec: quantize_on_rows(lambda *a, spec: bind(*a))(*args, spec=spec),
    ffi_attrs=lambda *, spec: spec.kernel_attrs(),
    shared=(3,),  # the seed
)


def quantize(x, amax, amax_t, seed, *, spec: QuantizeSpec) -> tuple:
    """The kernel backend's quantize (see ``core.backend.Backend``)."""
    return tuple(quantize_p.bind(x, amax, amax_t, seed, spec=spec))
