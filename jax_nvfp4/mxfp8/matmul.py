"""MXFP8 as a layer's choice beside an NVFP4 ``Recipe``: its GEMMs, forward and backward, as TransformerEngine's
MXFP8 recipe runs them.

On the canonical problem x [B, *M, K], W^T [B, N, K] (``jax_nvfp4.dot_general`` reshapes any dimension numbers to
it), every operand is quantized along the axis its GEMM contracts, rounding to nearest, E4M3 throughout:

  fprop  y  = x  . W^T    x and W in blocks of 32 along K
  dgrad  dx = dy . W      dy and W in blocks of 32 along N
  wgrad  dW = dy^T . x    dy and x in blocks of 32 along the tokens M

The backward pass keeps x's and W's quantized copies along M and N (a byte a value), not the inputs. Every copy
keeps its tensor's layout, blocked along the contracted axis (no transpose). Each GEMM multiplies the dequantized
values (exact in bfloat16, ``format``) with float32 accumulation, or hands the E4M3 values and E8M0 scales to
``lax.scaled_dot`` (MX tensor cores on Blackwell, a decomposition elsewhere; it takes the blocks along the last
axis, so the columnwise copies are transposed for it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.core.checks import check_choice
from jax_nvfp4.linear.block_sum import GEMM_IMPLS, GemmImpl, resolve_impl
from jax_nvfp4.mxfp8.format import MXArray, dequantize, quantize


@dataclasses.dataclass(frozen=True)
class MXFP8:
    """MXFP8 for a layer's GEMMs (frozen, hashable): pass it where a ``Recipe`` goes (``dot_general``'s and
    ``einsum``'s ``recipe=``, the Flax layers, a ``Rule``) to run that layer in MXFP8 instead of NVFP4.

    Attributes:
      impl: how the GEMMs sum their blocks: ``"emulated"`` (dequantized to bfloat16, float32 accumulation),
        ``"scaled_dot"`` (``lax.scaled_dot`` on E4M3 values and E8M0 scales) or ``"auto"`` (``scaled_dot`` on
        Blackwell GPUs, ``emulated`` elsewhere; ``jax_nvfp4.linear.block_sum``). MXFP8's GEMMs are XLA's own ops,
        so ``"auto"`` is decided when they are traced, for the devices in context (the mesh's, else JAX's),
        not while they lower as the NVFP4 GEMM's is.
    """

    impl: GemmImpl = "auto"

    def __post_init__(self) -> None:
        # "fused" is the NVFP4 GEMM's Pallas kernel, which decodes E2M1 codes, and "cudnn" its cuDNN call: no
        # MXFP8 counterparts here.
        check_choice("MXFP8.impl", self.impl, tuple(i for i in GEMM_IMPLS if i not in ("fused", "cudnn")))

    needs_rng_key = False  # round to nearest everywhere: no random bits (a Recipe's attribute, for the layers)


def _sum(a: MXArray, a_axis: int, c: MXArray, c_axis: int, impl: str) -> jax.Array:
    """Float32 [B, *a's other axes, *c's other axes]: the sum over a's axis ``a_axis`` and c's ``c_axis`` (each
    quantized along it), batch axis 0."""
    if impl == "scaled_dot":  # it takes the blocks along the last axis
        # The barrier materializes the transposed copies: XLA's CPU dot cannot take a bf16 operand's transpose.
        a, c = lax.optimization_barrier(
            (MXArray(*(jnp.moveaxis(t, a_axis, -1) for t in a)), MXArray(*(jnp.moveaxis(t, c_axis, -1) for t in c)))
        )
        e8m0 = jnp.float8_e8m0fnu
        return lax.scaled_dot(
            a.values,
            c.values,
            lhs_scale=lax.bitcast_convert_type(a.scales, e8m0),
            rhs_scale=lax.bitcast_convert_type(c.scales, e8m0),
            dimension_numbers=(((2,), (2,)), ((0,), (0,))),
            preferred_element_type=jnp.float32,
        )
    return lax.dot_general(
        dequantize(a, a_axis, jnp.bfloat16),
        dequantize(c, c_axis, jnp.bfloat16),
        (((a_axis,), (c_axis,)), ((0,), (0,))),
        preferred_element_type=jnp.float32,
    )


def _rows(x: jax.Array) -> jax.Array:
    """[B, *M, L] -> [B, prod(M), L]."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul(x: jax.Array, w: jax.Array, config: MXFP8, dtypes: tuple[np.dtype, np.dtype, np.dtype]) -> jax.Array:
    """x [B, *M, K], w [B, N, K] -> y [B, *M, N], every GEMM in MXFP8 (see the module); ``dtypes``: those of y,
    and of the gradients of x and of w."""
    y = _sum(quantize(_rows(x)), 2, quantize(w), 2, resolve_impl(config.impl))
    return y.reshape(*x.shape[:-1], w.shape[1]).astype(dtypes[0])


def _matmul_fwd(x, w, config: MXFP8, dtypes):
    # The backward pass's copies: x [B, M, K] along M, W [B, N, K] along N.
    return matmul(x, w, config, dtypes), (quantize(_rows(x), 1), quantize(w, 1))


def _matmul_bwd(config: MXFP8, dtypes, residuals, dy):
    qx, qw = residuals
    impl = resolve_impl(config.impl)
    rows = dy.shape[:-1]  # [B, *M]
    dy = _rows(dy)
    dx = _sum(quantize(dy, 2), 2, qw, 1, impl)  # [B, M, K]: dy and W along N
    dw = _sum(quantize(dy, 1), 1, qx, 1, impl)  # [B, N, K]: dy and x along M
    return dx.reshape(*rows, dx.shape[-1]).astype(dtypes[1]), dw.astype(dtypes[2])


matmul.defvjp(_matmul_fwd, _matmul_bwd)


__all__ = ["MXFP8", "matmul"]
