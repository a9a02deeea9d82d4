"""Sharding helpers shared by the ops' partition rules.

Every op works on [B, rows, cols] with blocks of 16 along rows and/or cols. A
dimension may stay sharded only where each local shard is whole blocks, so the
local kernel makes exactly the bytes of the unsharded one; otherwise the
partition asks for it replicated (XLA then gathers it first).

In the Shardy rules a dimension of size 16k is the compound factor
(k_blocks, 16): its packed form (2 codes a byte) is (k_blocks, 8) and its
block scales are k_blocks, so propagation carries one sharding through the
values, codes and scales of a tensor.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
from jax import lax

from jax_nvfp4.core.formats import BLOCK


def mesh_size(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def fits(mesh, size: int, axes: tuple[str, ...], block: int = 1) -> tuple[str, ...]:
    """``axes`` if they split ``size`` into equal shards of whole blocks, else ()."""
    return axes if size % (mesh_size(mesh, axes) * block) == 0 else ()


def without(axes: tuple[str, ...], used) -> tuple[str, ...]:
    return tuple(a for a in axes if a not in used)


class Factors:
    """Builds the factor names of a Shardy rule for blocked dimensions."""

    def __init__(self, axis_sizes: tuple[int, ...]):
        self.axis_sizes = axis_sizes
        self.sizes: dict[str, int] = {}
        self.replicated: list[str] = []

    def dim(self, name: str, size: int, *, blocked: bool) -> tuple[str, str, str]:
        """(values, packed codes, block scales) factor strings of dimension ``name``."""
        if size % BLOCK == 0 and all((size // BLOCK) % a == 0 for a in self.axis_sizes):
            # Whole blocks on each mesh axis, so propagation need not split an axis
            # into sub-axes, which custom_partitioning cannot express as a PartitionSpec.
            self.sizes.update({f"{name}b": size // BLOCK, f"{name}16": BLOCK, f"{name}8": BLOCK // 2})
            return f"({name}b {name}16)", f"({name}b {name}8)", f"{name}b"
        if blocked and size % BLOCK:  # a ragged last block: keep the dimension whole
            self.replicated += [name, f"{name}p", f"{name}s"]
        # Otherwise values, codes and scales are not linked: the partition function
        # keeps what it can and XLA reshards the rest.
        return name, f"{name}p", f"{name}s"

    def rule(self, rule: str, **special) -> tuple[str, dict]:
        """``rule`` with its keyword arguments (for the factors it uses)."""
        order = rule.replace("(", " ").replace(")", " ").replace(",", " ").replace("->", " ").split()
        used = set(order)
        whole = set(re.sub(r"\([^)]*\)", " ", rule).replace(",", " ").split())  # factors that are a whole dim
        # In the order the factors first appear in the rule: Shardy numbers them so and wants the list sorted
        # (a dequantize of ragged columns on a mesh listed its values' factor before the codes' and failed).
        replicated = tuple(sorted((f for f in set(self.replicated) if f in used), key=order.index))
        if replicated:
            special["need_replication_factors"] = replicated
        # Shardy wants the size of a factor only where no dimension is that factor alone.
        return rule, {**special, **{f: n for f, n in self.sizes.items() if f in used and f not in whole}}


def pmax_bits(amax, axes: tuple[str, ...]):
    """max over mesh ``axes`` of non-negative float32 (NaN > inf > finite), exactly."""
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    return lax.bitcast_convert_type(lax.pmax(bits, axes), jnp.float32)


def row_factors(nrows: int) -> list[str]:
    return [f"r{i}" for i in range(nrows)]


def placed_seed(mesh, seed, dims: tuple[tuple[str, ...], ...], shape: tuple[int, ...]):
    """The seed operand of a shard of x [B, *R, N] split as ``dims``: the key ``seed`` uint32 [2], the shard's
    first batch entry and column, then the index of each of its rows among the whole tensor's prod(R), row-major
    (``reference.stochastic.Place``)."""

    def first(d: tuple[str, ...], size: int):
        if not d:
            return jnp.uint32(0)
        return lax.axis_index(d).astype(jnp.uint32) * jnp.uint32(size // mesh_size(mesh, d))

    rows = jnp.zeros((), jnp.uint32)
    for d, size in zip(dims[1:-1], shape[1:-1], strict=True):
        local = jnp.arange(size // mesh_size(mesh, d), dtype=jnp.uint32) + first(d, size)
        rows = rows[..., None] * jnp.uint32(size) + local
    place = jnp.stack([first(dims[0], shape[0]), first(dims[-1], shape[-1])])
    return jnp.concatenate([seed.astype(jnp.uint32), place, rows.ravel()])
