"""The NVFP4 GEMM, emulated exactly with a bf16 dot (CPU, and GPUs without FP4 tensor cores).

Every operand contracts over its last, packed axis: y[b, i, j] = sum_k a[b, i, k] * c[b, j, k].
An E2M1 value times an E4M3 scale has at most 6 significant bits and lies in
[2^-10, 2688], so ``code * block_scale`` is exact in bfloat16; the bf16 products
are exact in float32, and only the float32 accumulation rounds, as on FP4 tensor
cores. The float32 sum ``acc`` is then multiplied by the global decode scales
``fp32(amax / (6 E))`` (E = 448, or 256 for 4over6 tensors), each product rounded
to float32, in this order:

  1. g = fp32(s_a * s_c), the product of the per-tensor scales (the reference
     GEMM's alpha, amax_a * amax_c / 2688^2 for E = 448; only the per-tensor
     one where one operand is row-scaled, none where both are): y = fp32(acc * g);
  2. a row-scaled ``a``: y[i, j] = fp32(y[i, j] * s_a[i]) (each output row by its row scale);
  3. a row-scaled ``c``: y[i, j] = fp32(y[i, j] * s_c[j]) (each output column);
  4. a bias (``gemm(..., bias=)``): y[i, j] = fp32(y[i, j] + bias[j]);
  5. the cast to the output dtype.

So a row-scaled GEMM runs with a neutral global scale and scales the rows of
its float32 result afterwards, as a GEMM whose epilogue applies per-token scales.
With two per-tensor operands, one product of the two scales keeps a.c^T and c.a^T
transposes of each other, bit for bit.

The GEMM is one primitive (``nvfp4_gemm``) so that it partitions as a whole:
under ``jit`` on a mesh, whatever collective brings the operands to the layout
of the output moves their packed codes and scales, never dequantized values.
Row scales are applied to its float32 result, elementwise ops XLA shards itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4 import _bits as b
from jax_nvfp4 import _partition, _primitive, reference
from jax_nvfp4._options import check_out_dtype, check_real, check_tensor
from jax_nvfp4.formats import E2M1_MAX, E4M3_MAX
from jax_nvfp4.primitives import dequantize_p
from jax_nvfp4.tensor import NVFP4Tensor


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["data", "scale", "amax"], meta_fields=["row_scaled", "e4m3_max"]
)
@dataclasses.dataclass(frozen=True)
class Operand:
    """One quantized GEMM operand, [B, *R, *L] blocked along the last axis (contracting).

    data  uint8 [B, *R, *L[:-1], ceil(L[-1]/2)], scale float8_e4m3fn [..., ceil(L[-1]/16)],
    amax  float32 [] or [B] (one per tensor), or [B, *R] with ``row_scaled`` (one per row).
    e4m3_max: E of the global decode scale amax / (6 E) (448, or 256 for 4over6 tensors).
    """

    data: jax.Array
    scale: jax.Array
    amax: jax.Array
    row_scaled: bool = False
    e4m3_max: int = 448


def block_values(data: jax.Array, scale: jax.Array, length: int) -> jax.Array:
    """``E2M1(code) * block_scale`` as bfloat16 [B, R, length]; exact (no global scale).

    The dequantize primitive with amax = 6 * 448, whose global decode scale is 1.
    """
    unit = jnp.full(data.shape[:1], E2M1_MAX * E4M3_MAX, jnp.float32)
    return dequantize_p.bind(data, scale, unit, cols=length, dtype=jnp.dtype(jnp.bfloat16))[0]


def decode_scale(amax: jax.Array, e4m3_max: int = 448) -> jax.Array:
    """fp32(amax / (6 E)), rounded exactly: an operand's global decode scale (per tensor or per row)."""
    return b.from_bits(reference.dequantize_scale(b.to_bits(jnp.asarray(amax, jnp.float32)), e4m3_max))


def global_decode_scale(amax_a: jax.Array, amax_c: jax.Array, e4m3_max_a: int = 448, e4m3_max_c: int = 448):
    """fp32(amax_a / (6 E_a)) * fp32(amax_c / (6 E_c)), rounded exactly and symmetric in a and c."""
    a, c = (b.to_bits(decode_scale(x, e)) for x, e in ((amax_a, e4m3_max_a), (amax_c, e4m3_max_c)))
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


def _bind(a: Operand, c: Operand, amax_a, amax_c, length: int, out_dtype, contract_ndim: int) -> jax.Array:
    batch = (a.data.shape[0],)
    # Scales travel as their E4M3 bytes: XLA on CPU widens float8 collectives to f16.
    (y,) = gemm_p.bind(
        a.data,
        lax.bitcast_convert_type(a.scale, jnp.uint8),
        jnp.broadcast_to(amax_a, batch),
        c.data,
        lax.bitcast_convert_type(c.scale, jnp.uint8),
        jnp.broadcast_to(amax_c, batch),
        contract_ndim=contract_ndim,
        length=length,
        out_dtype=jnp.dtype(out_dtype),
    )
    return y


def _row_scale(op: Operand, contract_ndim: int, before: int, after: int) -> jax.Array:
    """A row-scaled operand's decode scales [B, *R], shaped to broadcast over the output's axes."""
    rows = _split(op.data.shape, contract_ndim)[0]
    if op.amax.shape != (op.data.shape[0], *rows):
        raise ValueError(
            f"a row-scaled operand's amax must be [B, *R] = {(op.data.shape[0], *rows)}, got {op.amax.shape}"
        )
    # The barrier keeps the scales' integer emulation out of the fusion with the output's multiply and cast,
    # which XLA's CPU compiler otherwise spends minutes on.
    s = lax.optimization_barrier(decode_scale(op.amax, op.e4m3_max))
    return s.reshape(s.shape[0], *(1,) * before, *rows, *(1,) * after)


@functools.partial(jax.jit, static_argnames=("length", "out_dtype", "contract_ndim"))
def emulated_gemm(
    a: Operand, c: Operand, length: int, out_dtype, contract_ndim: int = 1, bias: jax.Array | None = None
) -> jax.Array:
    """[B, *Ra, *L] x [B, *Rc, *L] -> [B, *Ra, *Rc] of ``out_dtype``, contracting the L axes.

    ``contract_ndim`` axes L are contracted; ``length`` is the size of the last
    (packed) one. The global decode scales, then ``bias`` (float32, broadcast
    against the output), apply in the order of the module docstring.
    """
    plain = not (a.row_scaled or c.row_scaled) and a.e4m3_max == c.e4m3_max == 448
    if plain and bias is None:
        return _bind(a, c, a.amax, c.amax, length, out_dtype, contract_ndim)  # the scale product inside
    # Global decode scale 1 in the primitive (amax = 6 * 448); the scales apply to its float32 result.
    unit = jnp.float32(E2M1_MAX * E4M3_MAX)
    y = _bind(a, c, unit, unit, length, jnp.float32, contract_ndim)
    ra, rc = len(_split(a.data.shape, contract_ndim)[0]), len(_split(c.data.shape, contract_ndim)[0])
    per_tensor = [
        jnp.broadcast_to(decode_scale(op.amax, op.e4m3_max), y.shape[:1]) for op in (a, c) if not op.row_scaled
    ]
    if per_tensor:
        g = per_tensor[0] if len(per_tensor) == 1 else b.from_bits(b.mul(*(b.to_bits(s) for s in per_tensor)))
        y = y * g.reshape(-1, *(1,) * (ra + rc))
    if a.row_scaled:
        y = y * _row_scale(a, contract_ndim, 0, rc)
    if c.row_scaled:
        y = y * _row_scale(c, contract_ndim, ra, 0)
    if bias is not None:
        y = y + bias
    return y.astype(out_dtype)


def _bias(bias, out_shape: tuple[int, ...]) -> jax.Array:
    """gemm's bias as float32 broadcast to the output, or an error naming the option."""
    check_real("gemm's bias", bias)
    shape = jnp.shape(bias)
    try:
        return jnp.broadcast_to(jnp.asarray(bias, jnp.float32), out_shape)
    except ValueError as e:
        raise ValueError(f"gemm's bias of shape {shape} does not broadcast to the output shape {out_shape}") from e


def gemm(a: NVFP4Tensor, c: NVFP4Tensor, out_dtype=jnp.float32, bias: jax.Array | None = None) -> jax.Array:
    """NVFP4 GEMM of two rowwise-quantized tensors: ``a @ c.T`` over their last axis.

    Args:
      a: quantized [..., K] (rows M = prod of its leading axes).
      c: quantized [..., K] (rows N), e.g. a weight stored [N, K].
      out_dtype: result dtype; the sum is accumulated in float32.
      bias: added in float32 after the scales and before the cast to
        ``out_dtype``, as a GEMM epilogue does; shape ``c.shape[:-1]`` (one
        per output column) or anything that broadcasts against the result.

    Returns:
      [*a.shape[:-1], *c.shape[:-1]]: sum_k a[..., k] * c[..., k] of the
      dequantized values, exact up to the float32 accumulation and the
      float32 products with the global decode scales. A row-scaled ``a``
      scales each output row by its own decode scale, a row-scaled ``c``
      each output column (after the sum; the module docstring has the order).
    """
    check_tensor("gemm's a", a)
    check_tensor("gemm's c", c)
    out_dtype = check_out_dtype(out_dtype, "out_dtype", "gemm")
    if a.data is None or c.data is None:
        raise ValueError("gemm needs the rowwise copy of both operands (quantize with rowwise=True)")
    if a.cols != c.cols:
        raise ValueError(f"contracting sizes differ: a has {a.cols}, c has {c.cols}")

    def matrix(t: NVFP4Tensor) -> Operand:
        amax = t.amax.reshape(1, t.rows) if t.row_scaled else t.amax
        return Operand(t.data.reshape(1, t.rows, -1), t.scale.reshape(1, t.rows, -1), amax, t.row_scaled, t.e4m3_max)

    out_shape = (*a.shape[:-1], *c.shape[:-1])
    if bias is not None:
        bias = _bias(bias, out_shape).reshape(1, a.rows, c.rows)
    y = emulated_gemm(matrix(a), matrix(c), a.cols, out_dtype, bias=bias)
    return y.reshape(out_shape)
