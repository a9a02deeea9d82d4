"""Public quantize / dequantize / amax, built once over a backend.

A backend (the FFI kernels or the pure-JAX reference) implements three core
ops on canonical [B, M, N] arrays with a float32 amax per batch entry [B].
This module owns input validation and the reshapes between a user's [..., N]
array and that canonical form, so both backends share one public contract.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import _bits
from jax_nvfp4.formats import BLOCK, INPUT_DTYPES, num_blocks, packed_size
from jax_nvfp4.tensor import NVFP4Tensor


@dataclasses.dataclass(frozen=True)
class Backend:
    amax: Callable  # (x [B, *R, N], mesh_axes, rht) -> (float32 [B],) or with rht (amax, amax of the RHT)
    # (x [B, *R, N], amax [B], amax_t [B], seed uint32 [2], *, rowwise, columnwise, block_2d, rht, stochastic)
    quantize: Callable  # -> tuple of arrays
    dequantize: Callable  # (data, scale, amax[B], *, cols, dtype) -> [B, M, cols]


def _check_input(x) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"NVFP4 quantization needs rank >= 2 (leading axes are rows), got shape {x.shape}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"NVFP4 quantization takes bfloat16, float16 or float32, got {x.dtype}")
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array of shape {x.shape}")
    return x


def _check_out_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"dequantize produces bfloat16, float16 or float32, not {dtype}")
    return dtype


def _check_mesh_axes(mesh_axes) -> tuple[str, ...] | None:
    if mesh_axes is None:
        return None
    if isinstance(mesh_axes, str):
        mesh_axes = (mesh_axes,)
    mesh_axes = tuple(mesh_axes)
    if not all(isinstance(a, str) for a in mesh_axes):
        raise TypeError(f"mesh axes must be mesh axis names (str), got {mesh_axes!r}")
    return mesh_axes


def flat_rows(x: jax.Array) -> jax.Array:
    """[B, *R, N] -> [B, prod(R), N]: the kernels' view of rows of several axes."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def row_axes(lead: tuple[int, ...], blocked_rows: bool) -> tuple[int, ...]:
    """The row axes to keep apart (each keeps its sharding under jit): ``lead``
    where the blocks allow it (rows unblocked, or the last axis whole blocks),
    else one flat axis."""
    if len(lead) > 1 and (not blocked_rows or lead[-1] % BLOCK == 0):
        return tuple(lead)
    return (math.prod(lead),)


def on_rows(quantize3: Callable) -> Callable:
    """A [B, M, N] quantize as one on [B, *R, N]: the rows of several axes are flattened.

    Rowwise results keep R; columnwise ones are [B, N, *R[:-1], packed M]. Where
    M is whole blocks of 16 these are the flat results' bytes, reshaped.
    """

    def quantize(x, *scalars, rowwise, columnwise, **params):
        b, *rows, n = x.shape
        outs = quantize3(flat_rows(x), *scalars, rowwise=rowwise, columnwise=columnwise, **params)
        shapes = [(b, *rows, -1)] * 2 * rowwise + [(b, n, *rows[:-1], -1)] * 2 * columnwise
        return tuple(o.reshape(s) for o, s in zip(outs, shapes, strict=True))

    return quantize


def _as_rows(x: jax.Array, blocked_rows: bool) -> jax.Array:
    """[1, *rows, N] with the row axes of ``row_axes``."""
    return x.reshape(1, *row_axes(x.shape[:-1], blocked_rows), x.shape[-1])


def amax_fn(backend: Backend) -> Callable:
    def amax(x: jax.Array, *, mesh_axes: Sequence[str] | None = None) -> jax.Array:
        """max |x| over the whole tensor as float32; NaN anywhere gives NaN.

        Under ``jit`` with a sharded ``x``, the local maxima are reduced over
        the mesh axes ``x`` is sharded on, so the amax (and a quantization
        using it) is that of the unsharded tensor. ``mesh_axes`` narrows the
        reduction to those mesh axes (e.g. the ones the tensor will be
        all-gathered over, as TransformerEngine scopes FSDP and sequence
        parallel amaxes): along the other axes each shard keeps its own amax,
        which local quantization and dequantization use consistently, while
        the global view of the result shows one shard's value. The pure-JAX
        reference ignores ``mesh_axes`` (always the global amax).
        """
        return backend.amax(_as_rows(_check_input(x), blocked_rows=False), _check_mesh_axes(mesh_axes))[0][0]

    return amax


def seed_words(key) -> jax.Array:
    """The two uint32 words a JAX PRNG key (typed or raw uint32 [2]) gives the kernels' generator."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and (key.dtype != jnp.uint32 or key.shape != (2,)):
        raise TypeError(f"stochastic_rounding_key must be a JAX PRNG key (jax.random.key), got {key.dtype}{key.shape}")
    if key.shape != () and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise ValueError(f"stochastic_rounding_key must be one key, got shape {key.shape}")
    return jax.random.bits(key, (2,), jnp.uint32)


def amax_times(amax: jax.Array, factor: float) -> jax.Array:
    """fp32(amax * factor), exact IEEE on every backend (subnormals kept)."""
    bits = _bits.mul(_bits.to_bits(amax), np.float32(factor).view(np.uint32))
    return _bits.from_bits(bits)


def _check_rht(rht: bool, estimate, columnwise: bool, block_2d: bool, rows: int) -> None:
    if estimate is not None:
        if not rht:
            raise ValueError("rht_amax_estimate applies only with rht=True")
        if not (isinstance(estimate, int | float) and math.isfinite(estimate) and estimate > 0):
            raise ValueError(f"rht_amax_estimate must be a positive finite factor, got {estimate!r}")
    if not rht:
        return
    if not columnwise or block_2d:
        raise ValueError("rht applies to the columnwise copy in 1x16 blocks: pass columnwise=True, block_2d=False")
    if rows % BLOCK:
        raise ValueError(
            f"rht transforms chunks of {BLOCK} rows: the rows (product of the leading axes, {rows}) "
            f"must be a multiple of {BLOCK}"
        )


def quantize_fn(backend: Backend) -> Callable:
    def quantize(
        x: jax.Array,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        block_2d: bool = False,
        amax: jax.Array | float | None = None,
        amax_mesh_axes: Sequence[str] | None = None,
        rht: bool = False,
        rht_amax_estimate: float | None = None,
        stochastic_rounding_key: jax.Array | None = None,
    ) -> NVFP4Tensor:
        """Quantize ``x`` [..., N] (rank >= 2) to NVFP4.

        Args:
          x: bfloat16, float16 or float32; leading axes are flattened into M rows.
          rowwise: produce ``data``/``scale`` (blocks along the last axis).
          columnwise: produce ``data_t``/``scale_t``, the quantization of the
            [N, M] transpose (blocks along the rows), stored transposed.
          block_2d: 16x16 blocks (for weights) instead of 1x16.
          amax: a global amax computed elsewhere (e.g. reduced across a mesh),
            a float32 scalar; by default ``max|x|``.
          amax_mesh_axes: where ``amax`` is None, the mesh axes the amax is
            reduced over when ``x`` is sharded (None: all the axes ``x`` is
            sharded on); see ``amax``.
          rht: the columnwise copy is the quantization of the 16-point Random
            Hadamard Transform of x^T (each chunk of 16 rows of a column,
            see ``formats.RHT_SIGNS``), scaled by the amax of the transformed
            values (``amax_t``), which a fused pass computes with max|x|. The
            transform is orthogonal, so a GEMM of two such copies contracting
            over M (the weight gradient) is unchanged by it. Needs
            ``columnwise=True``, 1x16 blocks and M a multiple of 16.
          rht_amax_estimate: with ``rht``, skip the pass over the transform:
            ``amax_t`` = fp32(amax * factor). The transform of a chunk is at
            most 4x its max; a factor that undershoots saturates the largest
            values to +-6 (and their block scale to 448).
          stochastic_rounding_key: a JAX PRNG key: round the E2M1 codes of
            every copy stochastically (unbiased), drawing from a counter-based
            generator so that the CPU and CUDA kernels give the same bytes for
            a key. Block scales stay round-to-nearest. Under ``jit`` on a mesh
            each shard draws from its own key (the shard index folded in).

        Dimensions that are not multiples of 16 are zero-padded to the block,
        as the reference does; every element is kept (an odd N gives
        ceil(N/2) bytes whose last high nibble is 0).
        """
        x = _check_input(x)
        if not (rowwise or columnwise):
            raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
        lead, n, m = x.shape[:-1], x.shape[-1], math.prod(x.shape[:-1])
        _check_rht(rht, rht_amax_estimate, columnwise, block_2d, m)
        xr = _as_rows(x, blocked_rows=columnwise or block_2d)
        mesh_axes = _check_mesh_axes(amax_mesh_axes)
        fused = rht and rht_amax_estimate is None  # the transform's amax comes from a pass over x
        if amax is None:
            amaxes = backend.amax(xr, mesh_axes, fused)
            global_amax = amaxes[0]
        else:
            if mesh_axes is not None:
                raise ValueError("amax_mesh_axes applies only where quantize computes the amax (amax=None)")
            global_amax = jnp.asarray(amax, jnp.float32)
            if global_amax.shape != ():
                raise ValueError(f"amax must be a scalar, got shape {global_amax.shape}")
            global_amax = global_amax.reshape(1)
            amaxes = backend.amax(xr, None, True) if fused else (global_amax,)
        if fused:
            amax_t = amaxes[1]
        elif rht:
            amax_t = amax_times(global_amax, rht_amax_estimate)
        else:
            amax_t = global_amax
        stochastic = stochastic_rounding_key is not None
        seed = seed_words(stochastic_rounding_key) if stochastic else jnp.zeros(2, jnp.uint32)
        outs = list(
            backend.quantize(
                xr,
                global_amax,
                amax_t,
                seed,
                rowwise=rowwise,
                columnwise=columnwise,
                block_2d=block_2d,
                rht=rht,
                stochastic=stochastic,
            )
        )
        data = scale = data_t = scale_t = None
        if rowwise:
            data = outs.pop(0).reshape(*lead, packed_size(n))
            scale = outs.pop(0).reshape(*lead, num_blocks(n))
        if columnwise:
            data_t = outs.pop(0).reshape(n, packed_size(m))
            scale_t = outs.pop(0).reshape(n, num_blocks(m))
        return NVFP4Tensor(
            data=data,
            scale=scale,
            amax=global_amax[0],
            data_t=data_t,
            scale_t=scale_t,
            amax_t=amax_t[0] if columnwise else None,
            shape=tuple(x.shape),
            dtype=x.dtype,
            block_2d=block_2d,
            rht=rht,
        )

    return quantize


def dequantize_fn(backend: Backend) -> Callable:
    def dequantize(t: NVFP4Tensor, dtype=jnp.float32, columnwise: bool = False) -> jax.Array:
        """Dequantize to ``dtype``: value = fp32(E2M1 * scale) * (amax / 2688).

        amax / (6 * 448) is the global decode scale the reference GEMM applies;
        an infinite amax gives no finite value back. ``columnwise=True`` dequantizes the
        columnwise copy and transposes it back, so both give ``t.shape``.
        A NaN scale (NaN input) gives NaN for its whole block.
        """
        dtype = _check_out_dtype(dtype)
        m, n = t.rows, t.cols
        if columnwise:
            if t.data_t is None:
                raise ValueError("this NVFP4Tensor has no columnwise copy (quantize with columnwise=True)")
            if t.rht:
                raise ValueError(
                    "this columnwise copy holds the Random Hadamard Transform of x^T (rht=True), not x^T: it is "
                    "meant for GEMMs with another transformed copy; dequantize the rowwise copy instead"
                )
            out = backend.dequantize(t.data_t[None], t.scale_t[None], t.amax_t.reshape(1), cols=m, dtype=dtype)
            return out[0].T.reshape(t.shape)
        if t.data is None:
            raise ValueError("this NVFP4Tensor has no rowwise copy (quantize with rowwise=True)")
        out = backend.dequantize(
            t.data.reshape(1, m, -1), t.scale.reshape(1, m, -1), t.amax.reshape(1), cols=n, dtype=dtype
        )
        return out.reshape(t.shape)

    return dequantize
