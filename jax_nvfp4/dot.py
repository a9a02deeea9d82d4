"""``jax_nvfp4.dot_general``: a drop-in ``lax.dot_general`` whose GEMMs run in NVFP4.

For y = x W (lhs = activations x, rhs = weights W) the custom VJP follows the
NVFP4 training recipe on the canonical problem x [B, M, K], W^T [B, N, K]
(M may be several row axes, e.g. batch and sequence):

  fprop  y  = x  . W^T    x in 1x16 blocks along K, W in 16x16 blocks
  dgrad  dx = dy . W      dy in 1x16 blocks along N; W's columnwise copy, which
                          for 16x16 blocks holds the same codes and scales transposed
  wgrad  dW = dy^T . x    the columnwise 1x16 copies of dy and x (blocked along M),
                          both of the Random Hadamard Transform along M (Recipe.rht)

dy's codes are rounded stochastically (Recipe.stochastic_rounding). Each
operand is quantized once, with one global amax per tensor, or per token for
x and dy with Recipe.row_scaled_activations / row_scaled_gradients (their
columnwise copies then have one per feature), and with 4over6 block scaling
where Recipe.four_over_six names it. The residuals kept for the backward pass
are the quantized columnwise copies of x and W.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4._frontend import check_key, columnwise_amax, row_axes, seed_words
from jax_nvfp4._options import check_out_dtype
from jax_nvfp4.formats import BLOCK, INPUT_DTYPES
from jax_nvfp4.gemm import Operand, emulated_gemm
from jax_nvfp4.primitives import amax_p, quantize_p
from jax_nvfp4.recipe import Recipe


class _Config(NamedTuple):
    recipe: Recipe
    out_dtype: np.dtype
    x_dtype: np.dtype
    w_dtype: np.dtype


class OperandFormat(NamedTuple):
    """How the recipe quantizes one operand, besides its transform and rounding."""

    block_2d: bool = False
    row_scaled: bool = False
    four_over_six: str | None = None
    four_over_six_fast_math: bool = False
    e4m3_max: int = 448


PLAIN_FORMAT = OperandFormat()


def operand_format(recipe: Recipe, operand: str) -> OperandFormat:
    """The format of operand "x", "w" or "dy" under ``recipe``."""
    mode = recipe.four_over_six_for(operand)
    row_scaled = {"x": recipe.row_scaled_activations, "dy": recipe.row_scaled_gradients}.get(operand, False)
    return OperandFormat(
        block_2d=operand == "w" and recipe.weight_block_2d,
        row_scaled=row_scaled,
        four_over_six=mode,
        four_over_six_fast_math=mode is not None and recipe.four_over_six_fast_math,
        e4m3_max=recipe.four_over_six_e4m3_max if mode is not None else 448,
    )


def quantize_operand(
    x: jax.Array,
    *,
    columnwise: bool,
    fmt: OperandFormat = PLAIN_FORMAT,
    mesh_axes: tuple[str, ...] | None = None,
    rht: bool = False,
    rht_amax_factor: float | None = None,
    seed: jax.Array | None = None,
) -> tuple[Operand, Operand | None]:
    """Quantize [B, *R, L] in format ``fmt``, its amax over the whole tensor or per row (on a mesh: reduced over
    ``mesh_axes``, None: all).

    Returns the rowwise operand (blocked along L) and, if ``columnwise``, the
    columnwise one ([B, L, *R], blocked along the last row axis), of the Random
    Hadamard Transform of the rows with ``rht`` (its amax from the fused pass,
    or the amax times ``rht_amax_factor``). ``seed`` (uint32 [2]): round
    stochastically.
    """
    fused = rht and rht_amax_factor is None
    amaxes = amax_p.bind(x, mesh_axes=mesh_axes, rht=fused, row_scaled=fmt.row_scaled)
    if not fmt.row_scaled:  # one amax for the whole operand, each of its B entries quantized with it
        amaxes = [jnp.broadcast_to(_max_entry(a), x.shape[:1]) for a in amaxes]
    amax, amax_t = amaxes[0], columnwise_amax(amaxes, rht, rht_amax_factor)
    outs = quantize_p.bind(
        x,
        amax,
        amax_t,
        jnp.zeros(2, jnp.uint32) if seed is None else seed,
        rowwise=True,
        columnwise=columnwise,
        block_2d=fmt.block_2d,
        rht=rht,
        stochastic=seed is not None,
        row_scaled=fmt.row_scaled,
        four_over_six=fmt.four_over_six,
        four_over_six_fast_math=fmt.four_over_six_fast_math,
        e4m3_max=fmt.e4m3_max,
    )

    def operand(data, scale, amax):
        return Operand(data, scale, amax, fmt.row_scaled, fmt.e4m3_max)

    return operand(outs[0], outs[1], amax), operand(outs[2], outs[3], amax_t) if columnwise else None


def _max_entry(amax: jax.Array) -> jax.Array:
    """The max of per-entry amaxes, as int32 bits: exact for non-negative floats, NaN included."""
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    return lax.bitcast_convert_type(jnp.max(bits), jnp.float32)


def _rht_rows(x: jax.Array, recipe: Recipe) -> bool:
    """Whether the wgrad operands of x [B, *R, K] (and dy) are transformed: the tokens are whole chunks of 16."""
    return recipe.rht and math.prod(x.shape[1:-1]) % BLOCK == 0


def _seed(key: jax.Array | None, recipe: Recipe) -> jax.Array | None:
    if not recipe.stochastic_rounding:
        return None
    if key is None:
        raise ValueError(
            "Recipe(stochastic_rounding=True) rounds the gradients with random bits: pass rng_key= to "
            "jax_nvfp4.dot_general (a fresh key each step), give the Flax layers an 'nvfp4' RNG stream "
            "(linen: apply(..., rngs={'nvfp4': key}); NNX: dot_general=jax_nvfp4.flax.nnx.NVFP4DotGeneral(rngs=rngs) "
            "instead of jax_nvfp4.dot_general), or use Recipe(stochastic_rounding=False)"
        )
    return seed_words(key, "rng_key")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x: jax.Array, w: jax.Array, key: jax.Array | None, config: _Config) -> jax.Array:
    """x [B, *M, K], w [B, N, K] -> y [B, *M, N] (M: one or more row axes)."""
    del key
    recipe = config.recipe
    qx, _ = quantize_operand(x, columnwise=False, fmt=operand_format(recipe, "x"), mesh_axes=recipe.amax_mesh_axes)
    qw, _ = quantize_operand(w, columnwise=False, fmt=operand_format(recipe, "w"), mesh_axes=recipe.amax_mesh_axes)
    return emulated_gemm(qx, qw, x.shape[-1], config.out_dtype)


def _matmul_fwd(x, w, key, config: _Config):
    recipe = config.recipe
    rht = _rht_rows(x, recipe)
    factor = recipe.rht_amax_factor_x if rht and recipe.rht_amax_estimate else None
    qx, qx_t = quantize_operand(
        x,
        columnwise=True,
        fmt=operand_format(recipe, "x"),
        mesh_axes=recipe.amax_mesh_axes,
        rht=rht,
        rht_amax_factor=factor,
    )
    qw, qw_t = quantize_operand(w, columnwise=True, fmt=operand_format(recipe, "w"), mesh_axes=recipe.amax_mesh_axes)
    return emulated_gemm(qx, qw, x.shape[-1], config.out_dtype), (qx_t, qw_t, key)


def _matmul_bwd(config: _Config, residuals, dy):
    qx_t, qw_t, key = residuals  # x^T [B, K, *M] and W [B, K, N], both blocked along their last axis
    recipe = config.recipe
    rows, n = dy.shape[1:-1], dy.shape[-1]
    rht = _rht_rows(dy, recipe)
    factor = recipe.rht_amax_factor_dy if rht and recipe.rht_amax_estimate else None
    qdy, qdy_t = quantize_operand(
        dy,
        columnwise=True,
        fmt=operand_format(recipe, "dy"),
        mesh_axes=recipe.amax_mesh_axes,
        rht=rht,
        rht_amax_factor=factor,
        seed=_seed(key, recipe),
    )
    dx = emulated_gemm(qdy, qw_t, n, config.x_dtype)  # [B, *M, N] . [B, K, N] -> [B, *M, K]
    # [B, N, *M] . [B, K, *M] -> [B, N, K], contracting all row axes (tokens); with rht both operands carry
    # the same orthogonal transform along them, which cancels in the product.
    dw = emulated_gemm(qdy_t, qx_t, rows[-1], config.w_dtype, contract_ndim=len(rows))
    return dx, dw, None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# Jitted so that eager calls run as one compiled program, not op by op.
_jitted_matmul = jax.jit(_matmul, static_argnums=3)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    out_sharding=None,
    recipe: Recipe | None = None,
    rng_key: jax.Array | None = None,
) -> jax.Array:
    """``lax.dot_general`` with NVFP4 GEMMs in the forward and backward pass.

    Same signature as ``lax.dot_general``, so it can be passed as
    ``dot_general=`` to ``nn.Dense``, ``nn.DenseGeneral`` or ``nnx.Linear``.
    ``lhs`` is treated as the activations and ``rhs`` as the weights (16x16
    blocks with the default recipe). Any contracting and batch dimensions are
    accepted; the result has ``lax.dot_general``'s shape and dtype.

    Args:
      lhs, rhs: bfloat16, float16 or float32 arrays.
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
      precision: ignored; the GEMM is NVFP4 with float32 accumulation.
      preferred_element_type: the output dtype (bfloat16, float16 or float32).
      out_sharding: a ``NamedSharding`` (or a ``PartitionSpec`` of the
        current mesh) for the result, applied as a sharding constraint: the
        GEMM computes that layout and moves its quantized operands to fit.
        Meshes with Auto axes only.
      recipe: the NVFP4 recipe options; ``Recipe()`` by default.
      rng_key: a JAX PRNG key for the stochastic rounding of the gradients
        (``Recipe.stochastic_rounding``, on by default): needed when the
        backward pass runs; use a fresh key each step.

    Gradients have the dtypes of ``lhs`` and ``rhs``. Forward-mode autodiff
    (jvp) is not defined. Empty operands fall back to ``lax.dot_general``.
    """
    del precision
    recipe = Recipe() if recipe is None else recipe
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jax_nvfp4.Recipe, got {type(recipe).__name__}")
    if rng_key is not None:
        check_key(rng_key, "rng_key")
    if preferred_element_type is not None:
        check_out_dtype(preferred_element_type, "preferred_element_type", "NVFP4 dot_general")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if a.dtype not in INPUT_DTYPES:
            raise TypeError(f"NVFP4 dot_general takes bfloat16, float16 or float32 operands, {name} is {a.dtype}")
    (lc, rc), (lb, rb) = ((tuple(map(int, d)) for d in pair) for pair in dimension_numbers)
    dims = ((lc, rc), (lb, rb))
    # lax's own shape rule validates the dimension numbers and gives the result type.
    out = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=preferred_element_type),
        lhs,
        rhs,
    )
    if out.dtype not in INPUT_DTYPES:
        raise TypeError(f"NVFP4 dot_general produces bfloat16, float16 or float32, not {out.dtype}")
    if out.size == 0 or lhs.size == 0 or rhs.size == 0:
        return lax.dot_general(lhs, rhs, dims, preferred_element_type=out.dtype)

    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch = math.prod(lhs.shape[d] for d in lb)
    k = math.prod(lhs.shape[d] for d in lc)
    # Row axes (e.g. batch and sequence) stay apart where x's columnwise blocks allow it.
    rows = row_axes(tuple(lhs.shape[d] for d in lf), blocked_rows=True)
    x = lhs.transpose(*lb, *lf, *lc).reshape(batch, *rows, k)
    w = rhs.transpose(*rb, *rf, *rc).reshape(batch, -1, k)
    y = _jitted_matmul(x, w, rng_key, _Config(recipe, out.dtype, lhs.dtype, rhs.dtype)).reshape(out.shape)
    return y if out_sharding is None else lax.with_sharding_constraint(y, out_sharding)
