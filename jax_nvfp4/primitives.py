"""The NVFP4 primitives (amax, quantize, dequantize) and the kernel backend.

Operands and results carry a leading batch axis (see ``_primitive``). Rows may
span several axes R = (..., M) (e.g. batch and sequence, kept apart so each can
stay sharded); the kernels see them as one axis of prod(R) rows, which gives
the same bytes where M is whole blocks of 16:
  nvfp4_amax:       x [B, *R, N]                 -> amax float32 [B]; sharded, it is
                    reduced (max) over the mesh axes ``mesh_axes`` (None: all)
  nvfp4_quantize:   x [B, *R, N], amax [B]       -> data [B, *R, ceil(N/2)] uint8,
                    scale [B, *R, ceil(N/16)] e4m3 (rowwise), then
                    data_t [B, N, *R[:-1], ceil(M/2)], scale_t [B, N, *R[:-1], ceil(M/16)]
  nvfp4_dequantize: data, scale, amax [B]        -> [B, M, cols] of `dtype`
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_nvfp4 import _frontend, _partition, _primitive, reference
from jax_nvfp4._primitive import shaped
from jax_nvfp4.formats import BLOCK, num_blocks, packed_size

SCALE_DTYPE = jnp.float8_e4m3fn


def _amax_abstract(x, *, mesh_axes):
    del mesh_axes
    return (shaped(x.shape[:1], jnp.float32),)


def _quantize_abstract(x, amax, *, rowwise, columnwise, block_2d):
    del amax
    b, *rows, n = x.shape
    if len(rows) > 1 and (columnwise or block_2d) and rows[-1] % BLOCK:
        raise ValueError(f"rows {rows} of several axes need the last to be whole blocks of {BLOCK}")
    outs = ()
    if rowwise:
        outs += (shaped((b, *rows, packed_size(n)), jnp.uint8), shaped((b, *rows, num_blocks(n)), SCALE_DTYPE))
    if columnwise:
        lead, m = rows[:-1], rows[-1]
        outs += (shaped((b, n, *lead, packed_size(m)), jnp.uint8), shaped((b, n, *lead, num_blocks(m)), SCALE_DTYPE))
    return outs


def _amax_on_rows(bind, x, *, mesh_axes):
    return bind(_frontend.flat_rows(x))


def _quantize_on_rows(bind, x, amax, **params):
    return _frontend.on_rows(lambda x3, amax, **_: bind(x3, amax))(x, amax, **params)


def _dequantize_abstract(data, scale, amax, *, cols, dtype):
    del scale, amax
    return (shaped((*data.shape[:2], cols), dtype),)


amax_p = _primitive.define(
    "nvfp4_amax",
    abstract_eval=_amax_abstract,
    reference=lambda x, *, mesh_axes: (reference.amax_core(x),),
    partitioning=_partition.AMAX,
    adapt=_amax_on_rows,
)
quantize_p = _primitive.define(
    "nvfp4_quantize",
    abstract_eval=_quantize_abstract,
    reference=reference.quantize_core,
    partitioning=_partition.QUANTIZE,
    adapt=_quantize_on_rows,
    ffi_attrs=("rowwise", "columnwise", "block_2d"),
)
dequantize_p = _primitive.define(
    "nvfp4_dequantize",
    abstract_eval=_dequantize_abstract,
    reference=lambda *a, **p: (reference.dequantize_core(*a, **p),),
    partitioning=_partition.DEQUANTIZE,
)

KERNELS = _frontend.Backend(
    amax=lambda x, mesh_axes=None: amax_p.bind(x, mesh_axes=mesh_axes)[0],
    quantize=lambda x, amax, **p: tuple(quantize_p.bind(x, amax, **p)),
    dequantize=lambda data, scale, amax, **p: dequantize_p.bind(data, scale, amax, **p)[0],
)
