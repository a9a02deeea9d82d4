"""Public quantize / dequantize / amax, built once over a backend.

A backend (the FFI kernels or the pure-JAX reference) implements three core
ops on canonical [B, M, N] arrays with float32 amaxes per batch entry [B] (per
row [B, M] when row-scaled). This module owns input validation and the
reshapes between a user's [..., N] array and that canonical form, so both
backends share one public contract.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import _bits
from jax_nvfp4._options import (
    check_flag,
    check_mesh_axes,
    check_options,
    check_out_dtype,
    check_positive_factor,
    check_real,
    check_tensor,
)
from jax_nvfp4.formats import BLOCK, INPUT_DTYPES, num_blocks, packed_size
from jax_nvfp4.tensor import NVFP4Tensor


@dataclasses.dataclass(frozen=True)
class Backend:
    """The three core ops of a backend, on B independent problems (x [B, *R, N], M = prod(R) rows).

    amax(x, mesh_axes, rht, row_scaled=False) -> tuple of float32 arrays:
        ``(amax [B],)``, with ``rht`` ``(amax [B], amax_t [B])``, amax_t that of
        the Random Hadamard Transform of x^T; ``row_scaled``: ``(amax [B, M],
        amax_t [B, N])``, the amax of each row of x and of each row of x^T (of
        its transform with ``rht``).
    quantize(x, amax, amax_t, seed uint32 [2], *, rowwise, columnwise, block_2d,
             rht, stochastic, row_scaled=False, four_over_six=None,
             four_over_six_fast_math=False, e4m3_max=448) -> tuple of arrays:
        ``(data, scale)`` if rowwise, then ``(data_t, scale_t)`` if columnwise;
        amax / amax_t shaped as ``amax`` returns them.
    dequantize(data, scale, amax [B] or [B, M], *, cols, dtype, e4m3_max=448) -> [B, M, cols]
    """

    amax: Callable
    quantize: Callable
    dequantize: Callable


def _check_input(x) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"NVFP4 quantization needs rank >= 2 (leading axes are rows), got shape {x.shape}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"NVFP4 quantization takes bfloat16, float16 or float32, got {x.dtype}")
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array of shape {x.shape}")
    return x


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
    def amax(x: jax.Array, *, mesh_axes: Sequence[str] | None = None, row_scaled: bool = False) -> jax.Array:
        """max |x| over the whole tensor as float32; NaN anywhere gives NaN.

        ``row_scaled=True``: the amax of each row instead (max |x| over the
        last axis), float32 ``x.shape[:-1]``, as ``quantize(x, row_scaled=True)``
        computes it for the rowwise copy.

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
        x = _check_input(x)
        xr, mesh_axes = _as_rows(x, blocked_rows=False), check_mesh_axes("mesh_axes", mesh_axes)
        if check_flag("row_scaled", row_scaled):
            return backend.amax(xr, mesh_axes, False, row_scaled=True)[0].reshape(x.shape[:-1])
        return backend.amax(xr, mesh_axes)[0][0]

    return amax


def check_key(key, name: str = "stochastic_rounding_key") -> jax.Array:
    """One JAX PRNG key (typed, or a raw uint32 [2] key), else an error naming the option ``name``."""
    if not isinstance(key, jax.Array | np.ndarray):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key), got {type(key).__name__}")
    key = jnp.asarray(key)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and (key.dtype != jnp.uint32 or key.shape != (2,)):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key), got {key.dtype}{key.shape}")
    if key.shape != () and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name} must be one key, got shape {key.shape}")
    return key


def seed_words(key, name: str = "stochastic_rounding_key") -> jax.Array:
    """The two uint32 words a JAX PRNG key (typed or raw uint32 [2]) gives the kernels' generator."""
    return jax.random.bits(check_key(key, name), (2,), jnp.uint32)


def amax_times(amax: jax.Array, factor: float) -> jax.Array:
    """fp32(amax * factor), exact IEEE on every backend (subnormals kept)."""
    bits = _bits.mul(_bits.to_bits(amax), np.float32(factor).view(np.uint32))
    return _bits.from_bits(bits)


def columnwise_amax(amaxes: Sequence[jax.Array], rht: bool, estimate: float | None) -> jax.Array:
    """The columnwise copy's amax from an amax pass's outputs ``(amax,)`` or ``(amax, amax_t)``.

    The last one: the transform's amax (fused pass), the amax of each row of
    x^T (row-scaled) or the tensor's; times ``estimate`` where the recipe
    estimates the transform's amax instead of measuring it.
    """
    amax_t = amaxes[-1]
    return amax_times(amax_t, estimate) if rht and estimate is not None else amax_t


def _check_rht(rht: bool, estimate, columnwise: bool, block_2d: bool, rows: int) -> None:
    if estimate is not None:
        if not rht:
            raise ValueError("rht_amax_estimate applies only with rht=True")
        check_positive_factor("rht_amax_estimate", estimate)
    if not rht:
        return
    if not columnwise or block_2d:
        raise ValueError("rht applies to the columnwise copy in 1x16 blocks: pass columnwise=True, block_2d=False")
    if rows % BLOCK:
        raise ValueError(
            f"rht transforms chunks of {BLOCK} rows: the rows (product of the leading axes, {rows}) "
            f"must be a multiple of {BLOCK}"
        )


def _check_fast_math(four_over_six, fast_math: bool) -> None:
    if fast_math and four_over_six is None:
        raise ValueError("four_over_six_fast_math applies only with 4over6 (four_over_six='mae' or 'mse')")


def _given_amax(amax, shape: tuple[int, ...], mesh_axes, row_scaled: bool) -> jax.Array:
    """A user's amax as float32 of ``shape`` ([] per tensor, the rows' shape when row-scaled)."""
    if mesh_axes is not None:
        raise ValueError("amax_mesh_axes applies only where quantize computes the amax (amax=None)")
    check_real("amax", amax)
    amax = jnp.asarray(amax, jnp.float32)
    if amax.shape != shape:
        if row_scaled:
            raise ValueError(f"row-scaled amax= holds one amax per row, shape x.shape[:-1] = {shape}, got {amax.shape}")
        raise ValueError(f"amax must be a scalar, got shape {amax.shape}")
    return amax


def _tensor_amaxes(backend: Backend, xr, amax, mesh_axes, rht: bool, estimate) -> tuple[jax.Array, jax.Array]:
    """One amax per tensor: (amax [1], amax_t [1]) of the rows view ``xr`` [1, *R, N]."""
    fused = rht and estimate is None  # the transform's amax comes from a pass over x
    if amax is None:
        amaxes = backend.amax(xr, mesh_axes, fused)
        amax = amaxes[0]
    else:
        amax = _given_amax(amax, (), mesh_axes, False).reshape(1)
        amaxes = backend.amax(xr, None, True) if fused else (amax,)
    return amax, columnwise_amax(amaxes, rht, estimate)


def _row_amaxes(backend: Backend, xr, amax, mesh_axes, lead, columnwise: bool, rht: bool, estimate):
    """Row-scaled: (amax [1, M], amax_t [1, N]): per row of x (``lead``), and per row of x^T (of its transform
    with ``rht``)."""
    n = xr.shape[-1]
    if amax is not None:
        if columnwise:
            raise ValueError(
                "row-scaled amax= holds the rows' amaxes, and the columnwise copy needs one per column: "
                "pass amax=None (quantize computes both) or columnwise=False"
            )
        amax = _given_amax(amax, lead, mesh_axes, True)
        return amax.reshape(1, -1), jnp.zeros((1, n), jnp.float32)  # amax_t: no columnwise copy reads it
    amaxes = backend.amax(xr, mesh_axes, rht and estimate is None, row_scaled=True)
    return amaxes[0], columnwise_amax(amaxes, rht, estimate)


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
        row_scaled: bool = False,
        four_over_six: str | None = None,
        four_over_six_fast_math: bool = False,
        e4m3_max: int = 448,
    ) -> NVFP4Tensor:
        """Quantize ``x`` [..., N] (rank >= 2) to NVFP4.

        Args:
          x: bfloat16, float16 or float32; leading axes are flattened into M rows.
          rowwise: produce ``data``/``scale`` (blocks along the last axis).
          columnwise: produce ``data_t``/``scale_t``, the quantization of the
            [N, M] transpose (blocks along the rows), stored transposed.
          block_2d: 16x16 blocks (for weights) instead of 1x16.
          amax: a global amax computed elsewhere (e.g. reduced across a mesh),
            a float32 scalar; by default ``max|x|``. Row-scaled: the amax of
            each row, float32 ``x.shape[:-1]`` (rowwise copy only).
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
          row_scaled: per-token NVFP4: each row of x gets its own global amax
            (``t.amax`` of shape ``x.shape[:-1]``) and each row of x^T, i.e.
            each column of x, its own for the columnwise copy (``t.amax_t``
            [N]; of the transform with ``rht``, or each column's amax times
            ``rht_amax_estimate``). 1x16 blocks only.
          four_over_six: "mae" or "mse": 4over6 adaptive block scaling. Each
            block is quantized with its max on E2M1 6 and, with a 1.5x larger
            scale, on 4; the candidate with the smaller absolute / squared
            error is kept. Round-to-nearest only (no stochastic rounding).
          four_over_six_fast_math: 4over6 measures the errors in the scaled
            domain (the CUDA kernel's fast path) instead of on the dequantized
            values; a few near ties pick the other candidate.
          e4m3_max: 448, or 256 with 4over6: the global scale aims the block
            scales at E4M3 values up to E (6 E / amax), leaving map-4's 1.5x
            headroom below 448; the tensor records it and decodes with amax / (6 E).

        Dimensions that are not multiples of 16 are zero-padded to the block,
        as the reference does; every element is kept (an odd N gives
        ceil(N/2) bytes whose last high nibble is 0).
        """
        x = _check_input(x)
        rowwise = check_flag("rowwise", rowwise)
        columnwise = check_flag("columnwise", columnwise)
        block_2d = check_flag("block_2d", block_2d)
        rht = check_flag("rht", rht)
        row_scaled = check_flag("row_scaled", row_scaled)
        four_over_six_fast_math = check_flag("four_over_six_fast_math", four_over_six_fast_math)
        if not (rowwise or columnwise):
            raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
        stochastic = stochastic_rounding_key is not None
        e4m3_max = check_options(
            block_2d=block_2d,
            stochastic=stochastic,
            row_scaled=row_scaled,
            four_over_six=four_over_six,
            e4m3_max=e4m3_max,
        )
        _check_fast_math(four_over_six, four_over_six_fast_math)
        lead, n, m = x.shape[:-1], x.shape[-1], math.prod(x.shape[:-1])
        _check_rht(rht, rht_amax_estimate, columnwise, block_2d, m)
        xr = _as_rows(x, blocked_rows=columnwise or block_2d)
        mesh_axes = check_mesh_axes("amax_mesh_axes", amax_mesh_axes)
        if row_scaled:
            amax_v, amax_t = _row_amaxes(backend, xr, amax, mesh_axes, lead, columnwise, rht, rht_amax_estimate)
        else:
            amax_v, amax_t = _tensor_amaxes(backend, xr, amax, mesh_axes, rht, rht_amax_estimate)
        seed = seed_words(stochastic_rounding_key) if stochastic else jnp.zeros(2, jnp.uint32)
        outs = list(
            backend.quantize(
                xr,
                amax_v,
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
                e4m3_max=e4m3_max,
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
            amax=amax_v.reshape(lead) if row_scaled else amax_v[0],
            data_t=data_t,
            scale_t=scale_t,
            amax_t=(amax_t.reshape(n) if row_scaled else amax_t[0]) if columnwise else None,
            shape=tuple(x.shape),
            dtype=x.dtype,
            block_2d=block_2d,
            rht=rht,
            row_scaled=row_scaled,
            e4m3_max=e4m3_max,
        )

    return quantize


def dequantize_fn(backend: Backend) -> Callable:
    def dequantize(t: NVFP4Tensor, dtype=jnp.float32, columnwise: bool = False) -> jax.Array:
        """Dequantize to ``dtype``: value = fp32(E2M1 * scale) * (amax / (6 E)).

        E = ``t.e4m3_max`` (448: amax / 2688); ``amax`` is the tensor's, or
        each row's for a row-scaled tensor. amax / (6 E) is the global decode
        scale the reference GEMM applies; an infinite amax gives no finite
        value back. ``columnwise=True`` dequantizes the columnwise copy
        (with ``amax_t``) and transposes it back, so both give ``t.shape``.
        A NaN scale (NaN input) gives NaN for its whole block.
        """
        check_tensor("dequantize's t", t)
        dtype, columnwise = check_out_dtype(dtype), check_flag("columnwise", columnwise)
        m, n = t.rows, t.cols
        options = {"e4m3_max": t.e4m3_max}
        if columnwise:
            if t.data_t is None:
                raise ValueError("this NVFP4Tensor has no columnwise copy (quantize with columnwise=True)")
            if t.rht:
                raise ValueError(
                    "this columnwise copy holds the Random Hadamard Transform of x^T (rht=True), not x^T: it is "
                    "meant for GEMMs with another transformed copy; dequantize the rowwise copy instead"
                )
            amax_t = t.amax_t.reshape(1, n) if t.row_scaled else t.amax_t.reshape(1)
            out = backend.dequantize(t.data_t[None], t.scale_t[None], amax_t, cols=m, dtype=dtype, **options)
            return out[0].T.reshape(t.shape)
        if t.data is None:
            raise ValueError("this NVFP4Tensor has no rowwise copy (quantize with rowwise=True)")
        amax = t.amax.reshape(1, m) if t.row_scaled else t.amax.reshape(1)
        out = backend.dequantize(
            t.data.reshape(1, m, -1), t.scale.reshape(1, m, -1), amax, cols=n, dtype=dtype, **options
        )
        return out.reshape(t.shape)

    return dequantize
