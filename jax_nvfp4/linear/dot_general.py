"""``jax_nvfp4.dot_general``: a drop-in ``lax.dot_general`` whose GEMMs run in NVFP4.

For y = x W (lhs = activations x, rhs = weights W) the custom VJP follows the
NVFP4 training recipe on the canonical problem x [B, M, K], W [B, K, N] (M may
be several row axes, e.g. batch and sequence; W as a kernel [*in, *out] is
stored, so that neither it nor its gradient is transposed in bf16):

  fprop  y  = x  . W^T    x in 1x16 blocks along K, W in 16x16 blocks: W^T's rowwise
                          copy [B, N, K], which is W's columnwise copy (the same
                          bytes: W is quantized as it is stored)
  dgrad  dx = dy . W      dy in 1x16 blocks along N; W^T's columnwise copy, which
                          for 16x16 blocks holds the same codes and scales transposed:
                          then only the rowwise copy is made, and the dgrad GEMM reads
                          it transposed (no copy of its bytes)
  wgrad  dW = x^T . dy    the columnwise 1x16 copies of x and dy (blocked along M),
                          both of the Random Hadamard Transform along M (the recipe's
                          default): [B, K, N], W's layout (dW^T = dy^T . x, transposed,
                          where a copy is row-scaled, whose epilogue order it keeps)

dy's codes are rounded stochastically (the recipe's default). Each
operand is quantized once, with one global amax per tensor, or per token for
x and dy with Recipe.row_scaled_activations / row_scaled_gradients (their
columnwise copies then have one per feature), and with 4over6 block scaling
where Recipe.four_over_six names it. The residuals kept for the backward pass
are the quantized columnwise copy of x and, for W, its columnwise copy (1x16
blocks) or, for 16x16 blocks, the rowwise copy the forward GEMM read, in the
layout that GEMM gathered it to on a mesh: one copy of W is quantized, kept and
all-gathered a step, where two were.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_nvfp4.core.checks import check_key, check_out_dtype, mesh_axis_names, unknown_mesh_axes
from jax_nvfp4.core.formats import INPUT_DTYPES
from jax_nvfp4.core.pipeline import dequantize_fn, quantize_batch, row_axes
from jax_nvfp4.core.tensor import CachedWeight, NVFP4Tensor, QuantizedWeight
from jax_nvfp4.linear.gemm import batched_gemm
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.linear.remat import ACTIVATION, OUTPUT, named, saved_weight
from jax_nvfp4.mxfp8.matmul import MXFP8
from jax_nvfp4.mxfp8.matmul import matmul as mxfp8_matmul
from jax_nvfp4.ops import KERNELS
from jax_nvfp4.sharding.explicit import constrain, explicit_sharding


class DotConfig(NamedTuple):
    recipe: Recipe
    out_dtype: np.dtype
    x_dtype: np.dtype
    w_dtype: np.dtype


def _quantize(
    x: jax.Array, recipe: Recipe, operand: str, columnwise: bool, key=None, *, rowwise: bool = True
) -> NVFP4Tensor:
    """Operand "x", "w" or "dy" [B, *R, L] quantized as ``recipe`` specifies, by the public pipeline."""
    spec = recipe.spec(operand, columnwise=columnwise, tokens=math.prod(x.shape[1:-1]))
    if not rowwise:
        spec = dataclasses.replace(spec, rowwise=False)
    return quantize_batch(KERNELS, x, spec, rng_key=key)


def transposed_weight(q: NVFP4Tensor) -> NVFP4Tensor:
    """A quantized W [B, K, N] as W^T [B, N, K], the operand the GEMMs read: its two copies swapped, each the
    other's of the transpose, byte for byte (a weight's blocks are not transformed or row-scaled; in 16x16
    blocks both copies hold the same blocks: core/transpose.py)."""
    b, k, n = q.shape
    rows, cols = q.data_t is not None, q.data is not None
    spec = dataclasses.replace(q.spec, rowwise=rows, columnwise=cols)
    amax, amax_t = (q.amax_t if rows else q.amax), (q.amax if cols else None)
    return NVFP4Tensor(q.data_t, q.scale_t, amax, q.data, q.scale, amax_t, (b, n, k), q.dtype, spec, batched=True)


def weight_copies(w: jax.Array, recipe: Recipe, *, rowwise: bool = True, columnwise: bool) -> NVFP4Tensor:
    """W [B, K, N], as dot_general's rhs comes in, quantized as W^T [B, N, K]: the copies of W^T asked for (its
    rowwise one, blocked along K, for the forward GEMM; its columnwise one, along N, for dgrad), made as W's
    other copies (``transposed_weight``), so W is quantized as it is stored and no transposed bf16 copy of it is
    written."""
    return transposed_weight(_quantize(w, recipe, "w", columnwise=rowwise, rowwise=columnwise))


def columnwise_only(t: NVFP4Tensor) -> NVFP4Tensor:
    """The residual for the backward pass: the columnwise copy alone."""
    return NVFP4Tensor(None, None, t.amax, t.data_t, t.scale_t, t.amax_t, t.shape, t.dtype, t.spec, t.batched)


def weight_residual(qw: NVFP4Tensor) -> NVFP4Tensor:
    """A quantized W's residual for the backward pass: its columnwise copy alone, or, quantized rowwise alone
    (16x16 blocks: ``Recipe.spec("w", columnwise=not weight_block_2d)``), that one copy."""
    return qw if qw.data_t is None else columnwise_only(qw)


def dgrad(qdy: NVFP4Tensor, qw: NVFP4Tensor, out_dtype: DTypeLike, impl: str) -> jax.Array:
    """dx = dy . W [B, *M, K] from dy's rowwise copy [B, *M, N] and W^T's residual (``weight_residual``): its
    columnwise copy as kept, or, in 16x16 blocks, its rowwise copy [B, N, K] read transposed by the GEMM (the
    same blocks: no transposed copy of its bytes is made)."""
    return batched_gemm(qdy, qw, out_dtype, c_columnwise=True, c_transposed=qw.data_t is None, impl=impl)


def _fprop(x: jax.Array, qw: NVFP4Tensor, recipe: Recipe, out_dtype: np.dtype) -> jax.Array:
    """The forward GEMM without residuals: x [B, *M, K] quantized, against quantized W^T [B, N, K]."""
    return batched_gemm(_quantize(x, recipe, "x", columnwise=False), qw, out_dtype, impl=recipe.impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x: jax.Array, w: jax.Array, key: jax.Array | None, config: DotConfig) -> jax.Array:
    """x [B, *M, K], w [B, K, N] -> y [B, *M, N] (M: one or more row axes)."""
    del key
    return _fprop(x, weight_copies(w, config.recipe, columnwise=False), config.recipe, config.out_dtype)


def _forward(x, w, qw: NVFP4Tensor | None, key, config: DotConfig):
    """y and the backward pass's residuals; ``qw``: W's rowwise copy where it was cached, else None."""
    recipe = config.recipe
    # What the forward pass makes is named for jax.checkpoint's policies (linear/remat.py); W's copy is saved
    # under every policy, so a weight is quantized once a step under rematerialization.
    qx = named(_quantize(x, recipe, "x", columnwise=True), ACTIVATION)
    if recipe.weight_block_2d:
        # One copy: the dgrad GEMM reads the one the forward GEMM read (and gathered), transposed.
        qw = saved_weight(weight_copies(w, recipe, columnwise=False)) if qw is None else qw
        y, kept = batched_gemm(qx, qw, config.out_dtype, impl=recipe.impl, keep_c=True)
        kept = named(kept, OUTPUT)  # the copy of W the GEMM read: saved with its output, or made again with it
    elif qw is None:
        qw = saved_weight(weight_copies(w, recipe, columnwise=True))
        y, kept = batched_gemm(qx, qw, config.out_dtype, impl=recipe.impl), columnwise_only(qw)
    else:  # 1x16 blocks: the columnwise copy holds other blocks, quantized here
        y = batched_gemm(qx, qw, config.out_dtype, impl=recipe.impl)
        kept = saved_weight(weight_copies(w, recipe, rowwise=False, columnwise=True))
    return named(y, OUTPUT), (columnwise_only(qx), kept, key)


def _matmul_fwd(x, w, key, config: DotConfig):
    return _forward(x, w, None, key, config)


def _matmul_bwd(config: DotConfig, residuals, dy):
    qx, qw, key = residuals  # x^T [B, K, *M] columnwise; W's columnwise copy [B, K, N], or its rowwise [B, N, K]
    config.recipe.check_rng_key(key)
    qdy = _quantize(dy, config.recipe, "dy", columnwise=True, key=key)
    impl = config.recipe.impl
    dx = dgrad(qdy, qw, config.x_dtype, impl)  # [B, *M, N] . W [B, K, N] -> [B, *M, K]
    # Contracting all row axes (tokens); transformed, both operands carry the same orthogonal transform along
    # them, which cancels in the product. [B, K, *M] . [B, N, *M] -> [B, K, N], w's layout: no pass over dW. With
    # row scales dW^T = [B, N, *M] . [B, K, *M] transposed, whose epilogue scales by dy's first (linear/gemm.py),
    # as it always has.
    if qx.spec.global_scale.per_row or qdy.spec.global_scale.per_row:
        dw_t = batched_gemm(qdy, qx, config.w_dtype, a_columnwise=True, c_columnwise=True, impl=impl)
        return dx, jnp.swapaxes(dw_t, 1, 2), None
    return dx, batched_gemm(qx, qdy, config.w_dtype, a_columnwise=True, c_columnwise=True, impl=impl), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cached_matmul(x: jax.Array, w: jax.Array, qw: NVFP4Tensor, key: jax.Array | None, config: DotConfig) -> jax.Array:
    """``_matmul`` with W's rowwise copy given (``CachedWeight``); differentiated as a function of x and w."""
    del w, key
    return _fprop(x, qw, config.recipe, config.out_dtype)


def _cached_matmul_fwd(x, w, qw, key, config: DotConfig):
    return _forward(x, w, qw, key, config)


def _cached_matmul_bwd(config: DotConfig, residuals, dy):
    dx, dw, _ = _matmul_bwd(config, residuals, dy)
    return dx, dw, None, None  # no cotangent for the cached codes: gradients flow to the kernel


_cached_matmul.defvjp(_cached_matmul_fwd, _cached_matmul_bwd)


# Jitted so that eager calls run as one compiled program, not op by op.
_jitted_matmul = jax.jit(_matmul, static_argnums=3)
_jitted_cached_matmul = jax.jit(_cached_matmul, static_argnums=4)
_jitted_mxfp8_matmul = jax.jit(mxfp8_matmul, static_argnums=(2, 3))


def quantize_weight(kernel: jax.Array, recipe: Recipe | None = None, *, contract_ndim: int = 1) -> QuantizedWeight:
    """A kernel ``[*in, *out]`` (its first ``contract_ndim`` axes contracted) quantized once for inference.

    The rowwise copy of W^T that ``dot_general``'s forward GEMM would make from ``kernel`` with
    ``recipe`` (16x16 blocks by default), bit for bit, so that ``dot_general(x, quantize_weight(w),
    ...)`` gives the training forward's output without quantizing the weight again.
    """
    recipe = Recipe() if recipe is None else recipe
    kernel = jnp.asarray(kernel)
    if kernel.dtype not in INPUT_DTYPES:
        raise TypeError(f"quantize_weight takes a bfloat16, float16 or float32 kernel, got {kernel.dtype}")
    if not 1 <= contract_ndim < kernel.ndim:
        raise ValueError(f"contract_ndim must be in [1, {kernel.ndim - 1}] for a kernel of shape {kernel.shape}")
    w = kernel.reshape(1, math.prod(kernel.shape[:contract_ndim]), -1)  # W [1, K, N]
    return QuantizedWeight(_jitted_weight(w, recipe), tuple(kernel.shape), contract_ndim)


@functools.partial(jax.jit, static_argnums=1)
def _jitted_weight(w: jax.Array, recipe: Recipe) -> NVFP4Tensor:
    return weight_copies(w, recipe, columnwise=False)


_dequantize = dequantize_fn(KERNELS)


def dequantize_weight(weight: QuantizedWeight, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """The kernel a ``QuantizedWeight`` holds, decoded: its shape ``[*in, *out]``, in ``dtype``.

    These are the values its forward GEMM multiplies, e.g. to run the same weights through a plain dot
    or to compare them with the kernel they were quantized from.
    """
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(
            f"dequantize_weight takes a QuantizedWeight (from quantize_weight), got {type(weight).__name__}"
        )
    t = weight.tensor
    rows = dataclasses.replace(t, data=t.data[0], scale=t.scale[0], amax=t.amax[0], shape=t.shape[1:], batched=False)
    return _dequantize(rows, dtype).T.reshape(weight.shape)  # W^T [N, K] -> the kernel


_jitted_fprop = jax.jit(_fprop, static_argnums=(2, 3))


def _int_dims(dimension_numbers) -> lax.DotDimensionNumbers:
    """``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` as tuples of ints."""
    return tuple(tuple(tuple(map(int, d)) for d in pair) for pair in dimension_numbers)


def _weight_problem(lhs, rhs: QuantizedWeight | CachedWeight, dims, preferred_element_type):
    """x [1, *M, K] and the result's type of ``dot_general`` with a stored weight as rhs (its first
    ``contract_ndim`` axes contracted, no batch axes)."""
    contract_ndim = (rhs if isinstance(rhs, QuantizedWeight) else rhs.quantized).contract_ndim
    dims = _int_dims(dims)
    (lc, rc), (lb, rb) = dims
    if rb or lb or rc != tuple(range(contract_ndim)):
        raise ValueError(
            f"a {type(rhs).__name__} of shape {rhs.shape} contracts its first {contract_ndim} axes and has no "
            f"batch axes; got dimension_numbers {dims}"
        )
    stand_in = jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)
    dot = functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=preferred_element_type)
    out = jax.eval_shape(dot, lhs, stand_in)
    if lhs.dtype not in INPUT_DTYPES or out.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"NVFP4 dot_general takes and produces bfloat16, float16 or float32, not lhs {lhs.dtype} -> {out.dtype}"
        )
    lf = [d for d in range(lhs.ndim) if d not in lc]
    # Row axes (e.g. batch and sequence) stay apart where x's columnwise blocks allow it, as in training.
    rows = row_axes(tuple(lhs.shape[d] for d in lf), blocked_rows=True)
    return lhs.transpose(*lf, *lc).reshape(1, *rows, math.prod(lhs.shape[d] for d in lc)), out


def _apply_quantized(lhs, rhs: QuantizedWeight, dims, preferred_element_type, recipe: Recipe) -> jax.Array:
    """``dot_general`` with a ``QuantizedWeight`` as rhs: x quantized, the stored W as it is."""
    x, out = _weight_problem(lhs, rhs, dims, preferred_element_type)
    return _jitted_fprop(x, rhs.tensor, recipe, out.dtype).reshape(out.shape)


def _apply_cached(lhs, rhs: CachedWeight, dims, preferred_element_type, recipe: Recipe, rng_key) -> jax.Array:
    """``dot_general`` with a ``CachedWeight`` as rhs: differentiable in its kernel, its GEMMs read its cached copy."""
    q = rhs.quantized
    if not isinstance(q, QuantizedWeight) or q.shape != rhs.shape or q.dtype != rhs.dtype:
        raise ValueError(
            f"a CachedWeight's quantized copy must be quantize_weight of its kernel ({rhs.shape}, {rhs.dtype}); "
            f"got {getattr(q, 'shape', None)}, {getattr(q, 'dtype', None)}"
        )
    if q.tensor.spec != recipe.spec("w", columnwise=False, tokens=1):
        raise ValueError(
            "this CachedWeight was quantized with another recipe than the one dot_general runs: make it with "
            "jax_nvfp4.cache_weight(kernel, recipe) for the same recipe"
        )
    check_operands("NVFP4 dot_general", rhs=rhs.kernel)
    x, out = _weight_problem(lhs, rhs, dims, preferred_element_type)
    w = rhs.kernel.reshape(1, math.prod(rhs.shape[: q.contract_ndim]), -1)  # W [1, K, N]
    config = DotConfig(recipe, out.dtype, lhs.dtype, rhs.dtype)
    return _jitted_cached_matmul(x, w, q.tensor, rng_key, config).reshape(out.shape)


def cache_weight(kernel: jax.Array, recipe: Recipe | None = None, *, contract_ndim: int = 1) -> CachedWeight:
    """A kernel ``[*in, *out]`` with its forward copy quantized now, for ``dot_general`` to reuse in training.

    Gradient accumulation quantizes a weight once per optimizer step this way: make the cache once, outside
    the loop over micro-batches, and pass ``CachedWeight(kernel, cache.quantized)`` (the kernel being
    differentiated, the cached copy closed over) to ``dot_general`` in each. Its GEMMs then read the cached
    copy, which is what quantizing ``kernel`` there would give, bit for bit, and its gradient flows to
    ``kernel``. With 1x16 weight blocks (``Recipe(weight_block_2d=False)``) only the forward copy is cached:
    the backward pass still quantizes the kernel along its other axis.
    """
    kernel = jnp.asarray(kernel)
    return CachedWeight(kernel, quantize_weight(lax.stop_gradient(kernel), recipe, contract_ndim=contract_ndim))


def check_options(
    owner: str, recipe: Recipe | MXFP8 | None, rng_key, preferred_element_type, *, mxfp8: bool = False
) -> Recipe | MXFP8:
    """The options every NVFP4 GEMM entry point (``owner``) takes, checked: its recipe (``Recipe()`` by default;
    an ``MXFP8`` too where ``mxfp8``)."""
    recipe = Recipe() if recipe is None else recipe
    if not isinstance(recipe, (Recipe, MXFP8) if mxfp8 else Recipe):
        expected = "a jax_nvfp4.Recipe or jax_nvfp4.MXFP8" if mxfp8 else "a jax_nvfp4.Recipe"
        raise TypeError(f"{owner}'s recipe must be {expected}, got {type(recipe).__name__}")
    if rng_key is not None:
        check_key(rng_key, "rng_key")
    if preferred_element_type is not None:
        check_out_dtype(preferred_element_type, "preferred_element_type", owner)
    return recipe


def check_operands(owner: str, **operands: jax.Array) -> None:
    """TypeError unless each operand is bfloat16, float16 or float32, naming it."""
    for name, a in operands.items():
        if a.dtype not in INPUT_DTYPES:
            raise TypeError(f"{owner} takes bfloat16, float16 or float32 operands, {name} is {a.dtype}")


def check_result(owner: str, out: jax.ShapeDtypeStruct) -> None:
    """TypeError unless the result type (lax's rule) is bfloat16, float16 or float32."""
    if out.dtype not in INPUT_DTYPES:
        raise TypeError(f"{owner} produces bfloat16, float16 or float32, not {out.dtype}")


def _lax_sharding(result, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """The sharding ``lax.dot_general`` gives its result on Explicit axes: its own rule, or ``out_sharding``."""
    del result, precision
    # A QuantizedWeight's kernel has no layout of its own (its arrays are the packed W^T).
    if isinstance(rhs, CachedWeight):
        rhs = rhs.kernel
    rhs = jax.ShapeDtypeStruct(rhs.shape, rhs.dtype) if isinstance(rhs, QuantizedWeight) else jnp.asarray(rhs)
    dot = functools.partial(
        lax.dot_general,
        dimension_numbers=_int_dims(dimension_numbers),
        preferred_element_type=preferred_element_type,
        out_sharding=kwargs.get("out_sharding"),
    )
    return jax.eval_shape(dot, jnp.asarray(lhs), rhs).sharding.spec


@explicit_sharding(_lax_sharding, applies=("out_sharding",))
def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    *,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    recipe: Recipe | MXFP8 | None = None,
    rng_key: jax.Array | None = None,
) -> jax.Array:
    """``lax.dot_general`` with NVFP4 GEMMs in the forward and backward pass (or MXFP8 ones: ``recipe=MXFP8()``).

    Same signature as ``lax.dot_general``, so it can be passed as
    ``dot_general=`` to ``nn.Dense``, ``nn.DenseGeneral`` or ``nnx.Linear``.
    ``lhs`` is treated as the activations and ``rhs`` as the weights (16x16
    blocks with the default recipe). Any contracting and batch dimensions are
    accepted; the result has ``lax.dot_general``'s shape and dtype.

    Args:
      lhs, rhs: bfloat16, float16 or float32 arrays; ``rhs`` may be a
        ``QuantizedWeight`` (``quantize_weight``): inference, the forward GEMM
        with the stored weight, which is not quantized again (no gradients);
        or a ``CachedWeight`` (``cache_weight``): training with the weight
        quantized once per step, differentiated as its kernel.
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
      precision: ignored; the GEMM is NVFP4 with float32 accumulation.
      preferred_element_type: the output dtype (bfloat16, float16 or float32).
      out_sharding: a ``NamedSharding`` (or a ``PartitionSpec`` of the
        current mesh) for the result, applied as a sharding constraint: the
        GEMM computes that layout and moves its quantized operands to fit.
        On Explicit axes it is the result's type, as for ``lax.dot_general``.
      recipe: the NVFP4 recipe options; ``Recipe()`` by default. An
        ``MXFP8()`` runs the three GEMMs in MXFP8 instead (E4M3 values, an
        E8M0 scale per 32 values along each GEMM's contracted axis, round to
        nearest; ``jax_nvfp4.mxfp8``).
      rng_key: a JAX PRNG key for the stochastic rounding of the gradients
        (on by default, ``Recipe.needs_rng_key``): needed when the
        backward pass runs; use a fresh key each step. Unused by MXFP8.

    Gradients have the dtypes of ``lhs`` and ``rhs``. Forward-mode autodiff
    (jvp) is not defined. Empty operands fall back to ``lax.dot_general``.

    Under ``jax.set_mesh`` with Explicit axes the result's type has the
    sharding ``lax.dot_general`` would give it (its rule, or ``out_sharding``;
    where lax asks for ``out_sharding`` so does this), and each gradient its
    operand's. The GEMMs cannot take part in sharding in types themselves
    (custom partitioning), so they run with those axes Auto, partitioned by
    the operands' layouts, and the result is resharded to that type.
    """
    del precision
    recipe = check_options("NVFP4 dot_general", recipe, rng_key, preferred_element_type, mxfp8=True)
    if isinstance(rhs, QuantizedWeight):
        if isinstance(recipe, MXFP8):
            raise TypeError("a QuantizedWeight holds NVFP4 codes: it runs with an NVFP4 Recipe, not MXFP8")
        y = _apply_quantized(jnp.asarray(lhs), rhs, dimension_numbers, preferred_element_type, recipe)
        return constrain(y, out_sharding)
    if isinstance(rhs, CachedWeight):
        if isinstance(recipe, MXFP8):
            raise TypeError("a CachedWeight holds NVFP4 codes: it runs with an NVFP4 Recipe, not MXFP8")
        y = _apply_cached(jnp.asarray(lhs), rhs, dimension_numbers, preferred_element_type, recipe, rng_key)
        return constrain(y, out_sharding)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    check_operands("NVFP4 dot_general", lhs=lhs, rhs=rhs)
    if isinstance(recipe, Recipe):  # here, where lhs may still be concrete (its mesh known)
        unknown_mesh_axes("Recipe.amax_mesh_axes", recipe.amax_mesh_axes, mesh_axis_names(lhs))
    dims = _int_dims(dimension_numbers)
    (lc, rc), (lb, rb) = dims
    # lax's own shape rule validates the dimension numbers and gives the result type.
    out = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=preferred_element_type),
        lhs,
        rhs,
    )
    check_result("NVFP4 dot_general", out)
    if out.size == 0 or lhs.size == 0 or rhs.size == 0:
        return lax.dot_general(lhs, rhs, dims, preferred_element_type=out.dtype)

    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch = math.prod(lhs.shape[d] for d in lb)
    k = math.prod(lhs.shape[d] for d in lc)
    # Row axes (e.g. batch and sequence) stay apart where x's columnwise blocks allow it.
    rows = row_axes(tuple(lhs.shape[d] for d in lf), blocked_rows=True)
    x = lhs.transpose(*lb, *lf, *lc).reshape(batch, *rows, k)
    if isinstance(recipe, MXFP8):
        w = rhs.transpose(*rb, *rf, *rc).reshape(batch, -1, k)  # W^T [B, N, K]
        y = _jitted_mxfp8_matmul(x, w, recipe, (out.dtype, lhs.dtype, rhs.dtype)).reshape(out.shape)
    else:
        w = rhs.transpose(*rb, *rc, *rf).reshape(batch, k, -1)  # W [B, K, N]: a kernel [*in, *out] as it is
        y = _jitted_matmul(x, w, rng_key, DotConfig(recipe, out.dtype, lhs.dtype, rhs.dtype)).reshape(out.shape)
    return constrain(y, out_sharding)
