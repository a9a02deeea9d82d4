"""The NVFP4 primitives (amax, quantize, dequantize) and the kernel backend.

Operands and results carry a leading batch axis (see ``_primitive``). Rows may
span several axes R = (..., M) (e.g. batch and sequence, kept apart so each can
stay sharded); the kernels see them as one axis of prod(R) rows, which gives
the same bytes where M is whole blocks of 16:
  nvfp4_amax:       x [B, *R, N]                 -> amax float32 [B] (and with ``rht`` the amax of the
                    Random Hadamard Transform of x^T, from the same pass); sharded, they are
                    reduced (max) over the mesh axes ``mesh_axes`` (None: all). ``row_scaled``:
                    the amax of each row, [B, *R], and of each row of x^T (of its transform with
                    ``rht``), [B, N], reduced over the mesh axes of the other dimension
  nvfp4_quantize:   x [B, *R, N], amax [B], amax_t [B], seed uint32 [2]
                                                 -> data [B, *R, ceil(N/2)] uint8,
                    scale [B, *R, ceil(N/16)] e4m3 (rowwise), then
                    data_t [B, N, *R[:-1], ceil(M/2)], scale_t [B, N, *R[:-1], ceil(M/16)]
                    (the columnwise copy scaled by amax_t, of the RHT of x^T with ``rht``);
                    ``stochastic`` rounds with random words drawn from ``seed``;
                    ``row_scaled``: amax [B, *R] and amax_t [B, N], one per row of each copy;
                    ``four_over_six`` ("mae" / "mse" / None, ``four_over_six_fast_math``) and
                    ``e4m3_max`` (448 / 256) as ``reference.quantize_core``
  nvfp4_dequantize: data, scale, amax [B] or per row [B, M] -> [B, M, cols] of `dtype`
                    (``e4m3_max``: the divisor 6 * e4m3_max)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import _frontend, _partition, _primitive, reference
from jax_nvfp4._primitive import shaped
from jax_nvfp4.formats import BLOCK, num_blocks, packed_size

SCALE_DTYPE = jnp.float8_e4m3fn


# The kernels' int32 code of a 4over6 error mode.
FOUR_OVER_SIX_CODES = {None: 0, "mae": 1, "mse": 2}


def _amax_abstract(x, *, mesh_axes, rht, row_scaled):
    del mesh_axes
    if row_scaled:  # one per row of x [B, *R] and one per row of x^T [B, N]
        return shaped(x.shape[:-1], jnp.float32), shaped((x.shape[0], x.shape[-1]), jnp.float32)
    return (shaped(x.shape[:1], jnp.float32),) * (2 if rht else 1)


def _quantize_abstract(
    x,
    amax,
    amax_t,
    seed,
    *,
    rowwise,
    columnwise,
    block_2d,
    rht,
    stochastic,
    row_scaled,
    four_over_six,
    four_over_six_fast_math,
    e4m3_max,
):
    del seed, four_over_six_fast_math
    reference.check_options(
        block_2d=block_2d, stochastic=stochastic, row_scaled=row_scaled, four_over_six=four_over_six, e4m3_max=e4m3_max
    )
    b, *rows, n = x.shape
    if row_scaled and ((rowwise and amax.shape != (b, *rows)) or (columnwise and amax_t.shape != (b, n))):
        raise ValueError(f"row-scaled amax / amax_t must be {(b, *rows)} / {(b, n)}, got {amax.shape} / {amax_t.shape}")
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


def _amax_on_rows(bind, x, *, mesh_axes, rht, row_scaled):
    outs = bind(_frontend.flat_rows(x))
    if row_scaled:  # the kernel's [B, prod(R)] back to [B, *R]
        return outs[0].reshape(x.shape[:-1]), outs[1]
    return outs


def _flat_amax(amax):
    """A per-row amax [B, *R] as the kernel's [B, prod(R)]; [B] as is."""
    return amax.reshape(amax.shape[0], -1) if amax.ndim > 1 else amax


def _quantize_on_rows(bind, x, amax, amax_t, seed, **params):
    def quantize3(x3, amax, amax_t, seed, **_):
        return bind(x3, _flat_amax(amax), amax_t, seed)

    return _frontend.on_rows(quantize3)(x, amax, amax_t, seed, **params)


def _dequantize_abstract(data, scale, amax, *, cols, dtype, e4m3_max):
    del scale
    if amax.shape not in (data.shape[:1], data.shape[:2]):
        raise ValueError(f"dequantize amax must be [B] or per row [B, M], got {amax.shape} for data {data.shape}")
    if e4m3_max not in (448, 256):
        raise ValueError(f"e4m3_max must be 448 or 256, got {e4m3_max!r}")
    return (shaped((*data.shape[:2], cols), dtype),)


amax_p = _primitive.define(
    "nvfp4_amax",
    abstract_eval=_amax_abstract,
    reference=lambda x, *, mesh_axes, rht, row_scaled: reference.amax_core(x, rht=rht, row_scaled=row_scaled),
    partitioning=_partition.AMAX,
    adapt=_amax_on_rows,
    ffi_attrs=("rht", "row_scaled"),
    defaults={"row_scaled": False},
)
quantize_p = _primitive.define(
    "nvfp4_quantize",
    abstract_eval=_quantize_abstract,
    reference=reference.quantize_core,
    partitioning=_partition.QUANTIZE,
    adapt=_quantize_on_rows,
    ffi_attrs=(
        "rowwise",
        "columnwise",
        "block_2d",
        "rht",
        "stochastic",
        "row_scaled",
        ("four_over_six", lambda mode: np.int32(FOUR_OVER_SIX_CODES[mode])),
        "four_over_six_fast_math",
        ("e4m3_max", np.int32),
    ),
    shared=(3,),  # the seed
    defaults={"row_scaled": False, "four_over_six": None, "four_over_six_fast_math": False, "e4m3_max": 448},
)
dequantize_p = _primitive.define(
    "nvfp4_dequantize",
    abstract_eval=_dequantize_abstract,
    reference=lambda *a, **p: (reference.dequantize_core(*a, **p),),
    partitioning=_partition.DEQUANTIZE,
    ffi_attrs=(("e4m3_max", np.int32),),
    defaults={"e4m3_max": 448},
)


def _amax(x, mesh_axes=None, rht: bool = False, row_scaled: bool = False) -> tuple:
    """x [B, *R, N] -> (amax [B],), with rht (amax [B], amax_t [B]); row_scaled: (amax [B, prod(R)], amax_t [B, N])."""
    outs = tuple(amax_p.bind(x, mesh_axes=mesh_axes, rht=rht, row_scaled=row_scaled))
    if row_scaled:
        return outs[0].reshape(x.shape[0], -1), outs[1]
    return outs


def _quantize(
    x,
    amax,
    amax_t,
    seed,
    *,
    rowwise: bool,
    columnwise: bool,
    block_2d: bool,
    rht: bool,
    stochastic: bool,
    row_scaled: bool = False,
    four_over_six: str | None = None,
    four_over_six_fast_math: bool = False,
    e4m3_max: int = 448,
) -> tuple:
    """quantize_p with the backend's operands: a row-scaled amax [B, prod(R)] is the primitive's [B, *R]."""
    if row_scaled and amax.ndim == 2:
        amax = amax.reshape(x.shape[:-1])
    return tuple(
        quantize_p.bind(
            x,
            amax,
            amax_t,
            seed,
            rowwise=rowwise,
            columnwise=columnwise,
            block_2d=block_2d,
            rht=rht,
            stochastic=stochastic,
            row_scaled=row_scaled,
            four_over_six=four_over_six,
            four_over_six_fast_math=four_over_six_fast_math,
            e4m3_max=int(e4m3_max),
        )
    )


KERNELS = _frontend.Backend(
    amax=_amax,
    quantize=_quantize,
    dequantize=lambda data, scale, amax, *, cols, dtype, e4m3_max=448: dequantize_p.bind(
        data, scale, amax, cols=cols, dtype=dtype, e4m3_max=int(e4m3_max)
    )[0],
)
