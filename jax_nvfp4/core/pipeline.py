"""Public quantize / dequantize / amax, built once over a backend, and the one quantize pipeline.

``quantize_batch`` is the pipeline every quantization takes, the public
``quantize`` and ``dot_general``'s operands alike: the amax pass (or a given
amax), the transform's amax estimate, the random seed, the quantize op, the
tensor. This module also owns the input checks and the reshapes between a
user's [..., N] array and the backends' [B, *R, N] form, so the kernels and
the reference share one public contract.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from jax_nvfp4.core.backend import Backend
from jax_nvfp4.core.checks import (
    check_amax_values,
    check_flag,
    check_mesh_axes,
    check_out_dtype,
    check_real,
    mesh_axis_names,
    unknown_mesh_axes,
)
from jax_nvfp4.core.formats import BLOCK, INPUT_DTYPES
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.core.tensor import NVFP4Tensor, check_tensor
from jax_nvfp4.sharding.explicit import explicit_sharding, fit, merged, spec_of, unmerged


def _check_input(x) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"NVFP4 quantization needs rank >= 2 (leading axes are rows), got shape {x.shape}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"NVFP4 quantization takes bfloat16, float16 or float32, got {x.dtype}")
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array of shape {x.shape}")
    return x


def row_axes(lead: tuple[int, ...], blocked_rows: bool) -> tuple[int, ...]:
    """The row axes to keep apart (each keeps its sharding under jit): ``lead``
    where the blocks allow it (rows unblocked, or the last axis whole blocks),
    else one flat axis."""
    if len(lead) > 1 and (not blocked_rows or lead[-1] % BLOCK == 0):
        return tuple(lead)
    return (math.prod(lead),)


def _as_rows(x: jax.Array, blocked_rows: bool) -> jax.Array:
    """[1, *rows, N] with the row axes of ``row_axes``."""
    return x.reshape(1, *row_axes(x.shape[:-1], blocked_rows), x.shape[-1])


def max_entry(amax: jax.Array) -> jax.Array:
    """The max of per-entry amaxes, as int32 bits: exact for non-negative floats, NaN included."""
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    return lax.bitcast_convert_type(jnp.max(bits), jnp.float32)


def _amaxes(backend: Backend, x: jax.Array, spec: QuantizeSpec, amax) -> tuple[jax.Array, jax.Array]:
    """(amax, amax_t) of x [B, *R, N]: one for the whole tensor (all B entries), [B] each, or per row, [B, *R]
    and [B, N]. ``amax``: a given one ([B] or [B, *R]), else from an amax pass reduced over the mesh."""
    b, n = x.shape[0], x.shape[-1]
    if spec.row_scaled and amax is not None:
        return amax, jnp.zeros((b, n), jnp.float32)  # amax_t: no columnwise copy reads it
    if amax is None:
        unknown_mesh_axes("amax_mesh_axes", spec.amax_mesh_axes, mesh_axis_names(x))
        outs = backend.amax(
            x, amax_mesh_axes=spec.amax_mesh_axes, rht_amax=spec.measures_rht_amax, per_row=spec.row_scaled
        )
    else:
        outs = (amax,)
        if spec.measures_rht_amax:  # the transform's amax still comes from a pass over x
            outs += (backend.amax(x, amax_mesh_axes=None, rht_amax=True, per_row=False)[1],)
    if not spec.row_scaled and b > 1:  # one amax for the whole tensor, each of its B entries quantized with it
        outs = [jnp.broadcast_to(max_entry(a), (b,)) for a in outs]
    # amax_t: the transform's, the columns', or the tensor's (estimating the transform's from it)
    return outs[0], spec.columnwise_amax(outs[-1])


def quantize_batch(backend: Backend, x: jax.Array, spec: QuantizeSpec, *, amax=None, rng_key=None) -> NVFP4Tensor:
    """Quantize B independent tensors x [B, *R, N] as ``spec`` says: a batched NVFP4Tensor.

    The one pipeline of every quantization. ``amax``: given (float32 [B], the
    whole tensor's, or [B, *R] per row), else computed. ``rng_key``: the key
    of stochastic rounding (needed with ``spec.stochastic_rounding``, unused without).
    """
    spec.check_rows(math.prod(x.shape[1:-1]))
    seed = spec.seed(rng_key)
    amax, amax_t = _amaxes(backend, x, spec, amax)
    outs = list(backend.quantize(x, amax, amax_t, seed, spec=spec))
    data, scale = (outs.pop(0), outs.pop(0)) if spec.rowwise else (None, None)
    data_t, scale_t = (outs.pop(0), outs.pop(0)) if spec.columnwise else (None, None)
    return NVFP4Tensor(
        data, scale, amax, data_t, scale_t, amax_t if spec.columnwise else None, x.shape, x.dtype, spec, batched=True
    )


# The shardings of the public results on Explicit axes (see _explicit): each array keeps the mesh axes of the
# dimension of x it runs along, where they split it into whole blocks (else it is typed replicated).


def _rows_spec(x) -> list:
    """The mesh axes of x's leading dimensions, each kept where it splits evenly."""
    return [fit(e, n) for e, n in zip(spec_of(x)[:-1], jnp.shape(x)[:-1], strict=True)]


def _amax_spec(result, x, *, row_scaled: bool = False, **_) -> PartitionSpec:
    return PartitionSpec(*_rows_spec(x)) if row_scaled else PartitionSpec()


def _quantize_spec(t: NVFP4Tensor, x, *_, **__) -> NVFP4Tensor:
    """NVFP4Tensor ``t`` with the sharding of each of its arrays, as ``x`` implies: the rowwise copy [..., N/2] as
    x; the columnwise copy [N, M/2] with x's last axes on N and those of its (merged) leading axes on M."""
    rows, last, n = _rows_spec(x), spec_of(x)[-1], jnp.shape(x)[-1]
    rowwise = PartitionSpec(*rows, fit(last, n, BLOCK))
    columnwise = PartitionSpec(fit(last, n), merged(spec_of(x)[:-1], jnp.shape(x)[:-1], BLOCK))
    per_row = t.spec.row_scaled

    def given(array, spec):
        return None if array is None else spec

    return dataclasses.replace(
        t,
        data=given(t.data, rowwise),
        scale=given(t.scale, rowwise),
        amax=PartitionSpec(*rows) if per_row else PartitionSpec(),
        data_t=given(t.data_t, columnwise),
        scale_t=given(t.scale_t, columnwise),
        amax_t=given(t.amax_t, PartitionSpec(fit(last, n)) if per_row else PartitionSpec()),
    )


def _dequantize_spec(result, t: NVFP4Tensor, dtype=None, columnwise: bool = False) -> PartitionSpec:
    """The values [..., N] sharded as the copy they come from: the rowwise copy's axes, or the columnwise
    copy's N axes on N and its M axes split over the leading axes."""
    if columnwise:
        n, m = spec_of(t.data_t)
        return PartitionSpec(*unmerged(m, t.shape[:-1]), fit(n, t.cols))
    *rows, last = spec_of(t.data)
    return PartitionSpec(*(fit(e, size) for e, size in zip(rows, t.shape[:-1], strict=True)), fit(last, t.cols))


def amax_fn(backend: Backend) -> Callable:
    @explicit_sharding(_amax_spec)
    def amax(x: jax.Array, *, amax_mesh_axes: Sequence[str] | None = None, row_scaled: bool = False) -> jax.Array:
        """``max |x|`` over the whole tensor as float32; NaN anywhere gives NaN.

        ``row_scaled=True``: the amax of each row instead (``max |x|`` over the
        last axis), float32 ``x.shape[:-1]``, as ``quantize(x, row_scaled=True)``
        computes it for the rowwise copy.

        Under ``jit`` with a sharded ``x``, the local maxima are reduced over
        the mesh axes ``x`` is sharded on, so the amax (and a quantization
        using it) is that of the unsharded tensor. ``amax_mesh_axes`` narrows
        the reduction to those mesh axes (e.g. the ones the tensor will be
        all-gathered over, as TransformerEngine scopes FSDP and sequence
        parallel amaxes): along the other axes each shard keeps its own amax,
        which local quantization and dequantization use consistently, while
        the global view of the result shows one shard's value. The pure-JAX
        reference ignores ``amax_mesh_axes`` (always the global amax). An
        axis the mesh lacks (any axis, outside a mesh) raises ValueError
        naming it and the mesh's axes, where the mesh is known (docs/
        quantization.md, "What bad input does"). On Explicit axes the result
        is typed replicated, per-row amaxes as the rows of ``x`` (see
        ``quantize``). Not differentiable (TypeError under ``jax.grad``).
        """
        x = _check_input(x)
        xr, axes = _as_rows(x, blocked_rows=False), check_mesh_axes("amax_mesh_axes", amax_mesh_axes)
        unknown_mesh_axes("amax_mesh_axes", axes, mesh_axis_names(x))
        per_row = check_flag("row_scaled", row_scaled)
        outs = backend.amax(xr, amax_mesh_axes=axes, rht_amax=False, per_row=per_row)
        return outs[0].reshape(x.shape[:-1]) if per_row else outs[0][0]

    return amax


def _given_amax(amax, spec: QuantizeSpec, want: tuple[int, ...], rows: tuple[int, ...]) -> jax.Array:
    """A user's amax as float32: [1] for the tensor, or the rows' amaxes (shape ``want``) as [1, *rows] when
    row-scaled."""
    if spec.amax_mesh_axes is not None:
        raise ValueError("amax_mesh_axes applies only where quantize computes the amax (amax=None)")
    if spec.row_scaled and spec.columnwise:
        raise ValueError(
            "row-scaled amax= holds the rows' amaxes, and the columnwise copy needs one per column: "
            "pass amax=None (quantize computes both) or columnwise=False"
        )
    check_real("amax", amax)
    given, amax = amax, jnp.asarray(amax, jnp.float32)
    if amax.shape != want:
        if spec.row_scaled:
            raise ValueError(f"row-scaled amax= holds one amax per row, shape x.shape[:-1] = {want}, got {amax.shape}")
        raise ValueError(f"amax must be a scalar, got shape {amax.shape}")
    check_amax_values(given)
    return amax.reshape(1, *rows) if spec.row_scaled else amax.reshape(1)


def quantize_fn(backend: Backend) -> Callable:
    @explicit_sharding(_quantize_spec)
    def quantize(
        x: jax.Array,
        spec: QuantizeSpec | None = None,
        *,
        amax: jax.Array | float | None = None,
        rng_key: jax.Array | None = None,
        **options,
    ) -> NVFP4Tensor:
        """Quantize ``x`` [..., N] (rank >= 2) to NVFP4 as ``spec`` says.

        Args:
          x: bfloat16, float16 or float32; leading axes are flattened into M rows.
          spec: a ``QuantizeSpec``; or leave it out and pass its fields as
            keywords (``quantize(x, columnwise=True, rht=True)``), which build
            one. Its docstring describes every option.
          amax: a global amax computed elsewhere (e.g. reduced across a mesh),
            a float32 scalar; by default ``max|x|``. Row-scaled: the amax of
            each row, float32 ``x.shape[:-1]`` (rowwise copy only). A concrete
            one that is negative (-0.0 included) or NaN raises ValueError; a
            traced one cannot be checked (docs/quantization.md, "What bad
            input does").
          rng_key: a JAX PRNG key: round stochastically (sets
            ``stochastic_rounding``; with a ``spec`` that has it, required).

        Returns an ``NVFP4Tensor`` that records ``spec``. Dimensions that are
        not multiples of 16 are zero-padded to the block, as the reference
        does; every element is kept (an odd N gives ceil(N/2) bytes whose last
        high nibble is 0).

        Under ``jax.set_mesh`` with Explicit axes the primitives run with those
        axes Auto (custom partitioning has no sharding-in-types rule) and each
        array of the result is typed with the sharding ``x`` implies: the
        rowwise copy and row amaxes as ``x``'s leading axes (and its last, where
        each shard is whole 16-value blocks), the columnwise copy [N, M/2] with
        ``x``'s last-axis sharding on N and its leading axes' on M (where their
        row-major merge keeps each shard one run of whole blocks); anything
        else replicated. ``dequantize`` and ``amax`` type theirs alike.

        Not differentiable: a tangent reaching it raises TypeError (use
        ``dot_general`` for GEMMs, ``fake_quantize`` for quantization-aware
        training).
        """
        options = ({} if rng_key is None else {"rng_key": rng_key}) | options
        rng_key = options.pop("rng_key", None)
        if spec is None:
            options.setdefault("stochastic_rounding", rng_key is not None)
            spec = QuantizeSpec(**options)
        elif options:
            raise TypeError(f"quantize takes a spec or option keywords, not both: got {sorted(options)}")
        elif not isinstance(spec, QuantizeSpec):
            raise TypeError(f"spec must be a jax_nvfp4.QuantizeSpec, got {type(spec).__name__}")
        if rng_key is not None and not spec.stochastic_rounding:
            raise ValueError("rng_key= is the key of stochastic rounding: the spec has stochastic_rounding=False")
        x = _check_input(x)
        s = spec.tensor_shapes(x.shape)
        xr = _as_rows(x, spec.blocked_rows)
        if amax is not None:
            amax = _given_amax(amax, spec, s.amax, xr.shape[1:-1])
        t = quantize_batch(backend, xr, spec, amax=amax, rng_key=rng_key)
        return NVFP4Tensor(
            data=None if t.data is None else t.data.reshape(s.data),
            scale=None if t.scale is None else t.scale.reshape(s.scale),
            amax=t.amax.reshape(s.amax),
            data_t=None if t.data_t is None else t.data_t.reshape(s.data_t),
            scale_t=None if t.scale_t is None else t.scale_t.reshape(s.scale_t),
            amax_t=None if t.amax_t is None else t.amax_t.reshape(s.amax_t),
            shape=tuple(x.shape),
            dtype=x.dtype,
            spec=spec,
        )

    return quantize


def dequantize_fn(backend: Backend) -> Callable:
    @explicit_sharding(_dequantize_spec)
    def dequantize(t: NVFP4Tensor, dtype: DTypeLike = jnp.float32, columnwise: bool = False) -> jax.Array:
        """Dequantize to ``dtype``: value = fp32(E2M1 * scale) * (amax / (6 E)).

        E = ``t.spec.e4m3_max`` (448: amax / 2688); ``amax`` is the tensor's, or
        each row's for a row-scaled tensor. amax / (6 E) is the global decode
        scale the reference GEMM applies; an infinite amax gives no finite
        value back. ``columnwise=True`` dequantizes the columnwise copy
        (with ``amax_t``) and transposes it back, so both give ``t.shape``.
        A NaN scale (NaN input) gives NaN for its whole block. On Explicit
        axes the result is typed with the sharding of the copy it decodes
        (see ``quantize``).
        """
        check_tensor("dequantize's t", t)
        dtype, columnwise = check_out_dtype(dtype), check_flag("columnwise", columnwise)
        m, n, per_row, decode = t.rows, t.cols, t.spec.row_scaled, {"e4m3_max": t.spec.e4m3_max}
        if columnwise:
            if t.data_t is None:
                raise ValueError("this NVFP4Tensor has no columnwise copy (quantize with columnwise=True)")
            if t.spec.rht:
                raise ValueError(
                    "this columnwise copy holds the Random Hadamard Transform of x^T (rht=True), not x^T: it is "
                    "meant for GEMMs with another transformed copy; dequantize the rowwise copy instead"
                )
            amax_t = t.amax_t.reshape(1, n) if per_row else t.amax_t.reshape(1)
            out = backend.dequantize(t.data_t[None], t.scale_t[None], amax_t, cols=m, dtype=dtype, **decode)
            return out[0].T.reshape(t.shape)
        if t.data is None:
            raise ValueError("this NVFP4Tensor has no rowwise copy (quantize with rowwise=True)")
        amax = t.amax.reshape(1, m) if per_row else t.amax.reshape(1)
        out = backend.dequantize(
            t.data.reshape(1, m, -1), t.scale.reshape(1, m, -1), amax, cols=n, dtype=dtype, **decode
        )
        return out.reshape(t.shape)

    return dequantize
