"""How each NVFP4 primitive shards: Shardy rules and partition functions.

Every op works on [B, rows, cols] with blocks of 16 along rows and/or cols. A
dimension may stay sharded only where each local shard is whole blocks, so the
local kernel makes exactly the bytes of the unsharded one; otherwise the
partition asks for it replicated (XLA then gathers it first).

In the Shardy rules a dimension of size 16k is the compound factor
(k_blocks, 16): its packed form (2 codes a byte) is (k_blocks, 8) and its
block scales are k_blocks, so propagation carries one sharding through the
values, codes and scales of a tensor.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
from jax import lax
from jax.extend import random as jex_random

from jax_nvfp4._primitive import Partitioning
from jax_nvfp4.formats import BLOCK


def _size(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _fits(mesh, size: int, axes: tuple[str, ...], block: int = 1) -> tuple[str, ...]:
    """``axes`` if they split ``size`` into equal shards of whole blocks, else ()."""
    return axes if size % (_size(mesh, axes) * block) == 0 else ()


def _without(axes: tuple[str, ...], used) -> tuple[str, ...]:
    return tuple(a for a in axes if a not in used)


class _Factors:
    """Builds the factor names of a Shardy rule for blocked dimensions."""

    def __init__(self, axis_sizes: tuple[int, ...]):
        self.axis_sizes = axis_sizes
        self.sizes: dict[str, int] = {}
        self.replicated: list[str] = []

    def dim(self, name: str, size: int, *, blocked: bool) -> tuple[str, str, str]:
        """(values, packed codes, block scales) factor strings of dimension ``name``."""
        if size % BLOCK == 0 and all((size // BLOCK) % a == 0 for a in self.axis_sizes):
            # Whole blocks on each mesh axis, so propagation need not split an axis
            # into sub-axes, which custom_partitioning cannot express as a PartitionSpec.
            self.sizes.update({f"{name}b": size // BLOCK, f"{name}16": BLOCK, f"{name}8": BLOCK // 2})
            return f"({name}b {name}16)", f"({name}b {name}8)", f"{name}b"
        if blocked and size % BLOCK:  # a ragged last block: keep the dimension whole
            self.replicated += [name, f"{name}p", f"{name}s"]
        # Otherwise values, codes and scales are not linked: the partition function
        # keeps what it can and XLA reshards the rest.
        return name, f"{name}p", f"{name}s"

    def rule(self, rule: str, **special) -> tuple[str, dict]:
        """``rule`` with its keyword arguments (for the factors it uses)."""
        used = set(rule.replace("(", " ").replace(")", " ").replace(",", " ").split())
        whole = set(re.sub(r"\([^)]*\)", " ", rule).replace(",", " ").split())  # factors that are a whole dim
        replicated = tuple(f for f in self.replicated if f in used)
        if replicated:
            special["need_replication_factors"] = replicated
        # Shardy wants the size of a factor only where no dimension is that factor alone.
        return rule, {**special, **{f: n for f, n in self.sizes.items() if f in used and f not in whole}}


def _pmax_bits(amax, axes: tuple[str, ...]):
    """max over mesh ``axes`` of non-negative float32 (NaN > inf > finite), exactly."""
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    return lax.bitcast_convert_type(lax.pmax(bits, axes), jnp.float32)


def _row_factors(nrows: int) -> list[str]:
    return [f"r{i}" for i in range(nrows)]


# nvfp4_amax: x [B, *R, N] -> [B] (row-scaled: [B, *R] and [B, N])


def _amax_rule(axis_sizes, in_shapes, out_shapes, *, mesh_axes, rht, row_scaled):
    rows = _row_factors(len(in_shapes[0]) - 2)
    x = " ".join(["b", *rows, "n"])
    if row_scaled:  # each result keeps its own dimension; the other is reduced by the partition
        return f"{x} -> " + " ".join(["b", *rows]) + ", b n", {}
    outs = ", ".join(["b"] * len(out_shapes))
    return x + " -> " + outs, {"reduction_factors": (*rows, "n")}


def _amax_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, mesh_axes, rht, row_scaled):
    # With rht the transform mixes 16 consecutive rows: the last row axis stays in whole chunks.
    blocks = [1] * (len(in_shapes[0]) - 2) + [BLOCK if rht else 1, 1]
    dims = tuple(_fits(mesh, n, d, k) for n, d, k in zip(in_shapes[0], in_dims[0], blocks, strict=True))

    def scope(dim_axes) -> tuple[str, ...]:
        return tuple(a for d in dim_axes for a in d if mesh_axes is None or a in mesh_axes)

    if row_scaled:
        # A row's amax is reduced over the shards of its columns, a column's over the shards of the rows.
        reduces = (scope(dims[-1:]), scope(dims[1:-1]))
        outs = [dims[:-1], (dims[0], dims[-1])]
    else:
        reduces = (scope(dims[1:]),) * (2 if rht else 1)
        outs = [dims[:1]] * (2 if rht else 1)

    def local(x):
        return tuple(_pmax_bits(a, r) if r else a for a, r in zip(kernel(x), reduces, strict=True))

    return [dims], outs, local


AMAX = Partitioning(_amax_rule, _amax_partition)


# nvfp4_quantize: x [B, *R, N], amax [B] (row-scaled: [B, *R]), amax_t [B] (row-scaled: [B, N])
# -> rowwise (data, scale), columnwise (data_t, scale_t)


def _quantize_rule(axis_sizes, in_shapes, out_shapes, *, rowwise, columnwise, block_2d, rht, row_scaled, **_):
    *_, m, n = in_shapes[0]
    lead = _row_factors(len(in_shapes[0]) - 3)
    f = _Factors(axis_sizes)
    mv, mp, ms = f.dim("m", m, blocked=columnwise or block_2d)
    nv, np_, ns = f.dim("n", n, blocked=rowwise or block_2d)
    rows = " ".join(["b", *lead])
    outs = []
    if rowwise:
        outs += [f"{rows} {mv} {np_}", f"{rows} {mv} {ns}"]
    if columnwise:
        cols = " ".join(["b", nv, *lead])
        outs += [f"{cols} {mp}", f"{cols} {ms}"]
    # A row-scaled amax goes with its rows, amax_t with the columns.
    amax = f"{rows} {mv}" if _per_row(row_scaled, in_shapes[1]) else "b"
    amax_t = f"b {nv}" if _per_row(row_scaled, in_shapes[2]) else "b"
    return f.rule(f"{rows} {mv} {nv}, {amax}, {amax_t}, seed -> " + ", ".join(outs))


def _per_row(row_scaled: bool, amax_shape: tuple[int, ...]) -> bool:
    """Whether a quantize amax operand is per row ([B, *R] or [B, N]) rather than [B]."""
    return row_scaled and len(amax_shape) > 1


def _quantize_partition(
    mesh, in_dims, out_dims, in_shapes, kernel, *, rowwise, columnwise, block_2d, rht, stochastic, row_scaled, **_
):
    (*lead_sizes, m, n), (*lead, dm, dn) = in_shapes[0], in_dims[0]
    lead = [_fits(mesh, size, d) for size, d in zip(lead_sizes, lead, strict=True)]  # B and all rows but M
    dm = _fits(mesh, m, dm, BLOCK if columnwise or block_2d else 1)
    dn = _fits(mesh, n, dn, BLOCK if rowwise or block_2d else 1)
    rows = (*lead, dm, dn)
    outs = [rows] * 2 * rowwise + [(lead[0], dn, *lead[1:], dm)] * 2 * columnwise
    amax = rows[:-1] if _per_row(row_scaled, in_shapes[1]) else (lead[0],)
    amax_t = (lead[0], dn) if _per_row(row_scaled, in_shapes[2]) else (lead[0],)
    sharded = tuple(a for d in rows for a in d)
    local = kernel
    if stochastic and sharded:
        # The kernel numbers the elements of its shard from 0: give each shard its own key (the shard's
        # index folded into the seed), so that no two shards draw the same random words.
        def local(x, amax, amax_t, seed):
            count = jnp.stack([lax.axis_index(sharded).astype(jnp.uint32), jnp.uint32(0x5EED)])
            return kernel(x, amax, amax_t, jex_random.threefry_2x32(seed, count))

    return [rows, amax, amax_t, ()], outs, local


QUANTIZE = Partitioning(_quantize_rule, _quantize_partition)


# nvfp4_dequantize: data [B, M, ceil(N/2)], scale [B, M, ceil(N/16)], amax [B] or [B, M] -> [B, M, N]


def _dequantize_rule(axis_sizes, in_shapes, out_shapes, *, cols, dtype, e4m3_max):
    f = _Factors(axis_sizes)
    nv, np_, ns = f.dim("n", cols, blocked=True)
    amax = "b m" if len(in_shapes[2]) == 2 else "b"
    return f.rule(f"b m {np_}, b m {ns}, {amax} -> b m {nv}")


def _dequantize_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, cols, dtype, e4m3_max):
    (bsz, m, _), (b, dm, dn) = in_shapes[0], in_dims[0]
    b, dm, dn = _fits(mesh, bsz, b), _fits(mesh, m, dm), _fits(mesh, cols, dn, BLOCK)
    local_cols = cols // _size(mesh, dn)
    amax = (b, dm) if len(in_shapes[2]) == 2 else (b,)
    return [(b, dm, dn)] * 2 + [amax], [(b, dm, dn)], lambda *a: kernel(*a, cols=local_cols)


DEQUANTIZE = Partitioning(_dequantize_rule, _dequantize_partition)


# nvfp4_gemm: a (data, scale, amax) [B, *Ra, *L], c (data, scale, amax) [B, *Rc, *L] -> [B, *Ra, *Rc]
# (the last of the ``contract_ndim`` contracting axes L is packed and blocked)


def _gemm_rule(axis_sizes, in_shapes, out_shapes, *, contract_ndim, length, out_dtype):
    f = _Factors(axis_sizes)
    _, lp, ls = f.dim("l", length, blocked=True)
    lead_l = [f"k{i}" for i in range(contract_ndim - 1)]
    a_rows = [f"a{i}" for i in range(len(in_shapes[0]) - 1 - contract_ndim)]
    c_rows = [f"c{i}" for i in range(len(in_shapes[3]) - 1 - contract_ndim)]
    a, c = (" ".join(["b", *rows, *lead_l]) for rows in (a_rows, c_rows))
    rule = f"{a} {lp}, {a} {ls}, b, {c} {lp}, {c} {ls}, b -> " + " ".join(["b", *a_rows, *c_rows])
    reduction = (*lead_l, "lb") if "lb" in lp else tuple(lead_l)
    return f.rule(rule, reduction_factors=reduction)


def _common_prefix(a: tuple[str, ...], c: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(c)) and a[n] == c[n]:
        n += 1
    return a[:n]


def _gemm_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, contract_ndim, length, out_dtype):
    """Keep the output sharded as wanted; move the *quantized* operands to fit.

    The output takes the sharding propagation asks for (by default a's rows
    and c's rows). A contracting axis stays sharded on the mesh axes both
    operands share (leading ones); the partial float32 sums are then reduced:
    reduce-scattered onto an output axis that wants that mesh axis,
    all-reduced otherwise. Every other mismatch is resolved by resharding the
    operands, i.e. by collectives on packed codes and E4M3 scales.
    """
    k = contract_ndim
    a_shape, c_shape, a_dims, c_dims = in_shapes[0], in_shapes[3], in_dims[0], in_dims[3]
    ra, rc = len(a_shape) - 1 - k, len(c_shape) - 1 - k
    out_sizes = (a_shape[0], *a_shape[1 : 1 + ra], *c_shape[1 : 1 + rc])
    want = out_dims[0] if out_dims is not None else (a_dims[0], *a_dims[1 : 1 + ra], *c_dims[1 : 1 + rc])
    b = _fits(mesh, a_shape[0], want[0])
    l_sizes = (*a_shape[1 + ra : -1], length)
    contract, used = [], b
    for i, size in enumerate(l_sizes):
        axes = _without(_common_prefix(a_dims[1 + ra + i], c_dims[1 + rc + i]), used)
        contract.append(_fits(mesh, size, axes, BLOCK if i == k - 1 else 1))
        used += contract[-1]
    reduced = used[len(b) :]
    out, rows, scatter = [b], [], {}
    for j in range(1, len(out_sizes)):
        kept = _fits(mesh, out_sizes[j], _without(want[j], used))
        used += kept
        rows.append(kept)
        # Contracting mesh axes this output axis wants as its minor-most ones are reduce-scattered onto it.
        extra = want[j][len(kept) :]
        fits = out_sizes[j] % _size(mesh, kept + extra) == 0
        if extra and want[j][: len(kept)] == kept and all(a in reduced for a in extra) and fits:
            scatter[j] = extra
        out.append(kept + scatter.get(j, ()))
    all_reduced = _without(reduced, [a for axes in scatter.values() for a in axes])
    local_length = length // _size(mesh, contract[-1])

    def local(*args):
        (y,) = kernel(*args, length=local_length, out_dtype=jnp.dtype(jnp.float32))
        if all_reduced:
            y = lax.psum(y, all_reduced)
        for dim, axes in scatter.items():
            y = lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)
        return (y.astype(out_dtype),)

    a_op, c_op = (b, *rows[:ra], *contract), (b, *rows[ra:], *contract)
    return [a_op, a_op, (b,), c_op, c_op, (b,)], [tuple(out)], local


GEMM = Partitioning(_gemm_rule, _gemm_partition)
