"""The columnwise copy of a 16x16-block tensor, made from its rowwise copy by moving bytes.

With 16x16 blocks both copies quantize the same blocks of 256 values with the same global amax, so
the columnwise copy (the quantization of x^T) holds the rowwise codes nibble-transposed and the
block scales transposed: no value is quantized again. A weight's quantized copy is therefore made,
kept and all-gathered once; the dgrad GEMM reads it transposed (``ops.gemm``'s ``c_packed_rows``), and
where a columnwise copy is wanted in memory (a restored checkpoint, ``lax.scaled_dot``'s operand) it is
this local transpose of the bytes (byte-equal to what quantizing with ``columnwise=True`` makes:
tests/gemm/test_weight_copy.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.tensor import NVFP4Tensor


def transpose_codes(data: jax.Array, rows: int, cols: int) -> jax.Array:
    """Packed codes [B, rows, ceil(cols/2)] -> [B, cols, ceil(rows/2)] (a padding nibble is 0).

    Output row 2j holds the low nibbles of input byte column j, row 2j + 1 the high ones; each output byte
    pairs two input rows. So: an elementwise map over adjacent row pairs gives the output transposed, then a
    plain byte transpose. The barrier keeps them two passes: XLA's CPU compiler fused them into one that read
    the input strided, several times slower at 4096 x 4096."""
    if rows % 2:
        data = jnp.pad(data, ((0, 0), (0, 1), (0, 0)))
    b, half = data.shape[0], data.shape[1] // 2
    rows2 = data.reshape(b, half, 2, data.shape[2])  # [B, ceil(rows/2), 2, ceil(cols/2)]: the two rows of a byte
    even, odd = rows2[:, :, 0], rows2[:, :, 1]
    low = (even & jnp.uint8(0x0F)) | (odd << 4)  # output rows 2j, from the low nibbles
    high = (even >> 4) | (odd & jnp.uint8(0xF0))  # output rows 2j + 1, from the high nibbles
    pairs = jnp.stack([low, high], axis=-1).reshape(b, half, -1)
    if pairs.shape[-1] != cols:
        pairs = pairs[:, :, :cols]
    return lax.optimization_barrier(pairs).transpose(0, 2, 1)


def transpose_scales(scale: jax.Array, rows: int, cols: int) -> jax.Array:
    """Block scales [B, rows, ceil(cols/16)], each block's repeated on its 16 rows -> [B, cols, ceil(rows/16)]
    (E4M3, or their bytes: the dtype they come in)."""
    b, blocks = scale.shape[0], -(-rows // BLOCK)
    s = lax.bitcast_convert_type(scale, jnp.uint8)
    s = jnp.pad(s, ((0, 0), (0, blocks * BLOCK - rows), (0, 0)))
    s = s.reshape(b, blocks, BLOCK, -1)[:, :, 0].transpose(0, 2, 1)  # one row per block: [B, cols/16, blocks]
    s = jnp.repeat(s, BLOCK, axis=1)[:, :cols]
    return lax.bitcast_convert_type(s, scale.dtype)


def with_columnwise_copy(t: NVFP4Tensor) -> NVFP4Tensor:
    """``t`` (16x16 blocks, its rowwise copy) with the columnwise copy filled in from the rowwise bytes.

    A batched tensor [B, R, L] (one row axis, as ``dot_general`` makes a weight's) or one from
    ``quantize`` [..., L] (its rows flattened). Equal, byte for byte, to quantizing the same input
    with ``columnwise=True``: codes, scales and amax.
    """
    if not t.spec.transposable:
        raise ValueError("only a tensor in 16x16 blocks has a columnwise copy that is its rowwise one transposed")
    if t.data is None:
        raise ValueError("the columnwise copy is made from the rowwise copy, which this tensor lacks")
    if t.batched and len(t.shape) != 3:
        raise ValueError(f"a batched tensor needs one row axis, [B, R, L], to transpose its copy; got {t.shape}")
    rows, cols = (t.shape[1], t.shape[2]) if t.batched else (t.rows, t.cols)
    data = t.data.reshape(-1, rows, t.data.shape[-1])
    scale = t.scale.reshape(-1, rows, t.scale.shape[-1])
    data_t, scale_t = transpose_codes(data, rows, cols), transpose_scales(scale, rows, cols)
    if not t.batched:
        data_t, scale_t = data_t[0], scale_t[0]
    return dataclasses.replace(
        t, data_t=data_t, scale_t=scale_t, amax_t=t.amax, spec=dataclasses.replace(t.spec, columnwise=True)
    )
