"""The NVFP4 GEMM: block sums by an exact bf16 emulation or by XLA's ``lax.scaled_dot`` (``block_sum``).

Every operand contracts over its last, packed axis: y[b, i, j] = sum_k a[b, i, k] * c[b, j, k].
An E2M1 value times an E4M3 scale has at most 6 significant bits and lies in
[2^-10, 2688], so ``code * block_scale`` is exact in bfloat16; the bf16 products
are exact in float32, and only the float32 accumulation rounds, as on FP4 tensor
cores. ``lax.scaled_dot`` computes the same sum (on FP4 tensor cores on Blackwell,
in another order of accumulation). The float32 sum ``acc`` is then multiplied by the global decode scales
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
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jax_nvfp4.core.checks import check_out_dtype, check_real
from jax_nvfp4.core.formats import E2M1_MAX, E4M3_MAX
from jax_nvfp4.core.spec import GlobalScale
from jax_nvfp4.core.tensor import NVFP4Tensor, check_tensor
from jax_nvfp4.linear.block_sum import GemmImpl, check_impl
from jax_nvfp4.ops.gemm import decode_scale, gemm_p, scale_product, split


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale", "amax"],
    meta_fields=["contract_ndim", "length", "global_scale", "packed_rows"],
)
@dataclasses.dataclass(frozen=True)
class _Copy:
    """One copy of a batched tensor as a GEMM operand: [B, *R, *L] blocked along the last axis.

    The rowwise copy of [B, *R, N] contracts N; the columnwise one, [B, N, *R[:-1], ceil(R[-1]/2)],
    contracts the R axes; or, in 16x16 blocks, the rowwise copy of [B, R, N] does, read transposed
    (``packed_rows`` N: ``ops.gemm``'s ``c_packed_rows``). Only what the GEMM reads, so that its jit cache does
    not split on the rest of a spec.
    """

    data: jax.Array
    scale: jax.Array
    amax: jax.Array
    contract_ndim: int
    length: int
    global_scale: GlobalScale
    packed_rows: int = 0

    @classmethod
    def of(cls, t: NVFP4Tensor, columnwise: bool, transposed: bool = False) -> _Copy:
        if transposed:
            if not (columnwise and t.spec.transposable and t.batched and len(t.shape) == 3 and t.data is not None):
                raise ValueError("a GEMM reads transposed only the rowwise copy of a [B, R, L] tensor in 16x16 blocks")
            return cls(t.data, t.scale, t.amax, 1, t.shape[1], t.spec.global_scale, t.shape[2])
        if columnwise:
            arrays, contract_ndim, length = (t.data_t, t.scale_t, t.amax_t), len(t.shape) - 2, t.shape[-2]
        else:
            arrays, contract_ndim, length = (t.data, t.scale, t.amax), 1, t.shape[-1]
        if arrays[0] is None:
            raise ValueError(f"this GEMM needs the {'columnwise' if columnwise else 'rowwise'} copy of its operand")
        return cls(*arrays, contract_ndim, length, t.spec.global_scale)

    @property
    def rows(self) -> tuple[int, ...]:
        return (self.packed_rows,) if self.packed_rows else split(self.data.shape, self.contract_ndim)[0]


def _bind(a: _Copy, c: _Copy, amax_a, amax_c, out_dtype, impl: str, keep_c: bool) -> tuple[jax.Array, ...]:
    """The primitive's results: y, and with ``keep_c`` c's codes and E4M3 bytes as the GEMM read them."""
    batch = (a.data.shape[0],)
    # Scales travel as their E4M3 bytes: XLA on CPU widens float8 collectives to f16.
    return gemm_p.bind(
        a.data,
        lax.bitcast_convert_type(a.scale, jnp.uint8),
        jnp.broadcast_to(amax_a, batch),
        c.data,
        lax.bitcast_convert_type(c.scale, jnp.uint8),
        jnp.broadcast_to(amax_c, batch),
        contract_ndim=a.contract_ndim,
        length=a.length,
        out_dtype=jnp.dtype(out_dtype),
        impl=impl,
        keep_c=keep_c,
        c_packed_rows=c.packed_rows,
    )


def _row_scale(op: _Copy, before: int, after: int) -> jax.Array:
    """A row-scaled operand's decode scales [B, *R], shaped to broadcast over the output's axes."""
    if op.amax.shape != (op.data.shape[0], *op.rows):
        raise ValueError(
            f"a row-scaled operand's amax must be [B, *R] = {(op.data.shape[0], *op.rows)}, got {op.amax.shape}"
        )
    # The barrier keeps the scales' integer emulation out of the fusion with the output's multiply and cast,
    # which XLA's CPU compiler otherwise spends minutes on.
    s = lax.optimization_barrier(decode_scale(op.amax, op.global_scale))
    return s.reshape(s.shape[0], *(1,) * before, *op.rows, *(1,) * after)


def batched_gemm(
    a: NVFP4Tensor,
    c: NVFP4Tensor,
    out_dtype: DTypeLike,
    *,
    a_columnwise: bool = False,
    c_columnwise: bool = False,
    c_transposed: bool = False,
    bias: jax.Array | None = None,
    impl: GemmImpl = "auto",
    keep_c: bool = False,
) -> jax.Array | tuple[jax.Array, NVFP4Tensor]:
    """Batched tensors a [B, ...] and c [B, ...] -> [B, *Ra, *Rc] of ``out_dtype``, contracting one copy of each.

    The rowwise copy of [B, *R, L] contracts L (its rows R); the columnwise
    copy contracts R (its rows are L). Both copies contract the same axes. The
    global decode scales, then ``bias`` (float32, broadcast against the
    output), apply in the order of the module docstring. ``impl``: see ``gemm``. ``c_transposed`` (with
    ``c_columnwise``): c [B, R, L] in 16x16 blocks, whose columnwise copy holds its rowwise copy's blocks, is
    read from its rowwise copy, transposed by the GEMM: no transposed copy of its bytes is made.
    ``keep_c``: also return c with the copy the GEMM read (alone) in the layout the GEMM
    gathered it to on a mesh, for another GEMM to reuse without gathering it again.
    """
    if c_transposed and keep_c:
        raise ValueError("a GEMM keeps c as it read it, not transposed")
    ca, cc = _Copy.of(a, a_columnwise), _Copy.of(c, c_columnwise, c_transposed)
    if ca.contract_ndim != cc.contract_ndim or ca.length != cc.length:
        raise ValueError("the two GEMM operands contract different axes")
    y, *kept = _gemm(ca, cc, jnp.dtype(out_dtype), bias, check_impl(impl, "the GEMM's impl"), keep_c)
    if not keep_c:
        return y
    data, scale = kept[0], lax.bitcast_convert_type(kept[1], jnp.float8_e4m3fn)
    if c_columnwise:
        return y, dataclasses.replace(c, data=None, scale=None, data_t=data, scale_t=scale)
    return y, dataclasses.replace(c, data=data, scale=scale, data_t=None, scale_t=None, amax_t=None)


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "keep_c"))
def _gemm(ca: _Copy, cc: _Copy, out_dtype: jnp.dtype, bias: jax.Array | None, impl: str, keep_c: bool) -> tuple:
    """y, and with ``keep_c`` the primitive's copy of c's codes and scale bytes."""
    plain = ca.global_scale.plain and cc.global_scale.plain
    if plain and bias is None:
        return tuple(_bind(ca, cc, ca.amax, cc.amax, out_dtype, impl, keep_c))  # the scale product inside
    # Global decode scale 1 in the primitive (amax = 6 * 448); the scales apply to its float32 result.
    unit = jnp.float32(E2M1_MAX * E4M3_MAX)
    y, *kept = _bind(ca, cc, unit, unit, jnp.float32, impl, keep_c)
    ra, rc = len(ca.rows), len(cc.rows)
    per_tensor = [
        jnp.broadcast_to(decode_scale(op.amax, op.global_scale), y.shape[:1])
        for op in (ca, cc)
        if not op.global_scale.per_row
    ]
    if per_tensor:
        y = y * scale_product(per_tensor).reshape(-1, *(1,) * (ra + rc))
    if ca.global_scale.per_row:
        y = y * _row_scale(ca, 0, rc)
    if cc.global_scale.per_row:
        y = y * _row_scale(cc, ra, 0)
    if bias is not None:
        y = y + bias
    return (y.astype(out_dtype), *kept)


def _bias(bias, out_shape: tuple[int, ...]) -> jax.Array:
    """gemm's bias as float32 broadcast to the output, or an error naming the option."""
    check_real("gemm's bias", bias)
    shape = jnp.shape(bias)
    try:
        return jnp.broadcast_to(jnp.asarray(bias, jnp.float32), out_shape)
    except ValueError as e:
        raise ValueError(f"gemm's bias of shape {shape} does not broadcast to the output shape {out_shape}") from e


def _as_batch(t: NVFP4Tensor) -> NVFP4Tensor:
    """A quantized tensor's rowwise copy as a batch of one [1, M, N] (amax [1], or [1, M] per row)."""
    amax = t.amax.reshape(1, *t.spec.copy_shapes((t.rows,), t.cols).amax)
    data, scale = t.data.reshape(1, t.rows, -1), t.scale.reshape(1, t.rows, -1)
    return NVFP4Tensor(data, scale, amax, None, None, None, (1, t.rows, t.cols), t.dtype, t.spec, batched=True)


def gemm(
    a: NVFP4Tensor,
    b_t: NVFP4Tensor | None = None,
    out_dtype: DTypeLike = jnp.float32,
    bias: jax.Array | None = None,
    *,
    impl: GemmImpl = "auto",
    c: NVFP4Tensor | None = None,
) -> jax.Array:
    """NVFP4 GEMM of two rowwise-quantized tensors, both blocked along K: ``a @ b_t.T``.

    Args:
      a: quantized [..., K] (rows M = prod of its leading axes).
      b_t: the other operand B [K, N], quantized transposed: [..., K] (rows N), e.g. a weight stored [N, K].
      out_dtype: result dtype; the sum is accumulated in float32.
      bias: added in float32 after the scales and before the cast to
        ``out_dtype``, as a GEMM epilogue does; shape ``b_t.shape[:-1]`` (one
        per output column) or anything that broadcasts against the result.
      impl: how the block sums run: ``"emulated"`` (the blocks dequantized to
        bf16, then a bf16 dot with float32 accumulation), ``"scaled_dot"``
        (``lax.scaled_dot`` on float4_e2m1fn codes and E4M3 scales: XLA's own
        block-scaled dot, a Triton GEMM on the FP4 tensor cores on Blackwell),
        ``"cudnn"`` (``jax.nn.scaled_matmul``: cuDNN's block-scaled GEMM on
        Blackwell), ``"fused"`` (a Pallas GEMM that decodes the packed operands
        in its tiles, with no bf16 copy in memory: for GPUs without FP4 tensor
        cores; interpreted, slowly, off the GPU) or ``"auto"`` (``scaled_dot``
        where the devices it is compiled for have FP4 tensor cores, ``emulated``
        elsewhere: ``jax_nvfp4.linear.block_sum``). The scales' epilogue is ours
        either way.
      c: the former name of ``b_t``, deprecated.

    Returns:
      ``[*a.shape[:-1], *b_t.shape[:-1]]``: ``sum_k a[..., k] * b_t[..., k]`` of the
      dequantized values, exact up to the float32 accumulation and the
      float32 products with the global decode scales. A row-scaled ``a``
      scales each output row by its own decode scale, a row-scaled ``b_t``
      each output column (after the sum; the module docstring has the order).
    """
    if c is not None:
        if b_t is not None:
            raise TypeError("gemm takes b_t or its deprecated name c, not both")
        warnings.warn("gemm's argument c is deprecated: it is named b_t", DeprecationWarning, stacklevel=2)
        b_t = c
    if b_t is None:
        raise TypeError("gemm needs its second operand b_t (B quantized transposed, [..., K])")
    check_tensor("gemm's a", a)
    check_tensor("gemm's b_t", b_t)
    out_dtype = check_out_dtype(out_dtype, "out_dtype", "gemm")
    impl = check_impl(impl, "gemm's impl")
    if a.data is None or b_t.data is None:
        raise ValueError("gemm needs the rowwise copy of both operands (quantize with rowwise=True)")
    if a.cols != b_t.cols:
        raise ValueError(f"contracting sizes differ: a has {a.cols}, b_t has {b_t.cols}")

    out_shape = (*a.shape[:-1], *b_t.shape[:-1])
    if bias is not None:
        bias = _bias(bias, out_shape).reshape(1, a.rows, b_t.rows)
    y = batched_gemm(_as_batch(a), _as_batch(b_t), out_dtype, bias=bias, impl=impl)
    return y.reshape(out_shape)
