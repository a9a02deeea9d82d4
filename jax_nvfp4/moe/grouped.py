"""The grouped quantization pipeline of ``ragged_dot``, and the decoded values its grouped GEMMs multiply.

``quantize_grouped`` is to the grouped ops (``ops.grouped``) what ``core.pipeline.quantize_batch`` is to
quantize: the amax pass (one amax for the rowwise copy, one per group for the columnwise one, of the
RHT chunks or estimated from the plain amax), the random seeds, then one grouped quantize that writes
the rowwise copy of all tokens and one grouped columnwise copy of every group's blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_nvfp4.core.spec import GlobalScale, QuantizeSpec
from jax_nvfp4.ops.gemm import block_values
from jax_nvfp4.ops.grouped import grouped_amax, grouped_quantize


@dataclasses.dataclass(frozen=True)
class Scaled:
    """One GEMM operand: exact bf16 block values (no global scale) and its global decode scale's amax."""

    values: jax.Array  # bf16: E2M1 code times E4M3 block scale, exact
    amax: jax.Array  # float32: per tensor, per group, per row or per group and row
    global_scale: GlobalScale


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale", "amax", "data_t", "scale_t", "amax_t"],
    meta_fields=["spec"],
)
@dataclasses.dataclass(frozen=True)
class GroupedCopies:
    """The rowwise copy of x [M, L] (None where not made) and its grouped columnwise copy."""

    data: jax.Array | None  # uint8 [M, L/2]
    scale: jax.Array | None  # e4m3 [M, L/16]
    amax: jax.Array | None  # float32 [] or [M] (row-scaled)
    data_t: jax.Array  # uint8 [L, Mp/2]
    scale_t: jax.Array  # e4m3 [L, P]
    amax_t: jax.Array  # float32 [G] or [G, L] (row-scaled)
    spec: QuantizeSpec

    def rows(self) -> Scaled:
        """The rowwise copy's values [M, L] and scales."""
        values = block_values(self.data[None], self.scale[None], self.length)[0]
        return Scaled(values, self.amax, self.spec.global_scale)

    def columns(self) -> Scaled:
        """The grouped copy's values [L, Mp] and each group's scales ([G] or [G, L])."""
        mp = self.data_t.shape[1] * 2
        values = block_values(self.data_t[None], self.scale_t[None], mp)[0]
        return Scaled(values, self.amax_t, self.spec.global_scale)

    @property
    def length(self) -> int:
        return self.data_t.shape[0]

    def columnwise_only(self) -> GroupedCopies:
        """The backward pass's residual: the grouped copy alone."""
        return dataclasses.replace(self, data=None, scale=None, amax=None)


def _seed(key) -> jax.Array:
    return jax.random.bits(key, (2,), jnp.uint32)


def quantize_grouped(
    x: jax.Array, group_sizes: jax.Array, spec: QuantizeSpec, *, row_key=None, group_keys=None
) -> GroupedCopies:
    """x [M, L] (tokens sorted by group, ``group_sizes`` int32 [G]) quantized as ``spec`` says, grouped.

    ``spec`` must ask for the columnwise copy; with stochastic rounding the rowwise copy
    rounds with ``row_key`` and group g's blocks with ``group_keys[g]`` (the words each key would
    draw for today's per-group copy, ``reference.grouped``).
    """
    spec.check_grouped()
    spec.check_rows(x.shape[0])
    groups = group_sizes.shape[0]
    xb, sizes = x[None], group_sizes.astype(jnp.int32)[None]
    amax, amax_t = grouped_amax(xb, sizes, rht_amax=spec.measures_rht_amax, per_row=spec.global_scale.per_row)
    amax_t = spec.columnwise_amax(amax_t)
    seed, group_seeds = spec.seed(row_key, "row_key"), jnp.zeros((groups, 2), jnp.uint32)
    if spec.draws_random:
        if group_keys is None:
            raise ValueError("stochastic_rounding=True needs group_keys= (one JAX PRNG key a group)")
        group_seeds = jax.vmap(_seed)(group_keys)
    outs = list(grouped_quantize(xb, sizes, amax, amax_t, seed, group_seeds, spec=spec))
    data, scale = (outs.pop(0)[0], outs.pop(0)[0]) if spec.rowwise else (None, None)
    return GroupedCopies(data, scale, amax[0] if spec.rowwise else None, outs[0][0], outs[1][0], amax_t[0], spec)
