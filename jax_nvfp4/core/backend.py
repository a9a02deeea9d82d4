"""The contract between the public functions and what runs them: the kernel ops or the pure-JAX reference.

A backend implements three core ops on B independent problems x [B, *R, N]
(R: one or more row axes, M = prod(R) rows); per-row amaxes are [B, *R] (of x's
rows) and [B, N] (of x^T's rows) throughout. The kernels, and the reference's
core, see the rows as one axis ([B, M, N], amax [B, M]): ``amax_on_rows`` and
``quantize_on_rows`` are the one place that reshapes between the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Backend:
    """The three core ops of a backend.

    amax(x, *, amax_mesh_axes, rht_amax, per_row) -> tuple of float32 arrays:
        ``(amax [B],)``; with ``rht_amax`` ``(amax [B], amax_t [B])``, amax_t
        that of the Random Hadamard Transform of x^T; ``per_row``: ``(amax
        [B, *R], amax_t [B, N])``, of each row of x and of each row of x^T (of
        its transform with ``rht_amax``). On a mesh: reduced over ``amax_mesh_axes``.
    quantize(x, amax, amax_t, seed uint32 [2], *, spec) -> tuple of arrays:
        ``(data, scale)`` [B, *R, ...] if ``spec.rowwise``, then ``(data_t,
        scale_t)`` [B, N, *R[:-1], ...] if ``spec.columnwise``; amax / amax_t
        shaped as ``amax`` returns them.
    dequantize(data, scale, amax [B] or [B, M], *, cols, dtype, **decode) -> [B, M, cols], E of
        the global decode scale in ``decode`` (see ``ops.dequantize``)
    """

    amax: Callable
    quantize: Callable
    dequantize: Callable


def flat_rows(x: jax.Array) -> jax.Array:
    """[B, *R, N] -> [B, prod(R), N]: the kernels' view of rows of several axes."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def amax_on_rows(amax3: Callable) -> Callable:
    """An amax on [B, M, N] as one on [B, *R, N]: per-row results come back as [B, *R]."""

    def amax(x, **params):
        outs = tuple(amax3(flat_rows(x), **params))
        if params["per_row"]:
            return outs[0].reshape(x.shape[:-1]), outs[1]
        return outs

    return amax


def quantize_on_rows(quantize3: Callable) -> Callable:
    """A quantize on [B, M, N] as one on [B, *R, N] (a per-row amax [B, *R]).

    Rowwise results keep R; columnwise ones are [B, N, *R[:-1], packed M]. Where
    M is whole blocks of 16 these are the flat results' bytes, reshaped.
    """

    def quantize(x, amax, amax_t, seed, *, spec, **params):
        b, *rows, n = x.shape
        amax = amax.reshape(b, -1) if amax.ndim > 1 else amax
        outs = quantize3(flat_rows(x), amax, amax_t, seed, spec=spec, **params)
        shapes = [(b, *rows, -1)] * 2 * spec.rowwise + [(b, n, *rows[:-1], -1)] * 2 * spec.columnwise
        return tuple(o.reshape(s) for o, s in zip(outs, shapes, strict=True))

    return quantize
