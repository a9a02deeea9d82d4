"""Collectives on quantized tensors, for use inside ``jax.shard_map``.

Under ``jit`` with sharded inputs the primitives partition themselves (see
``_partition``): the amax is reduced over the mesh and the GEMM gathers
quantized operands. Inside ``shard_map`` the program is per device, so this
module gives the explicit form: reduce the amax with
``lax.pmax(jax_nvfp4.amax(x), axis_name)`` (or quantize with that amax), then
``all_gather`` the quantized shards, moving 4-bit codes and 8-bit scales
instead of the high-precision values.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.core.checks import check_flag
from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.tensor import NVFP4Tensor, check_tensor


def _agreed_amax(amax: jax.Array, axis_name) -> jax.Array:
    """The amax shared by all shards, or NaN where they differ (so nothing dequantizes silently wrong)."""
    hi, lo = lax.pmax(amax, axis_name), lax.pmin(amax, axis_name)
    return jnp.where(hi == lo, hi, jnp.float32(jnp.nan))


def _gather_bytes(x: jax.Array, axis_name, axis: int, tiled: bool) -> jax.Array:
    """all_gather of the raw bytes (E4M3 scales as uint8: some backends widen float8 collectives)."""
    if x.dtype == jnp.uint8:
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    gathered = lax.all_gather(lax.bitcast_convert_type(x, jnp.uint8), axis_name, axis=axis, tiled=tiled)
    return lax.bitcast_convert_type(gathered, x.dtype)


def _gather_columns(x: jax.Array, axis_name, outer: int) -> jax.Array:
    """Gather a columnwise array [N, outer * run / per_value] whose rows interleave by shard.

    The shards' columns come back as [world, N, outer, run'] blocks; moving the
    world axis inside gives the columnwise copy of the gathered tensor.
    """
    n, cols = x.shape
    g = _gather_bytes(x.reshape(n, outer, cols // outer), axis_name, 0, False)  # [world, N, outer, run']
    return g.transpose(1, 2, 0, 3).reshape(n, -1)


def all_gather(t: NVFP4Tensor, axis_name: str | tuple[str, ...], *, axis: int = 0, tiled: bool = True) -> NVFP4Tensor:
    """All-gather a quantized tensor over mesh axis ``axis_name`` (inside ``shard_map``).

    The result equals quantizing the gathered high-precision tensor with the
    shared amax, byte for byte, but the collective moves the packed codes and
    scales (0.5625 bytes a value for one copy) instead of 2-4 bytes.

    Args:
      t: the local shard, quantized with an amax shared across ``axis_name``
        (e.g. ``quantize(x, amax=lax.pmax(amax(x), axis_name))``). If the
        shards' amaxes differ, the result's amax is NaN, so dequantizing it
        gives NaN rather than wrongly scaled values. Row-scaled: the per-row
        amaxes are gathered with their rows; gathering the last axis needs
        each row's amax shared (``quantize(x, row_scaled=True,
        amax=lax.pmax(amax(x, row_scaled=True), axis_name))``), and the
        columnwise copy's per-column amaxes, gathered along the rows, are
        each shard's own (NaN where they differ).
      axis_name: the mesh axis (or tuple of axes) to gather over.
      axis: the logical axis of ``t.shape`` to gather along, as in
        ``lax.all_gather``. A leading axis: the rowwise copy is gathered along
        it and the columnwise copy [N, M/2] along its (shard-interleaved) M
        axis, with the shards moved into place. The last axis (``tiled``
        only): the rowwise copy along its packed axis, the columnwise copy
        along its rows.
      tiled: concatenate along ``axis`` (True) or stack shards on a new axis
        inserted at ``axis``.

    Raises:
      ValueError: if a shard would split a 16-value block of the result: the
        local extent being gathered (times the axes after it, for a leading
        axis of the columnwise or 2D copy) must be a multiple of 16.
    """
    check_tensor("all_gather's t", t)
    tiled = check_flag("tiled", tiled)
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"axis must be an int, got {axis!r}")
    ndim, axis = len(t.shape), int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of shape {t.shape}")
    axis %= ndim
    world = lax.axis_size(axis_name)
    if axis == ndim - 1:
        if not tiled:
            raise ValueError("gathering the last (blocked) axis needs tiled=True")
        if t.cols % BLOCK:
            raise ValueError(f"each shard's last axis ({t.cols} values) must be a multiple of {BLOCK} to gather it")
        shape = (*t.shape[:-1], t.cols * world)

        def rowwise(a):  # along the packed axis
            return _gather_bytes(a, axis_name, ndim - 1, True)

        def columnwise(a):  # along the rows of [N, M/2]
            return _gather_bytes(a, axis_name, 0, True)

    else:
        lead = t.shape[:-1]
        outer, run = math.prod(lead[:axis]), math.prod(lead[axis:])
        # Rows are blocked along M in the columnwise copy, and in groups of 16 in 2D blocks.
        if (t.data_t is not None or t.spec.block_shape[0] > 1) and run % BLOCK:
            raise ValueError(
                f"each shard holds runs of {run} consecutive rows along the gathered axis {axis} of {t.shape}; "
                f"the columnwise (or 2D-block) copy needs them to be a multiple of {BLOCK}"
            )
        shape = list(t.shape)
        if tiled:
            shape[axis] *= world
        else:
            shape.insert(axis, world)

        def rowwise(a):
            return _gather_bytes(a, axis_name, axis, tiled)

        def columnwise(a):
            return _gather_columns(a, axis_name, outer)

    def each(gather, a):
        return None if a is None else gather(a)

    amax, amax_t = _agreed_amax(t.amax, axis_name), each(lambda a: _agreed_amax(a, axis_name), t.amax_t)
    if t.spec.global_scale.per_row:
        # Per-row amaxes travel with their rows; those along the gathered axis must agree (as one amax does).
        if axis == ndim - 1:
            amax_t = each(lambda a: lax.all_gather(a, axis_name, axis=0, tiled=True), t.amax_t)
        else:
            amax = lax.all_gather(t.amax, axis_name, axis=axis, tiled=tiled)
    return dataclasses.replace(
        t,
        data=each(rowwise, t.data),
        scale=each(rowwise, t.scale),
        amax=amax,
        data_t=each(columnwise, t.data_t),
        scale_t=each(columnwise, t.scale_t),
        amax_t=amax_t,
        shape=tuple(shape),
    )
