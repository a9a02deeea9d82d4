"""``nvfp4_gemm``: a (data, scale, amax) [B, *Ra, *L], c (data, scale, amax) [B, *Rc, *L] -> [B, *Ra, *Rc].

y[b, i, j] = sum over the ``contract_ndim`` axes L of a[b, i, l] * c[b, j, l] times the product of the
global decode scales fp32(amax / 2688) of a and c (amax [B] each); the last L axis is packed and blocked,
``length`` values long. ``impl`` says how the float32 sum is made (``jax_nvfp4.linear.block_sum``): "emulated",
exactly, with a bf16 dot (an E2M1 value times an E4M3 scale is exact in bfloat16 and the products in
float32; only the float32 accumulation rounds), "scaled_dot", by ``lax.scaled_dot`` on the codes as
float4_e2m1fn, "cudnn", by ``jax.nn.scaled_matmul`` on the same operands, or "fused", by a Pallas GEMM that
decodes the packed operands in its tiles; "auto" is decided while the primitive is lowered, for the devices of
that compilation (``block_sum.resolve_impl``). One primitive,
so that it partitions as a whole: whatever collective brings the operands to the layout of the output moves
their packed codes and scales, never dequantized values. Scales travel as their E4M3 bytes (uint8): XLA on
CPU widens float8 collectives to f16.

``keep_c``: the primitive also returns c's codes and scales as the GEMM read them, in the layout it
gathered them to, so that a later GEMM (the backward pass's, of a 16x16-block weight) reuses that gather.

``c_packed_rows``: 0, or c is packed along its rows instead: (data, scale) [B, L, ceil(Rc / 2)] and
[B, L, ceil(Rc / 16)] with Rc = ``c_packed_rows``, contracted along L (``contract_ndim`` 1): a 16x16-block
copy read as its transpose, whose columnwise copy holds the same blocks (``core.transpose``), so that dgrad
reads a weight's rowwise copy as it was kept instead of a transposed copy of its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4.core import bits as b
from jax_nvfp4.core.formats import BLOCK, E2M1_MAX, E4M3_MAX
from jax_nvfp4.core.spec import GlobalScale
from jax_nvfp4.core.transpose import transpose_codes, transpose_scales
from jax_nvfp4.linear.block_sum import resolve_impl
from jax_nvfp4.ops.define import Partitioning, define, shaped
from jax_nvfp4.ops.dequantize import dequantize
from jax_nvfp4.ops.fused_gemm import fused_gemm
from jax_nvfp4.ops.partition import Factors, fits, mesh_size, without


def block_values(data: jax.Array, scale: jax.Array, length: int) -> jax.Array:
    """``E2M1(code) * block_scale`` as bfloat16 [B, R, length]; exact (no global scale).

    The dequantize primitive with amax = 6 * 448, whose global decode scale is 1.
    """
    unit = jnp.full(data.shape[:1], E2M1_MAX * E4M3_MAX, jnp.float32)
    return dequantize(data, scale, unit, cols=length, dtype=jnp.dtype(jnp.bfloat16))


_ONE_ONE = 0x22  # two E2M1 codes of 1.0
_E4M3_ONE = 0x38


def decode_scale(amax: jax.Array, global_scale: GlobalScale | None = None) -> jax.Array:
    """fp32(amax / (6 E)), rounded exactly: an operand's global decode scale (per tensor or per row), E that of
    ``global_scale`` (None: 448).

    Computed as the dequantize op's value of one E2M1 code 1.0 under block scale 1.0 (exactly the global decode
    scale): a kernel backend runs it as a custom call, where the reference's integer emulation of the division,
    in every GEMM of a training step, was much of XLA's compile time on the CPU. Any backend gives its bits.
    """
    amax = jnp.asarray(amax, jnp.float32)
    rows = amax.reshape(amax.shape[0], -1) if amax.ndim > 1 else amax.reshape(-1)  # [B] or per row [B, M]
    ones = jnp.full((rows.shape[0], rows.shape[1] if rows.ndim > 1 else 1, 1), _ONE_ONE, jnp.uint8)
    scale = lax.bitcast_convert_type(jnp.full(ones.shape, _E4M3_ONE, jnp.uint8), jnp.float8_e4m3fn)
    e4m3_max = int(E4M3_MAX) if global_scale is None else global_scale.e4m3_max
    return dequantize(ones, scale, rows, cols=1, dtype=jnp.dtype(jnp.float32), e4m3_max=e4m3_max).reshape(amax.shape)


def scale_product(scales: Sequence[jax.Array]) -> jax.Array:
    """The product of a GEMM's one or two per-tensor decode scales, rounded once (exactly, subnormals kept)."""
    if len(scales) == 1:
        return scales[0]
    a, c = scales
    return b.from_bits(b.mul(b.to_bits(a), b.to_bits(c)))


def global_decode_scale(amax_a: jax.Array, amax_c: jax.Array) -> jax.Array:
    """fp32(amax_a / 2688) * fp32(amax_c / 2688), rounded exactly and symmetric in a and c."""
    # Both decode scales from one dequantize op (on a stacked array): one custom call a GEMM, not two.
    both = decode_scale(jnp.stack(jnp.broadcast_arrays(amax_a, amax_c)))
    return scale_product((both[0], both[1]))


_BATCHED_NT = (((2,), (2,)), ((0,), (0,)))
"""[B, M, K] . [B, N, K] -> [B, M, N]."""
_BATCHED_NN = (((2,), (1,)), ((0,), (0,)))
"""[B, M, K] . [B, K, N] -> [B, M, N]."""


def split(shape, contract_ndim: int) -> tuple[tuple[int, ...], int]:
    """[B, *R, *L] -> (R, prod of the L axes before the last)."""
    return tuple(shape[1 : len(shape) - contract_ndim]), math.prod(shape[len(shape) - contract_ndim : -1])


def _c_rows(shape, contract_ndim: int, c_packed_rows: int) -> tuple[int, ...]:
    """c's rows: R of [B, *R, *L], or (Rc,) of [B, L, ceil(Rc / 2)] packed along them."""
    return (c_packed_rows,) if c_packed_rows else split(shape, contract_ndim)[0]


def _check_packed_rows(c_shape, contract_ndim: int, keep_c: bool, c_packed_rows: int) -> None:
    if c_packed_rows and (contract_ndim != 1 or len(c_shape) != 3 or keep_c):
        raise ValueError("a GEMM operand packed along its rows is [B, L, ceil(R / 2)], contracted along L, not kept")


def _emulated_sum(a_data, a_scale, c_data, c_scale, *, contract_ndim, length, c_packed_rows=0) -> jax.Array:
    """The float32 sum over L of the blocks' values, dequantized to bf16 (exact) and multiplied by a bf16 dot."""

    def values(data, scale):  # [B, *R, *L] -> bf16 [B, prod(R), prod(L)]
        b, rows, lead = data.shape[0], *split(data.shape, contract_ndim)
        scale = lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
        v = block_values(data.reshape(b, -1, data.shape[-1]), scale.reshape(b, -1, scale.shape[-1]), length)
        return v.reshape(b, math.prod(rows), lead * length)

    a = values(a_data, a_scale)
    # XLA's CPU dot sums a single row in another order than each row of a larger product (a matrix-vector
    # path). With a zero row added, a row's sums do not depend on how many rows come with it, so a ragged
    # GEMM's one-token group equals that token's row of any other GEMM.
    single = a.shape[1] == 1
    if single:
        a = jnp.pad(a, ((0, 0), (0, 1), (0, 0)))
    if c_packed_rows:  # c [B, L, Rc]: the dot contracts its axis 1
        # The barrier keeps this decode apart from the forward GEMM's of the same copy (a weight's), which XLA would
        # otherwise share: one bf16 copy of each weight held from the forward pass to the backward.
        c_data = lax.optimization_barrier(c_data)
        c = block_values(c_data, lax.bitcast_convert_type(c_scale, jnp.float8_e4m3fn), c_packed_rows)
        acc = lax.dot_general(a, c, _BATCHED_NN, preferred_element_type=jnp.float32)
    else:
        acc = lax.dot_general(a, values(c_data, c_scale), _BATCHED_NT, preferred_element_type=jnp.float32)
    return acc[:, :1] if single else acc


def _scaled_dot_operand(data: jax.Array, scale: jax.Array, contract_ndim: int, length: int):
    """Packed codes and E4M3 bytes [B, *R, *L] -> ``lax.scaled_dot``'s operand and scale [B, prod(R), prod(L)].

    The codes are bitcast to float4_e2m1fn (two per byte, element 2i in the low nibble, as XLA packs
    them), each row of ``length`` values padded with zero codes to whole blocks of 16, so that the
    contracting axes merge into one whose scale is one E4M3 per 16 values.
    """
    b, rows = data.shape[0], split(data.shape, contract_ndim)[0]
    blocks = -(-length // BLOCK)
    if length % 2:  # the last byte's high nibble lies past the row: zero it, whatever it holds
        data = data.at[..., -1].set(data[..., -1] & jnp.uint8(0x0F))
    pad = [(0, 0, 0)] * (data.ndim - 1) + [(0, blocks * BLOCK // 2 - data.shape[-1], 0)]
    codes = lax.bitcast_convert_type(lax.pad(data, jnp.uint8(0), pad), jnp.float4_e2m1fn)
    scale = lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
    return codes.reshape(b, math.prod(rows), -1), scale.reshape(b, math.prod(rows), -1)


def _scaled_dot_sum(a_data, a_scale, c_data, c_scale, *, contract_ndim, length, cudnn=False) -> jax.Array:
    """The float32 sum over L by ``lax.scaled_dot`` (XLA's block-scaled dot: FP4 tensor cores where it has them),
    or with ``cudnn`` by ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM on Blackwell)."""
    a, a_s = _scaled_dot_operand(a_data, a_scale, contract_ndim, length)
    c, c_s = _scaled_dot_operand(c_data, c_scale, contract_ndim, length)

    if cudnn:
        return jax.nn.scaled_matmul(a, c, a_s, c_s, preferred_element_type=jnp.float32)
    return lax.scaled_dot(
        a, c, lhs_scale=a_s, rhs_scale=c_s, dimension_numbers=_BATCHED_NT, preferred_element_type=jnp.float32
    )


def _reference(
    a_data, a_scale, a_amax, c_data, c_scale, c_amax, *, contract_ndim, length, out_dtype, impl, keep_c,
    c_packed_rows=0,
):  # fmt: skip
    _check_packed_rows(c_data.shape, contract_ndim, keep_c, c_packed_rows)
    # A block-scaled dot takes c's blocks along the contraction: the columnwise copy's bytes, made in memory. (Its
    # float4 values transposed instead, XLA reads them transposed in the GEMM, whose MMA on Blackwell is then f16.)
    if c_packed_rows and impl in ("scaled_dot", "cudnn"):
        c_data = transpose_codes(c_data, length, c_packed_rows)
        c_scale = transpose_scales(c_scale, length, c_packed_rows)
        c_packed_rows = 0
    # One product of the two scales keeps a.c^T and c.a^T transposes of each other, bit for bit. The barrier
    # keeps the scales' integer emulation out of the fusion with the output's multiply and cast, where XLA's CPU
    # compiler can loop for minutes (seen with 19 batch entries of one row: its algebraic simplifier cycles).
    scale = lax.optimization_barrier(global_decode_scale(a_amax, c_amax))
    a_rows, c_rows = split(a_data.shape, contract_ndim)[0], _c_rows(c_data.shape, contract_ndim, c_packed_rows)
    if impl == "fused":  # the kernel applies the scale and the cast itself (``ops.fused_gemm``)
        rows = {"rows_a": math.prod(a_rows), "rows_c": math.prod(c_rows), "c_transposed": bool(c_packed_rows)}
        y = fused_gemm(a_data, a_scale, c_data, c_scale, scale, **rows, length=length, out_dtype=out_dtype)
    elif impl == "emulated":
        acc = _emulated_sum(
            a_data, a_scale, c_data, c_scale, contract_ndim=contract_ndim, length=length, c_packed_rows=c_packed_rows
        )
        y = (acc * scale[:, None, None]).astype(out_dtype)
    else:
        sums = {"contract_ndim": contract_ndim, "length": length, "cudnn": impl == "cudnn"}
        acc = _scaled_dot_sum(a_data, a_scale, c_data, c_scale, **sums)
        y = (acc * scale[:, None, None]).astype(out_dtype)
    y = y.reshape(a_data.shape[0], *a_rows, *c_rows)
    return (y, c_data, c_scale) if keep_c else (y,)


def _abstract(
    a_data, a_scale, a_amax, c_data, c_scale, c_amax, *, contract_ndim, length, out_dtype, impl, keep_c,
    c_packed_rows=0,
):  # fmt: skip
    _check_packed_rows(c_data.shape, contract_ndim, keep_c, c_packed_rows)
    a_rows, c_rows = split(a_data.shape, contract_ndim)[0], _c_rows(c_data.shape, contract_ndim, c_packed_rows)
    y = shaped((a_data.shape[0], *a_rows, *c_rows), out_dtype)
    return (y, shaped(c_data.shape, c_data.dtype), shaped(c_scale.shape, c_scale.dtype)) if keep_c else (y,)


def _rule(axis_sizes, in_shapes, out_shapes, *, contract_ndim, length, out_dtype, impl, keep_c, c_packed_rows=0):
    f = Factors(axis_sizes)
    lv, lp, ls = f.dim("l", length, blocked=True)
    lead_l = [f"k{i}" for i in range(contract_ndim - 1)]
    a_rows = [f"a{i}" for i in range(len(in_shapes[0]) - 1 - contract_ndim)]
    a = " ".join(["b", *a_rows, *lead_l])
    if c_packed_rows:  # c [B, L, Rc]: L its values' factor, Rc packed and blocked
        cv, cp, cs = f.dim("c0", c_packed_rows, blocked=True)
        c_data, c_scale, c_rows = f"b {lv} {cp}", f"b {lv} {cs}", [cv]
    else:
        c_rows = [f"c{i}" for i in range(len(in_shapes[3]) - 1 - contract_ndim)]
        c = " ".join(["b", *c_rows, *lead_l])
        c_data, c_scale = f"{c} {lp}", f"{c} {ls}"
    rule = f"{a} {lp}, {a} {ls}, b, {c_data}, {c_scale}, b -> " + " ".join(["b", *a_rows, *c_rows])
    if keep_c:
        # c as read: factors of their own, not linked to c's (Shardy keeps the reduction's out of results, and a
        # row factor would carry c's sharding before the gather onto it); the partition function gives them
        # the layout the GEMM read c in.
        kept = " ".join(["b", *(f"{f}k" for f in (*c_rows, *lead_l))])
        rule += f", {kept} lpc, {kept} lsc"
    reduction = (*lead_l, "lb") if "lb" in lp else tuple(lead_l)
    return f.rule(rule, reduction_factors=reduction)


def _common_prefix(a: tuple[str, ...], c: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(c)) and a[n] == c[n]:
        n += 1
    return a[:n]


def _partition(
    mesh, in_dims, out_dims, in_shapes, kernel, *, contract_ndim, length, out_dtype, impl, keep_c, c_packed_rows=0
):
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
    if c_packed_rows:  # c [B, L, Rc]
        c_sizes, c_row_dims, c_l_dims = (c_packed_rows,), c_dims[2:], c_dims[1:2]
    else:
        c_sizes, c_row_dims, c_l_dims = c_shape[1 : 1 + rc], c_dims[1 : 1 + rc], c_dims[1 + rc :]
    out_sizes = (a_shape[0], *a_shape[1 : 1 + ra], *c_sizes)
    want = out_dims[0] if out_dims is not None else (a_dims[0], *a_dims[1 : 1 + ra], *c_row_dims)
    b = fits(mesh, a_shape[0], want[0])
    l_sizes = (*a_shape[1 + ra : -1], length)
    contract, used = [], b
    for i, size in enumerate(l_sizes):
        axes = without(_common_prefix(a_dims[1 + ra + i], c_l_dims[i]), used)
        contract.append(fits(mesh, size, axes, BLOCK if i == k - 1 else 1))
        used += contract[-1]
    reduced = used[len(b) :]
    out, rows, scatter = [b], [], {}
    for j in range(1, len(out_sizes)):
        packed = c_packed_rows and j == len(out_sizes) - 1  # c's packed rows: whole blocks a shard
        kept = fits(mesh, out_sizes[j], without(want[j], used), BLOCK if packed else 1)
        used += kept
        rows.append(kept)
        # Contracting mesh axes this output axis wants as its minor-most ones are reduce-scattered onto it.
        extra = want[j][len(kept) :]
        divides = out_sizes[j] % mesh_size(mesh, kept + extra) == 0
        if extra and want[j][: len(kept)] == kept and all(a in reduced for a in extra) and divides:
            scatter[j] = extra
        out.append(kept + scatter.get(j, ()))
    all_reduced = without(reduced, [a for axes in scatter.values() for a in axes])
    local_length = length // mesh_size(mesh, contract[-1])
    local_rows = {"c_packed_rows": c_packed_rows // mesh_size(mesh, rows[-1])} if c_packed_rows else {}

    def local(*args):
        y, *kept = kernel(*args, length=local_length, out_dtype=jnp.dtype(jnp.float32), **local_rows)
        if all_reduced:
            y = lax.psum(y, all_reduced)
        for dim, axes in scatter.items():
            y = lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)
        return (y.astype(out_dtype), *kept)

    a_op = (b, *rows[:ra], *contract)
    c_op = (b, *contract, *rows[ra:]) if c_packed_rows else (b, *rows[ra:], *contract)
    return [a_op, a_op, (b,), c_op, c_op, (b,)], [tuple(out), *([c_op, c_op] if keep_c else [])], local


def _resolve(devices, *, impl, **params) -> dict:
    """The GEMM's parameters for a compilation for ``devices`` (None: unknown): ``impl="auto"`` decided, and
    ``"cudnn"`` (cuDNN's GEMM, a GPU's) made ``"scaled_dot"``, the same sum, for other devices (jax 0.10's
    ``jax.nn.scaled_matmul`` lowers on CUDA only)."""
    impl = resolve_impl(impl, "the GEMM's impl", devices)
    if impl == "cudnn" and devices is not None and not all(d.platform == "gpu" for d in devices):
        impl = "scaled_dot"
    return {**params, "impl": impl}


gemm_p = define(
    "nvfp4_gemm",
    abstract_eval=_abstract,
    reference=_reference,
    partitioning=Partitioning(_rule, _partition),
    resolve=_resolve,
)
