"""The NVFP4 primitives (amax, quantize, dequantize) and the kernel backend.

Operands and results carry a leading batch axis (see ``_primitive``). Rows may
span several axes R = (..., M) (e.g. batch and sequence, kept apart so each can
stay sharded); the kernels see them as one axis of prod(R) rows, which gives
the same bytes where M is whole blocks of 16:
  nvfp4_amax:       x [B, *R, N]                 -> amax float32 [B] (and with ``rht`` the amax of the
                    Random Hadamard Transform of x^T, from the same pass); sharded, they are
                    reduced (max) over the mesh axes ``mesh_axes`` (None: all)
  nvfp4_quantize:   x [B, *R, N], amax [B], amax_t [B], seed uint32 [2]
                                                 -> data [B, *R, ceil(N/2)] uint8,
                    scale [B, *R, ceil(N/16)] e4m3 (rowwise), then
                    data_t [B, N, *R[:-1], ceil(M/2)], scale_t [B, N, *R[:-1], ceil(M/16)]
                    (the columnwise copy scaled by amax_t, of the RHT of x^T with ``rht``);
                    ``stochastic`` rounds with random words drawn from ``seed``
  nvfp4_dequantize: data, scale, amax [B]        -> [B, M, cols] of `dtype`
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_nvfp4 import _frontend, _partition, _primitive, reference
from jax_nvfp4._primitive import shaped
from jax_nvfp4.formats import BLOCK, num_blocks, packed_size

SCALE_DTYPE = jnp.float8_e4m3fn


def _amax_abstract(x, *, mesh_axes, rht):
    del mesh_axes
    return (shaped(x.shape[:1], jnp.float32),) * (2 if rht else 1)


def _quantize_abstract(x, amax, amax_t, seed, *, rowwise, columnwise, block_2d, rht, stochastic):
    del amax, amax_t, seed, stochastic
    b, *rows, n = x.shape
    if len(rows) > 1 and (columnwise or block_2d) and rows[-1] % BLOCK:
        raise ValueError(f"rows {rows} of several axes need the last to be whole blocks of {BLOCK}")
    if rht and (block_2d or not columnwise or rows[-1] % BLOCK):
        raise ValueError("rht needs a columnwise 1x16 copy of rows that are whole blocks of 16")
    outs = ()
    if rowwise:
        outs += (shaped((b, *rows, packed_size(n)), jnp.uint8), shaped((b, *rows, num_blocks(n)), SCALE_DTYPE))
    if columnwise:
        lead, m = rows[:-1], rows[-1]
        outs += (shaped((b, n, *lead, packed_size(m)), jnp.uint8), shaped((b, n, *lead, num_blocks(m)), SCALE_DTYPE))
    return outs


def _amax_on_rows(bind, x, *, mesh_axes, rht):
    return bind(_frontend.flat_rows(x))


def _quantize_on_rows(bind, x, *scalars, **params):
    return _frontend.on_rows(lambda x3, *scalars, **_: bind(x3, *scalars))(x, *scalars, **params)


def _dequantize_abstract(data, scale, amax, *, cols, dtype):
    del scale, amax
    return (shaped((*data.shape[:2], cols), dtype),)


amax_p = _primitive.define(
    "nvfp4_amax",
    abstract_eval=_amax_abstract,
    reference=lambda x, *, mesh_axes, rht: reference.amax_core(x, rht=rht),
    partitioning=_partition.AMAX,
    adapt=_amax_on_rows,
    ffi_attrs=("rht",),
)
quantize_p = _primitive.define(
    "nvfp4_quantize",
    abstract_eval=_quantize_abstract,
    reference=reference.quantize_core,
    partitioning=_partition.QUANTIZE,
    adapt=_quantize_on_rows,
    ffi_attrs=("rowwise", "columnwise", "block_2d", "rht", "stochastic"),
    shared=(3,),  # the seed
)
dequantize_p = _primitive.define(
    "nvfp4_dequantize",
    abstract_eval=_dequantize_abstract,
    reference=lambda *a, **p: (reference.dequantize_core(*a, **p),),
    partitioning=_partition.DEQUANTIZE,
)

KERNELS = _frontend.Backend(
    amax=lambda x, mesh_axes=None, rht=False: tuple(amax_p.bind(x, mesh_axes=mesh_axes, rht=rht)),
    quantize=lambda *operands, **p: tuple(quantize_p.bind(*operands, **p)),
    dequantize=lambda data, scale, amax, **p: dequantize_p.bind(data, scale, amax, **p)[0],
)
