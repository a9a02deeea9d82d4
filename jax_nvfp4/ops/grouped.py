"""The grouped ops of a mixture of experts, on x [B, M, N] with token rows sorted by group (``reference.grouped``).

``nvfp4_grouped_amax``: x, group_sizes [B, G] -> amax [B] (of the rows in groups) and each group's amax_t
[B, G] (of its RHT chunks with ``rht_amax``); ``per_row``: [B, M] and [B, G, N].

``nvfp4_grouped_quantize``: x, group_sizes, amax, amax_t, seed uint32 [2] (or [4 + M] with a shard's place, as
``nvfp4_quantize``'s), group_seeds uint32 [G, 2] -> the
rowwise copy of x (with ``spec.rowwise``) and the grouped columnwise copy, data_t [B, N, Mp/2] and
scale_t [B, N, P]: every group's columnwise blocks in one copy of at most M + 16 (G - 1) token rows.

Both shard over the batch and the feature axis N; the token rows stay whole (a group's blocks and their
place in the layout depend on all the sizes before it): a token-sharded x is gathered first.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.ops.define import Partitioning, define, shaped
from jax_nvfp4.ops.partition import Factors, fits, placed_seed, pmax_bits
from jax_nvfp4.reference import grouped as ref
from jax_nvfp4.reference.stochastic import check_seed_shape

SCALE_DTYPE = jnp.float8_e4m3fn


def amax_abstract(x, group_sizes, *, rht_amax, per_row):
    del rht_amax
    bsz, rows, n = x.shape
    groups = group_sizes.shape[-1]
    if group_sizes.shape != (bsz, groups):
        raise ValueError(f"group_sizes must be [B, G] for x of shape {x.shape}, got {group_sizes.shape}")
    if per_row:
        return shaped((bsz, rows), jnp.float32), shaped((bsz, groups, n), jnp.float32)
    return shaped((bsz,), jnp.float32), shaped((bsz, groups), jnp.float32)


def _amax_rule(axis_sizes, in_shapes, out_shapes, *, rht_amax, per_row):
    f = Factors(axis_sizes)
    f.replicated += ["m"]  # a group's rows and chunks depend on all the sizes before it
    outs = "b m, b g n" if per_row else "b, b g"
    return f.rule(f"b m n, b g -> {outs}", **({} if per_row else {"reduction_factors": ("n",)}))


def _amax_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, rht_amax, per_row):
    bdim = fits(mesh, in_shapes[0][0], in_dims[0][0])
    ndim = fits(mesh, in_shapes[0][2], in_dims[0][2])
    x = (bdim, (), ndim)
    # A row's (and each group's) max is reduced over the feature shards; a per-feature one stays with its feature.
    reduces = (ndim, () if per_row else ndim)
    outs = [(bdim, ()), (bdim, (), ndim)] if per_row else [(bdim,), (bdim, ())]

    def local(x, group_sizes):
        return tuple(pmax_bits(a, r) if r else a for a, r in zip(kernel(x, group_sizes), reduces, strict=True))

    return [x, (bdim, ())], outs, local


grouped_amax_p = define(
    "nvfp4_grouped_amax",
    abstract_eval=amax_abstract,
    reference=ref.grouped_amax_core,
    partitioning=Partitioning(_amax_rule, _amax_partition),
    ffi_attrs=lambda *, rht_amax, per_row: {"rht_amax": rht_amax, "per_row": per_row},
)


def quantize_abstract(x, group_sizes, amax, amax_t, seed, group_seeds, *, spec: QuantizeSpec):
    spec.check_grouped()
    bsz, rows, n = x.shape
    check_seed_shape(seed.shape, rows)
    groups = group_sizes.shape[-1]
    if group_sizes.shape != (bsz, groups) or group_seeds.shape != (groups, 2):
        raise ValueError(
            f"group_sizes [B, G] and group_seeds [G, 2] for x {x.shape}: got {group_sizes.shape}, {group_seeds.shape}"
        )
    s = spec.copy_shapes((rows,), n)
    want = ((bsz, *s.amax), (bsz, groups, *s.amax_t))
    if (spec.rowwise and amax.shape != want[0]) or amax_t.shape != want[1]:
        raise ValueError(f"grouped amax / amax_t must be {want[0]} / {want[1]}, got {amax.shape} / {amax_t.shape}")
    spec.check_rows(rows)
    mp = BLOCK * ref.grouped_blocks(rows, groups)
    outs = ()
    if spec.rowwise:
        outs += (shaped((bsz, *s.data), jnp.uint8), shaped((bsz, *s.scale), SCALE_DTYPE))
    return (*outs, shaped((bsz, n, mp // 2), jnp.uint8), shaped((bsz, n, mp // BLOCK), SCALE_DTYPE))


def _quantize_rule(axis_sizes, in_shapes, out_shapes, *, spec: QuantizeSpec):
    f = Factors(axis_sizes)
    n = in_shapes[0][2]
    nv, np_, ns = f.dim("n", n, blocked=spec.rowwise)
    f.replicated += ["m", "q", "qs"]
    outs = [f"b m {np_}", f"b m {ns}"] if spec.rowwise else []
    outs += [f"b {nv} q", f"b {nv} qs"]
    # A per-row amax goes with its rows, amax_t with the columns.
    amax = "b m" if len(in_shapes[2]) > 1 else "b"
    amax_t = f"b g {nv}" if len(in_shapes[3]) > 2 else "b g"
    return f.rule(f"b m {nv}, b g, {amax}, {amax_t}, s, g t -> " + ", ".join(outs))


def _quantize_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, spec: QuantizeSpec):
    bdim = fits(mesh, in_shapes[0][0], in_dims[0][0])
    ndim = fits(mesh, in_shapes[0][2], in_dims[0][2], BLOCK if spec.rowwise else 1)
    outs = [(bdim, (), ndim)] * 2 * spec.rowwise + [(bdim, ndim, ())] * 2
    amax = (bdim, ()) if len(in_shapes[2]) > 1 else (bdim,)
    amax_t = (bdim, (), ndim) if len(in_shapes[3]) > 2 else (bdim, ())
    local = kernel
    if spec.draws_random and bdim + ndim:
        # The kernel numbers its shard's elements from 0: tell it where the shard sits (both copies' place).
        def local(x, group_sizes, amax, amax_t, seed, group_seeds):
            seed = placed_seed(mesh, seed, (bdim, (), ndim), in_shapes[0])
            return kernel(x, group_sizes, amax, amax_t, seed, group_seeds)

    return [(bdim, (), ndim), (bdim, ()), amax, amax_t, ((),), ((), ())], outs, local


grouped_quantize_p = define(
    "nvfp4_grouped_quantize",
    abstract_eval=quantize_abstract,
    reference=ref.grouped_quantize_core,
    partitioning=Partitioning(_quantize_rule, _quantize_partition),
    ffi_attrs=lambda *, spec: spec.kernel_attrs(),
    shared=(4, 5),  # the seeds
)


def grouped_amax(x, group_sizes, *, rht_amax: bool = False, per_row: bool = False) -> tuple:
    """The kernels' grouped amax: (amax, amax_t) of x [B, M, N] in groups ``group_sizes`` [B, G] (int32)."""
    return tuple(grouped_amax_p.bind(x, group_sizes, rht_amax=rht_amax, per_row=per_row))


def grouped_quantize(x, group_sizes, amax, amax_t, seed, group_seeds, *, spec: QuantizeSpec) -> tuple:
    """The kernels' grouped quantize: the rowwise copy (``spec.rowwise``), then the grouped columnwise copy."""
    return tuple(grouped_quantize_p.bind(x, group_sizes, amax, amax_t, seed, group_seeds, spec=spec))
