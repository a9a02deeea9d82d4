"""The NVFP4 GEMM, emulated exactly with a bf16 dot (CPU, and GPUs without FP4 tensor cores).

Every operand contracts over its last, packed axis: y[b, i, j] = sum_k a[b, i, k] * c[b, j, k].
An E2M1 value times an E4M3 scale has at most 6 significant bits and lies in
[2^-10, 2688], so ``code * block_scale`` is exact in bfloat16; the bf16 products
are exact in float32, and only the float32 accumulation rounds, as on FP4 tensor
cores. The float32 result is multiplied by the product of the two global decode
scales ``amax / (6 * 448)``: the reference GEMM's alpha, amax_a * amax_c / 2688^2,
rounded in an order that cannot overflow or underflow for ordinary amaxes.

The GEMM is one primitive (``nvfp4_gemm``) so that it partitions as a whole:
under ``jit`` on a mesh, whatever collective brings the operands to the layout
of the output moves their packed codes and scales, never dequantized values.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4 import _bits as b
from jax_nvfp4 import _partition, _primitive, reference
from jax_nvfp4.formats import E2M1_MAX, E4M3_MAX
from jax_nvfp4.primitives import dequantize_p
from jax_nvfp4.tensor import NVFP4Tensor


class Operand(NamedTuple):
    """One quantized GEMM operand, [B, *R, *L] blocked along the last axis (contracting).

    data  uint8 [B, *R, *L[:-1], ceil(L[-1]/2)], scale float8_e4m3fn [..., ceil(L[-1]/16)],
    amax float32 [].
    """

    data: jax.Array
    scale: jax.Array
    amax: jax.Array


def block_values(data: jax.Array, scale: jax.Array, length: int) -> jax.Array:
    """``E2M1(code) * block_scale`` as bfloat16 [B, R, length]; exact (no global scale).

    The dequantize primitive with amax = 6 * 448, whose global decode scale is 1.
    """
    unit = jnp.full(data.shape[:1], E2M1_MAX * E4M3_MAX, jnp.float32)
    return dequantize_p.bind(data, scale, unit, cols=length, dtype=jnp.dtype(jnp.bfloat16))[0]


def global_decode_scale(amax_a: jax.Array, amax_c: jax.Array) -> jax.Array:
    """fp32(amax_a / 2688) * fp32(amax_c / 2688), rounded exactly and symmetric in a and c."""
    a, c = (reference.dequantize_scale(b.to_bits(jnp.asarray(x, jnp.float32))) for x in (amax_a, amax_c))
    return b.from_bits(b.mul(a, c))


def _split(shape, contract_ndim: int) -> tuple[tuple[int, ...], int]:
    """[B, *R, *L] -> (R, prod of the L axes before the last)."""
    return tuple(shape[1 : len(shape) - contract_ndim]), math.prod(shape[len(shape) - contract_ndim : -1])


def _gemm_reference(a_data, a_scale, a_amax, c_data, c_scale, c_amax, *, contract_ndim, length, out_dtype):
    def values(data, scale):  # [B, *R, *L] -> bf16 [B, prod(R), prod(L)]
        rows, lead = _split(data.shape, contract_ndim)
        b = data.shape[0]
        scale = lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
        v = block_values(data.reshape(b, -1, data.shape[-1]), scale.reshape(b, -1, scale.shape[-1]), length)
        return v.reshape(b, math.prod(rows), lead * length), rows

    (a, a_rows), (c, c_rows) = values(a_data, a_scale), values(c_data, c_scale)
    acc = lax.dot_general(a, c, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    # One product of the two scales keeps a.c^T and c.a^T transposes of each other, bit for bit.
    y = (acc * global_decode_scale(a_amax, c_amax)[:, None, None]).astype(out_dtype)
    return (y.reshape(a.shape[0], *a_rows, *c_rows),)


def _gemm_abstract(a_data, a_scale, a_amax, c_data, c_scale, c_amax, *, contract_ndim, length, out_dtype):
    a_rows, c_rows = _split(a_data.shape, contract_ndim)[0], _split(c_data.shape, contract_ndim)[0]
    return (_primitive.shaped((a_data.shape[0], *a_rows, *c_rows), out_dtype),)


gemm_p = _primitive.define(
    "nvfp4_gemm",
    abstract_eval=_gemm_abstract,
    reference=_gemm_reference,
    partitioning=_partition.GEMM,
)


@functools.partial(jax.jit, static_argnames=("length", "out_dtype", "contract_ndim"))
def emulated_gemm(a: Operand, c: Operand, length: int, out_dtype, contract_ndim: int = 1) -> jax.Array:
    """[B, *Ra, *L] x [B, *Rc, *L] -> [B, *Ra, *Rc] of ``out_dtype``, contracting the L axes.

    ``contract_ndim`` axes L are contracted; ``length`` is the size of the last
    (packed) one.
    """
    batch = (a.data.shape[0],)
    # Scales travel as their E4M3 bytes: XLA on CPU widens float8 collectives to f16.
    (y,) = gemm_p.bind(
        a.data,
        lax.bitcast_convert_type(a.scale, jnp.uint8),
        jnp.broadcast_to(a.amax, batch),
        c.data,
        lax.bitcast_convert_type(c.scale, jnp.uint8),
        jnp.broadcast_to(c.amax, batch),
        contract_ndim=contract_ndim,
        length=length,
        out_dtype=jnp.dtype(out_dtype),
    )
    return y


def gemm(a: NVFP4Tensor, c: NVFP4Tensor, out_dtype=jnp.float32) -> jax.Array:
    """NVFP4 GEMM of two rowwise-quantized tensors: ``a @ c.T`` over their last axis.

    Args:
      a: quantized [..., K] (rows M = prod of its leading axes).
      c: quantized [..., K] (rows N), e.g. a weight stored [N, K].
      out_dtype: result dtype; the sum is accumulated in float32.

    Returns:
      [*a.shape[:-1], *c.shape[:-1]]: sum_k a[..., k] * c[..., k] of the
      dequantized values, exact up to the float32 accumulation.
    """
    if a.data is None or c.data is None:
        raise ValueError("gemm needs the rowwise copy of both operands (quantize with rowwise=True)")
    if a.cols != c.cols:
        raise ValueError(f"contracting sizes differ: a has {a.cols}, c has {c.cols}")

    def matrix(t: NVFP4Tensor) -> Operand:
        return Operand(t.data.reshape(1, t.rows, -1), t.scale.reshape(1, t.rows, -1), t.amax)

    y = emulated_gemm(matrix(a), matrix(c), a.cols, out_dtype)
    return y.reshape(*a.shape[:-1], *c.shape[:-1])
