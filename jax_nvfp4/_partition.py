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

import jax.numpy as jnp
from jax import lax

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

    def __init__(self):
        self.sizes: dict[str, int] = {}
        self.replicated: list[str] = []

    def dim(self, name: str, size: int, *, blocked: bool) -> tuple[str, str, str]:
        """(values, packed codes, block scales) factor strings of dimension ``name``."""
        if size % BLOCK == 0:
            self.sizes.update({f"{name}16": BLOCK, f"{name}8": BLOCK // 2})
            return f"({name}b {name}16)", f"({name}b {name}8)", f"{name}b"
        if blocked:  # a ragged last block: keep the dimension whole
            self.replicated += [name, f"{name}p", f"{name}s"]
        return name, f"{name}p", f"{name}s"

    def rule(self, rule: str, **special) -> tuple[str, dict]:
        """``rule`` with its keyword arguments (for the factors it uses)."""
        used = set(rule.replace("(", " ").replace(")", " ").replace(",", " ").split())
        replicated = tuple(f for f in self.replicated if f in used)
        if replicated:
            special["need_replication_factors"] = replicated
        return rule, {**special, **{f: n for f, n in self.sizes.items() if f in used}}


def _pmax_bits(amax, axes: tuple[str, ...]):
    """max over mesh ``axes`` of non-negative float32 (NaN > inf > finite), exactly."""
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    return lax.bitcast_convert_type(lax.pmax(bits, axes), jnp.float32)


# nvfp4_amax: x [B, M, N] -> [B]


def _amax_rule(in_shapes, out_shapes, *, mesh_axes):
    return "b m n -> b", {"reduction_factors": ("m", "n")}


def _amax_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, mesh_axes):
    (bsz, m, n), (b, dm, dn) = in_shapes[0], in_dims[0]
    b, dm, dn = _fits(mesh, bsz, b), _fits(mesh, m, dm), _fits(mesh, n, dn)
    reduce = tuple(a for a in dm + dn if mesh_axes is None or a in mesh_axes)

    def local(x):
        (amax,) = kernel(x)
        return (_pmax_bits(amax, reduce) if reduce else amax,)

    return [(b, dm, dn)], [(b,)], local


AMAX = Partitioning(_amax_rule, _amax_partition)


# nvfp4_quantize: x [B, M, N], amax [B] -> rowwise (data, scale), columnwise (data_t, scale_t)


def _quantize_rule(in_shapes, out_shapes, *, rowwise, columnwise, block_2d):
    _, m, n = in_shapes[0]
    f = _Factors()
    mv, mp, ms = f.dim("m", m, blocked=columnwise or block_2d)
    nv, np_, ns = f.dim("n", n, blocked=rowwise or block_2d)
    outs = []
    if rowwise:
        outs += [f"b {mv} {np_}", f"b {mv} {ns}"]
    if columnwise:
        outs += [f"b {nv} {mp}", f"b {nv} {ms}"]
    return f.rule(f"b {mv} {nv}, b -> " + ", ".join(outs))


def _quantize_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, rowwise, columnwise, block_2d):
    (bsz, m, n), (b, dm, dn) = in_shapes[0], in_dims[0]
    b = _fits(mesh, bsz, b)
    dm = _fits(mesh, m, dm, BLOCK if columnwise or block_2d else 1)
    dn = _fits(mesh, n, dn, BLOCK if rowwise or block_2d else 1)
    outs = [(b, dm, dn)] * 2 * rowwise + [(b, dn, dm)] * 2 * columnwise
    return [(b, dm, dn), (b,)], outs, kernel


QUANTIZE = Partitioning(_quantize_rule, _quantize_partition)


# nvfp4_dequantize: data [B, M, ceil(N/2)], scale [B, M, ceil(N/16)], amax [B] -> [B, M, N]


def _dequantize_rule(in_shapes, out_shapes, *, cols, dtype):
    f = _Factors()
    nv, np_, ns = f.dim("n", cols, blocked=True)
    return f.rule(f"b m {np_}, b m {ns}, b -> b m {nv}")


def _dequantize_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, cols, dtype):
    (bsz, m, _), (b, dm, dn) = in_shapes[0], in_dims[0]
    b, dm, dn = _fits(mesh, bsz, b), _fits(mesh, m, dm), _fits(mesh, cols, dn, BLOCK)
    local_cols = cols // _size(mesh, dn)
    return [(b, dm, dn)] * 2 + [(b,)], [(b, dm, dn)], lambda *a: kernel(*a, cols=local_cols)


DEQUANTIZE = Partitioning(_dequantize_rule, _dequantize_partition)


# nvfp4_gemm: a (data, scale, amax) [B, M, L], c (data, scale, amax) [B, N, L] -> [B, M, N]


def _gemm_rule(in_shapes, out_shapes, *, length, out_dtype):
    f = _Factors()
    _, lp, ls = f.dim("l", length, blocked=True)
    reduction = ("lb",) if length % BLOCK == 0 else ()
    return f.rule(f"b m {lp}, b m {ls}, b, b n {lp}, b n {ls}, b -> b m n", reduction_factors=reduction)


def _common_prefix(a: tuple[str, ...], c: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(c)) and a[n] == c[n]:
        n += 1
    return a[:n]


def _gemm_partition(mesh, in_dims, out_dims, in_shapes, kernel, *, length, out_dtype):
    """Keep the output sharded as wanted; move the *quantized* operands to fit.

    The output takes the sharding propagation asks for (by default a's rows
    and c's rows). The contracting axis stays sharded on the mesh axes both
    operands share (leading ones), the partial float32 sums are then reduced:
    reduce-scattered onto an output dimension that wants that mesh axis,
    all-reduced otherwise. Every other mismatch is resolved by resharding the
    operands, i.e. by collectives on packed codes and E4M3 scales.
    """
    (bsz, m, _), (n, _) = in_shapes[0], in_shapes[3][1:]
    a_dims, c_dims = in_dims[0], in_dims[3]
    want_b, want_m, want_n = out_dims[0] if out_dims is not None else (a_dims[0], a_dims[1], c_dims[1])
    b = _fits(mesh, bsz, want_b)
    contract = _fits(mesh, length, _without(_common_prefix(a_dims[2], c_dims[2]), b), BLOCK)
    dm = _fits(mesh, m, _without(want_m, b + contract))
    dn = _fits(mesh, n, _without(want_n, b + dm + contract))
    # Contracting mesh axes that an output dimension wants as its minor-most
    # axes are reduce-scattered onto it; the rest are all-reduced.
    scatter = {}
    for dim, kept, want, size in ((1, dm, want_m, m), (2, dn, want_n, n)):
        extra = want[len(kept) :]
        fits = size % _size(mesh, kept + extra) == 0
        if extra and want[: len(kept)] == kept and all(a in contract for a in extra) and fits:
            scatter[dim] = extra
    scattered = tuple(a for axes in scatter.values() for a in axes)
    all_reduced = _without(contract, scattered)
    local_length = length // _size(mesh, contract)

    def local(*args):
        (y,) = kernel(*args, length=local_length, out_dtype=jnp.dtype(jnp.float32))
        if all_reduced:
            y = lax.psum(y, all_reduced)
        for dim, axes in scatter.items():
            y = lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)
        return (y.astype(out_dtype),)

    a_in = [(b, dm, contract), (b, dm, contract), (b,)]
    c_in = [(b, dn, contract), (b, dn, contract), (b,)]
    out = (b, dm + scatter.get(1, ()), dn + scatter.get(2, ()))
    return a_in + c_in, [out], local


GEMM = Partitioning(_gemm_rule, _gemm_partition)
