"""``jax_nvfp4.ragged_dot``: a drop-in ``lax.ragged_dot`` (mixture-of-experts grouped GEMM) in NVFP4.

lhs x [M, K] holds the tokens sorted by expert, rhs W [G, K, N] one weight per expert, and
``group_sizes`` [G] how many consecutive rows each expert takes: rows of group g give x[r] . W[g].
The custom VJP follows ``dot_general``'s recipe, group by group:

  fprop  y  = x . W_g     x in 1x16 blocks along K (one amax for all tokens), each W_g in 16x16
                          blocks with its own amax, quantized as it is stored (``dot_general``'s)
  dgrad  dx = dy . W_g^T  dy in 1x16 blocks along N, W_g's values decoded from its kept rowwise copy
                          (W_g^T's columnwise copy holds the same 16x16 blocks: no transposed copy)
  wgrad  dW_g = x_g^T dy_g  the columnwise copies of group g's tokens alone, blocked along the tokens,
                          in W's layout [G, K, N] (dW_g^T transposed where a copy is row-scaled)

**Group boundaries in the wgrad copies.** The token blocks of the columnwise copies lie on the
global grid of 16 rows (rows 16j..16j+15). Each group is quantized as its own tensor: a block that a
group boundary cuts holds, in group g's copy, only g's rows (with their own block scale), and the
next group's copy of the same block holds the rest. Each group has its own amax (of its transform,
with the RHT), and with the RHT each 16-row chunk is transformed with the rows outside the group as
zeros. So group g's blocks are the quantization of its rows padded in front by ``start_g mod 16``
zero rows, and no 16-token block mixes two experts' tokens. One grouped quantize
(``reference.grouped``) writes every group's blocks into one copy of at most M + 16 (G - 1) token
rows: residuals about a dense layer's, not G of them.

**The GEMMs, once each.** An E2M1 value times its E4M3 block scale is exact in bfloat16, so each
product runs as one grouped GEMM of the decoded blocks with float32 accumulation, and each group's
global decode scales apply to its float32 result, in ``gemm``'s order (the product of the
per-tensor scales, then the per-row ones): fprop and dgrad as one ``lax.ragged_dot``, wgrad as one
``lax.ragged_dot_general`` contracting each group's segment of the grouped copies. The cost is that
of the backend's own grouped GEMM of bf16 operands plus the quantization. Each group's result equals
``gemm`` of the group's quantized blocks wherever the float32 sums are exact; otherwise the two
differ only in the order of the float32 accumulation. ``Recipe(impl="fused")`` runs the three as the fused
grouped GEMMs instead (``ops.fused_ragged_gemm``: the packed copies decoded in their tiles, with no bf16 copy of
an operand and no dense expansion of the ragged product): fprop and dgrad over (row tile, expert) pairs, wgrad
over each group's segment of the grouped copies. The other impls all run the grouped GEMMs of decoded blocks
(XLA has no block-scaled ragged dot).

**Sharding.** The grouped quantize keeps the token rows whole (a group's place in the grouped copy
depends on every size before it); under ``jit`` it shards over the features, and XLA partitions the
grouped GEMMs of the decoded values.

Rows past ``sum(group_sizes)`` give zeros (as in ``lax.ragged_dot``) and take no part in any amax.

Stochastic rounding uses ``jax.random.split(rng_key, G + 1)``: key 0 for dy's rowwise copy, key
1 + g for group g's columnwise blocks (the random words of each element at its place in the
[N, M] copy, as a per-group quantization of the whole tensor would draw them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_nvfp4.core.pipeline import quantize_batch
from jax_nvfp4.core.tensor import NVFP4Tensor
from jax_nvfp4.linear.block_sum import resolve_impl
from jax_nvfp4.linear.dot_general import (
    DotConfig,
    check_operands,
    check_options,
    check_result,
    weight_copies,
    weight_residual,
)
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.linear.remat import ACTIVATION, OUTPUT, named, saved_weight
from jax_nvfp4.moe.grouped import GroupedCopies, Scaled, quantize_grouped
from jax_nvfp4.ops import KERNELS
from jax_nvfp4.ops.fused_ragged_gemm import fused_ragged_gemm, fused_segment_gemm
from jax_nvfp4.ops.gemm import block_values, decode_scale, scale_product
from jax_nvfp4.reference.grouped import bounds, segment_sizes
from jax_nvfp4.sharding.explicit import constrain, explicit_sharding, spec_of

_WGRAD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
)
"""[K, Mp] . [N, Mp] -> [G, K, N], each group contracting its segment of the tokens."""


def check_group_sizes(group_sizes, rows: int) -> None:
    """ValueError where concrete ``group_sizes`` hold a negative size or sum past ``rows`` (lhs's M). Traced
    ones cannot be read: a negative size then counts as zero and a sum past M cuts the last groups at M."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes).astype(np.int64)  # their sum can pass 2^31 (not every platform sums in 64 bits)
    if (sizes < 0).any():
        g = int(np.argmax(sizes < 0))
        raise ValueError(f"group_sizes must be >= 0, got {int(sizes[g])} for group {g} (group_sizes={sizes.tolist()})")
    if sizes.sum() > rows:
        raise ValueError(
            f"group_sizes sum to {int(sizes.sum())}, past lhs's {rows} rows (group_sizes={sizes.tolist()}): "
            "each row belongs to at most one group"
        )


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of ``rows`` rows (int32 [rows]); G for rows past the last group."""
    ends = bounds(group_sizes, rows)[1]
    return jnp.sum(jnp.arange(rows, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _cut_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group sizes with their sum cut at ``rows`` (later groups lose rows, as ``group_ids`` assigns them)."""
    starts, ends = bounds(group_sizes, rows)
    return ends - starts


def _experts(w: jax.Array, recipe: Recipe, columnwise: bool) -> NVFP4Tensor:
    """W [G, K, N], each expert quantized on its own (own amax) as it is stored, as W^T [G, N, K] (its rowwise
    copy, and the columnwise one if asked: ``weight_copies``)."""
    t = jax.vmap(lambda wg: weight_copies(wg[None], recipe, columnwise=columnwise))(w)
    squeeze = lambda a: None if a is None else a.reshape(a.shape[0], *a.shape[2:])  # noqa: E731
    arrays = [squeeze(a) for a in (t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t)]
    return NVFP4Tensor(*arrays, (w.shape[0], *t.shape[1:]), t.dtype, t.spec, batched=True)


def _expert_values(qw: NVFP4Tensor, columnwise: bool) -> Scaled:
    """Each expert's values as ``lax.ragged_dot``'s rhs [G, in, out] and its scales [G]: W for the forward
    GEMM (from W^T's rowwise copy), W^T for the backward one (from its columnwise copy)."""
    data, scale, amax = (qw.data_t, qw.scale_t, qw.amax_t) if columnwise else (qw.data, qw.scale, qw.amax)
    values = block_values(data, scale, qw.shape[1] if columnwise else qw.shape[2])
    return Scaled(jnp.swapaxes(values, 1, 2), amax, qw.spec.global_scale)


def _dgrad_values(qw: NVFP4Tensor) -> Scaled:
    """W^T's values as the dgrad GEMM's rhs [G, N, K]: from its columnwise copy, or where only the rowwise one is
    kept (16x16 blocks, which both copies share) from that: no transposed copy of its bytes. The barrier keeps this
    decode apart from the forward GEMM's, which XLA would share (a bf16 copy of W held from forward to backward)."""
    if qw.data_t is not None:
        return _expert_values(qw, columnwise=True)
    values = block_values(lax.optimization_barrier(qw.data), qw.scale, qw.shape[2])
    return Scaled(values, qw.amax, qw.spec.global_scale)


def _scaled(acc: jax.Array, per_tensor: list[jax.Array], per_row: list[jax.Array], out_dtype) -> jax.Array:
    """The float32 sums times the operands' global decode scales, in ``gemm``'s order: the product of the
    per-tensor ones (rounded once), then each per-row one; cast to ``out_dtype``. Each scale broadcasts
    against ``acc`` already."""
    if per_tensor:
        acc = acc * scale_product(per_tensor)
    for s in per_row:
        acc = acc * s
    return acc.astype(out_dtype)


def _decode(op: Scaled) -> jax.Array:
    # The barrier keeps the scales' integer emulation out of the fusion with the output's multiply (as gemm's).
    return lax.optimization_barrier(decode_scale(op.amax, op.global_scale))


def _token_gemm(tokens: Scaled, experts: Scaled, sizes: jax.Array, ids: jax.Array, out_dtype) -> jax.Array:
    """Rows [M, L] of the tokens times their group's expert [G, L, n] -> [M, n] (fprop and dgrad)."""
    groups = experts.values.shape[0]
    acc = lax.ragged_dot(tokens.values, experts.values, sizes, preferred_element_type=jnp.float32)
    expert = _decode(experts)[jnp.minimum(ids, groups - 1)][:, None]  # each row's expert's scale
    token = _decode(tokens)
    per_tensor, per_row = [expert], []
    if tokens.global_scale.per_row:
        per_row.append(token[:, None])
    else:
        per_tensor.insert(0, jnp.broadcast_to(token, expert.shape))
    y = _scaled(acc, per_tensor, per_row, out_dtype)
    return jnp.where((ids < groups)[:, None], y, jnp.zeros((), y.dtype))


def _weight_gemm(a: Scaled, c: Scaled, segments: jax.Array, out_dtype) -> jax.Array:
    """Each group's columnwise copies [K, Mp] and [N, Mp] contracted over its segment -> [G, K, N] (wgrad; a's
    row scales apply first, as in ``gemm``)."""
    acc = lax.ragged_dot_general(a.values, c.values, segments, _WGRAD, preferred_element_type=jnp.float32)
    sa, sc = _decode(a), _decode(c)
    a_rows, c_rows = a.global_scale.per_row, c.global_scale.per_row
    per_tensor = [s[:, None, None] for s, rows in ((sa, a_rows), (sc, c_rows)) if not rows]
    per_row = ([sa[:, :, None]] if a_rows else []) + ([sc[:, None, :]] if c_rows else [])
    return _scaled(acc, per_tensor, per_row, out_dtype)


def _fused_weight_gemm(a: GroupedCopies, c: GroupedCopies, segments: jax.Array, out_dtype) -> jax.Array:
    """dW [G, K, N] from x's (``a``) and dy's (``c``) grouped copies by the fused segment GEMM
    (``Recipe(impl="fused")``): their packed codes and scales decoded in the kernel's tiles (no bf16 copy of
    either, no dense expansion of the ragged product). The epilogue in the emulation's order: the product of the
    per-tensor scales, then the row scales, dy's first where either copy has them (the emulation's dW^T
    order), so that no transpose of dW follows."""
    (sa, a_rows), (sc, c_rows) = ((_decode(_column_scales(q)), q.spec.global_scale.per_row) for q in (a, c))
    groups = segments.shape[0]
    per_tensor = [s for s, per_row in ((sa, a_rows), (sc, c_rows)) if not per_row]
    s1 = scale_product(per_tensor) if per_tensor else jnp.ones((groups,), jnp.float32)
    ra, rc = (
        (s if per_row else jnp.ones((groups, q.length), jnp.float32))
        for s, per_row, q in ((sa, a_rows, a), (sc, c_rows, c))
    )
    byte = lambda s: lax.bitcast_convert_type(s, jnp.uint8)  # noqa: E731
    options = {"out_dtype": out_dtype, "c_first": a_rows or c_rows}
    return fused_segment_gemm(a.data_t, byte(a.scale_t), c.data_t, byte(c.scale_t), segments, s1, ra, rc, **options)


def _column_scales(q: GroupedCopies) -> Scaled:
    """The grouped copy's per-group scales ([G], or [G, L] row-scaled) without its values."""
    return Scaled(None, q.amax_t, q.spec.global_scale)


def _masked(v: jax.Array, ids: jax.Array, groups: int) -> jax.Array:
    """v [M, L] with the rows past the last group zero."""
    return jnp.where((ids < groups)[:, None], v, jnp.zeros((), v.dtype))


def _keys(key, groups: int):
    """(dy's rowwise key, the G group keys) from the backward pass's key; Nones without one."""
    if key is None:
        return None, None
    keys = jax.random.split(key, groups + 1)
    return keys[0], keys[1:]


def _fused_token_gemm(
    data,
    scale,
    tokens: Scaled,
    c_data,
    c_scale,
    experts: Scaled,
    sizes,
    out_dtype,
    *,
    n: int,
    length: int,
    transposed: bool,
) -> jax.Array:
    """``_token_gemm`` by the fused grouped GEMM (``Recipe(impl="fused")``): the tokens' packed rowwise copy
    (``data``, ``scale`` [M, L]) times their expert's packed copy (``c_data``, ``c_scale``: [G, n, L], or
    ``transposed`` [G, L, n]), decoded in the kernel's tiles; the scales of ``tokens`` and ``experts`` (their
    ``values`` unused) in ``_token_gemm``'s order: the product of the per-tensor ones, then a token's row scale."""
    expert, token = _decode(experts), _decode(tokens)
    if tokens.global_scale.per_row:
        s1, s2 = expert, token
    else:
        s1, s2 = scale_product([jnp.broadcast_to(token, expert.shape), expert]), jnp.ones(data.shape[:1], jnp.float32)
    byte = lambda s: lax.bitcast_convert_type(s, jnp.uint8)  # noqa: E731
    return fused_ragged_gemm(
        data,
        byte(scale),
        c_data,
        byte(c_scale),
        sizes,
        s1,
        s2,
        n=n,
        length=length,
        out_dtype=out_dtype,
        transposed=transposed,
    )


def _fprop(rows: tuple, qw: NVFP4Tensor, sizes, ids, config: DotConfig) -> jax.Array:
    """The forward GEMM of the tokens' rowwise copy (``rows``: its codes, E4M3 scales, and its amax as a Scaled
    without values) and each expert's W."""
    data, scale, tokens = rows
    if resolve_impl(config.recipe.impl) == "fused":
        experts = Scaled(None, qw.amax, qw.spec.global_scale)
        shapes = {"n": qw.shape[1], "length": qw.shape[2], "transposed": False}  # W^T [G, N, K]: rows N
        return _fused_token_gemm(data, scale, tokens, qw.data, qw.scale, experts, sizes, config.out_dtype, **shapes)
    return _token_gemm(_values(rows, qw.shape[2]), _expert_values(qw, columnwise=False), sizes, ids, config.out_dtype)


def _rows(q) -> tuple:
    """A grouped quantization's rowwise copy as ``_fprop`` takes it: codes, scales, and a Scaled without values."""
    return q.data, q.scale, Scaled(None, q.amax, q.spec.global_scale)


def _values(rows: tuple, length: int) -> Scaled:
    """The tokens' rowwise copy (codes, scales, a Scaled without values) decoded: exact bf16 values [M, L]."""
    data, scale, tokens = rows
    return dataclasses.replace(tokens, values=block_values(data[None], scale[None], length)[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array, key, config: DotConfig) -> jax.Array:
    """x [M, K], W [G, K, N], group_sizes [G] -> y [M, N]. Without a backward pass: x's rowwise copy alone."""
    del key
    groups, rows = w.shape[0], x.shape[0]
    ids = group_ids(group_sizes, rows)
    spec = config.recipe.spec("x", columnwise=False, tokens=rows)
    t = quantize_batch(KERNELS, _masked(x, ids, groups)[None], spec)
    qx = (t.data[0], t.scale[0], Scaled(None, t.amax[0], spec.global_scale))
    return _fprop(qx, _experts(w, config.recipe, columnwise=False), _cut_sizes(group_sizes, rows), ids, config)


def _ragged_fwd(x, w, group_sizes, key, config: DotConfig):
    rows = x.shape[0]
    ids, sizes = group_ids(group_sizes, rows), _cut_sizes(group_sizes, rows)
    # 16x16 blocks: the rowwise copy alone, which the backward pass reads as W^T's columnwise one.
    qw = saved_weight(_experts(w, config.recipe, columnwise=not config.recipe.weight_block_2d))
    qx = named(quantize_grouped(x, group_sizes, config.recipe.spec("x", columnwise=True, tokens=rows)), ACTIVATION)
    y = named(_fprop(_rows(qx), qw, sizes, ids, config), OUTPUT)
    return y, (qx.columnwise_only(), weight_residual(qw), group_sizes, key)


def _ragged_bwd(config: DotConfig, residuals, dy):
    qx, qw, group_sizes, key = residuals  # x's grouped copy (GroupedCopies), W's columnwise copies
    recipe, groups, rows = config.recipe, qw.shape[0], dy.shape[0]
    recipe.check_rng_key(key)
    row_key, group_keys = _keys(key, groups)
    ids, sizes = group_ids(group_sizes, rows), _cut_sizes(group_sizes, rows)
    spec = recipe.spec("dy", columnwise=True, tokens=rows)
    qdy = quantize_grouped(dy, group_sizes, spec, row_key=row_key, group_keys=group_keys)
    if resolve_impl(recipe.impl) == "fused":  # W^T [G, N, K]: its rowwise copy read transposed, or its columnwise
        transposed = qw.data_t is None
        c = (qw.data, qw.scale) if transposed else (qw.data_t, qw.scale_t)
        experts = Scaled(None, qw.amax if transposed else qw.amax_t, qw.spec.global_scale)
        data, scale, tokens = _rows(qdy)
        shapes = {"n": qw.shape[2], "length": qw.shape[1], "transposed": transposed}
        dx = _fused_token_gemm(data, scale, tokens, *c, experts, sizes, config.x_dtype, **shapes)
    else:
        dx = _token_gemm(qdy.rows(), _dgrad_values(qw), sizes, ids, config.x_dtype)
    segments = segment_sizes(group_sizes, rows)
    if resolve_impl(recipe.impl) == "fused":  # dW [G, K, N] in W's layout, in every case
        return dx, _fused_weight_gemm(qx, qdy, segments, config.w_dtype), None, None
    # dW [G, K, N], W's layout; with row scales dW^T, transposed, whose epilogue scales by dy's first.
    if qx.spec.global_scale.per_row or qdy.spec.global_scale.per_row:
        dw = jnp.swapaxes(_weight_gemm(qdy.columns(), qx.columns(), segments, config.w_dtype), 1, 2)
    else:
        dw = _weight_gemm(qx.columns(), qdy.columns(), segments, config.w_dtype)
    return dx, dw, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)

_jitted_ragged = jax.jit(_ragged, static_argnums=4)


def _explicit_sharding(result, lhs, rhs, group_sizes, *args, **kwargs) -> PartitionSpec:
    """The result's type on Explicit axes, which lax has no rule for (it asks for an out_sharding): the one
    ``lax.dot_general`` gives lhs [M, K] times one group's rhs [K, N], tokens as lhs's rows and N as rhs's; or
    ``out_sharding``'s, where it is given."""
    del result, group_sizes, args
    out_sharding = kwargs.get("out_sharding")
    if out_sharding is not None:
        return out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    rhs = jnp.asarray(rhs)
    mesh = jax.sharding.get_abstract_mesh()
    one = jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec_of(rhs)[1:])))
    dense = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())))
    return jax.eval_shape(dense, jnp.asarray(lhs), one).sharding.spec


@explicit_sharding(_explicit_sharding, applies=("out_sharding",))
def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision: lax.PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    group_offset: jax.Array | None = None,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    *,
    recipe: Recipe | None = None,
    rng_key: jax.Array | None = None,
) -> jax.Array:
    """``lax.ragged_dot`` with NVFP4 GEMMs in the forward and backward pass (mixture of experts).

    Args:
      lhs: [M, K] bfloat16, float16 or float32: the tokens, sorted by group (expert).
      rhs: [G, K, N] of the same dtypes: one weight per group.
      group_sizes: int [G]: the rows of each group, in order, each >= 0 and summing to at most M (rows
        past their sum give zeros). Concrete sizes that are negative or sum past M raise ValueError; traced
        ones (under ``jit``) cannot be checked: a negative size then counts as zero and a sum past M cuts
        the last groups at M.
      precision: ignored; the GEMMs are NVFP4 with float32 accumulation.
      preferred_element_type: the output dtype (bfloat16, float16 or float32).
      group_offset: not supported (as in ``lax.ragged_dot`` on CPU and GPU).
      out_sharding: a ``NamedSharding`` (or a ``PartitionSpec`` of the current mesh) for the result, applied
        as a sharding constraint; on Explicit axes the result's type, as for ``lax.ragged_dot``.
      recipe: the NVFP4 recipe options (``Recipe()`` by default), as in ``dot_general``.
      rng_key: the key of the gradients' stochastic rounding (needed for the backward pass with
        the default recipe; a fresh one each step).

    Returns [M, N] of ``lax.ragged_dot``'s dtype. The module docstring has the recipe, how the
    weight-gradient copies treat group boundaries inside a 16-token block, and the cost.
    Gradients flow to ``lhs`` and ``rhs`` (not ``group_sizes``); forward-mode autodiff is not defined.

    Under ``jax.set_mesh`` with Explicit axes, where ``lax.ragged_dot`` asks for an ``out_sharding``, the
    result's type is the sharding ``lax.dot_general`` gives lhs times one group's rhs [K, N] (the tokens as
    lhs's rows, N as rhs's last axis; an expert axis of rhs does not show in it), and each gradient has
    its operand's. The GEMMs run with those axes Auto, as ``dot_general``'s do.
    """
    del precision
    recipe = check_options("NVFP4 ragged_dot", recipe, rng_key, preferred_element_type)
    if group_offset is not None:
        raise NotImplementedError("NVFP4 ragged_dot does not support group_offset")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    check_operands("NVFP4 ragged_dot", lhs=lhs, rhs=rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != rhs.shape[:1]:
        raise ValueError(
            "NVFP4 ragged_dot takes lhs [M, K], rhs [G, K, N] and group_sizes [G], got shapes "
            f"{lhs.shape}, {rhs.shape} and {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers, got {group_sizes.dtype}")
    check_group_sizes(group_sizes, lhs.shape[0])
    # lax's own shape rule checks K and gives the result type.
    ragged = functools.partial(lax.ragged_dot, preferred_element_type=preferred_element_type)
    out = jax.eval_shape(ragged, lhs, rhs, group_sizes)
    check_result("NVFP4 ragged_dot", out)
    if out.size == 0 or lhs.size == 0 or rhs.size == 0:
        y = ragged(lhs, rhs, group_sizes)
    else:
        config = DotConfig(recipe, out.dtype, lhs.dtype, rhs.dtype)
        y = _jitted_ragged(lhs, rhs, group_sizes.astype(jnp.int32), rng_key, config)
    return constrain(y, out_sharding)
