"""The pure-JAX reference of the grouped ops (mixture of experts): the executable spec of their kernels.

x [B, M, N] holds M token rows sorted by group (expert); ``group_sizes`` [B, G] how many consecutive
rows each group takes. Group g's rows are [start_g, end_g), end_g = min(sizes_0 + ... + sizes_g, M) (a
negative size counts as 0), start_g = end_(g-1); rows from end_(G-1) on belong to no group and count as
zeros everywhere.

**The grouped columnwise copy.** Token blocks lie on the global grid of 16 rows: block j holds rows
16j..16j+15. Group g owns the blocks it touches, j in [start_g // 16, ceil(end_g / 16)) (none when it
is empty), and its copy of block j holds its own rows there, the other rows zero. That copy is block
j + g of the grouped layout, which has P = ceil(M/16) + G - 1 blocks (Mp = 16 P token rows): a block
that a boundary cuts appears once per group it holds rows of, and no block mixes two groups. Blocks
no group owns (at most G - 1, where boundaries fall on the grid) are zero codes with zero scales.
Group g's blocks are then exactly those of today's per-group copy of ``ragged_dot`` (the whole
tensor with the other groups' rows zero, quantized columnwise), at other positions: the same RHT
chunks (with the rows outside the group zero), the group's own global scale (``amax_t[b, g]``, or one
per feature ``amax_t[b, g, n]`` when row-scaled), and with stochastic rounding the same random bytes,
drawn with group g's seed for block j of row n of entry b of the [B, N, M] copy, stream 1
(``reference.stochastic``).

Group g's segment of the layout is blocks [e_(g-1), e_g), e_g = ceil(end_g / 16) + g for a group
with rows (e_g = start_g // 16 + g for an empty one, e_(-1) = 0): every block it owns and possibly
unowned zero blocks, so a ragged contraction over ``segment_sizes`` contracts each group's tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_nvfp4.core import bits as b
from jax_nvfp4.core.codecs import e2m1_encode
from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.reference import four_over_six as _fos
from jax_nvfp4.reference import kernels as core
from jax_nvfp4.reference.stochastic import Place, block_bytes, e2m1_encode_stochastic, split_seed


def grouped_blocks(rows: int, groups: int) -> int:
    """P: the blocks of 16 token rows of the grouped layout of ``rows`` rows in ``groups`` groups."""
    return -(-rows // BLOCK) + groups - 1


def bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(start, end) int32 [..., G] of each group's rows, cut at ``rows``: a negative size counts as 0, and the
    running sum saturates at ``rows`` (it never wraps around int32)."""
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, rows)
    ends = lax.associative_scan(lambda a, c: jnp.minimum(a + c, rows), sizes, axis=sizes.ndim - 1)
    starts = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)
    return starts, ends


def segment_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 [..., G]: the token rows of each group's segment of the grouped layout (see the module docstring)."""
    starts, ends = bounds(group_sizes, rows)
    groups = jnp.arange(group_sizes.shape[-1], dtype=jnp.int32)
    end_blocks = jnp.where(ends > starts, -(-ends // BLOCK), starts // BLOCK) + groups
    return BLOCK * jnp.diff(end_blocks, prepend=jnp.zeros_like(end_blocks[..., :1]), axis=-1)


def block_owners(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(group, global block) int32 [B, P] of each block of the grouped layout; group G where no group owns it."""
    groups = group_sizes.shape[-1]
    starts, ends = bounds(group_sizes, rows)
    p = jnp.arange(grouped_blocks(rows, groups), dtype=jnp.int32)[None, :, None]  # [1, P, 1]
    g = jnp.arange(groups, dtype=jnp.int32)
    j = p - g  # the global block group g would put at p
    owns = (ends > starts)[:, None] & (j >= starts[:, None] // BLOCK) & (j < -(-ends[:, None] // BLOCK))
    owner = jnp.where(jnp.any(owns, -1), jnp.argmax(owns, -1).astype(jnp.int32), groups)
    return owner, p[0, :, 0][None] - jnp.minimum(owner, groups - 1)


def _grouped_rows(u: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Bits [B, M, N] laid out as the grouped copy's rows [B, Mp, N] (the others zero), and each block's owner."""
    bsz, rows, _ = u.shape
    starts, ends = bounds(group_sizes, rows)
    owner, block = block_owners(group_sizes, rows)
    src = block[..., None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)  # [B, P, 16]: the global row
    g = jnp.minimum(owner, group_sizes.shape[-1] - 1)[..., None]
    lo, hi = (jnp.take_along_axis(a, g[..., 0], 1)[..., None] for a in (starts, ends))
    mine = (owner[..., None] < group_sizes.shape[-1]) & (src >= lo) & (src < hi)
    gathered = jnp.take_along_axis(u, jnp.clip(src, 0, rows - 1).reshape(bsz, -1, 1), axis=1)
    return jnp.where(mine.reshape(bsz, -1, 1), gathered, 0), owner


def _columns(u: jax.Array, group_sizes: jax.Array, rht: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """The grouped copy's values before scaling: bits [B, N, Mp] (of the RHT with ``rht``), and the blocks' owners."""
    ug, owner = _grouped_rows(u, group_sizes)
    return (core.rht_columns(ug, dtype) if rht else jnp.swapaxes(ug, 1, 2)), owner


def _valid_rows(u: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Bits [B, M, N] with the rows past the last group zero."""
    return jnp.where(jnp.arange(u.shape[1])[None, :, None] < bounds(group_sizes, u.shape[1])[1][:, -1:, None], u, 0)


def grouped_amax_core(x, group_sizes, *, rht_amax: bool, per_row: bool) -> tuple[jax.Array, jax.Array]:
    """x [B, M, N], group_sizes [B, G] -> (amax, amax_t) float32, NaN canonical.

    amax: max |x| over the rows in groups, [B] (``per_row``: each row's, [B, M], 0 past the groups).
    amax_t: each group's max over its rows (of the RHT of its chunks, rows outside it zero, with
    ``rht_amax``), [B, G]; ``per_row``: each group's per feature, [B, G, N]. 0 for an empty group.
    """
    groups = group_sizes.shape[-1]
    u = _valid_rows(b.to_bits(x), group_sizes)
    cols, owner = _columns(u, group_sizes, rht_amax, x.dtype)
    bsz, n, mp = cols.shape
    block_max = jnp.max(b.magnitude(cols).reshape(bsz, n, mp // BLOCK, BLOCK), -1)  # [B, N, P]
    one_hot = owner[:, None, :, None] == jnp.arange(groups)  # [B, 1, P, G]
    per_group = jnp.max(jnp.where(one_hot, block_max[..., None], 0), axis=2)  # [B, N, G]
    per_group = jnp.swapaxes(per_group, 1, 2)  # [B, G, N]
    if per_row:
        return b.from_bits(core.max_magnitude_bits(u, 2)), b.from_bits(b.canonical_nan(per_group))
    return b.from_bits(core.max_magnitude_bits(u, (1, 2))), b.from_bits(b.canonical_nan(jnp.max(per_group, -1)))


def _group_bytes(group_seeds, owner, shape: tuple[int, int, int], place: Place) -> jax.Array:
    """Each value's random byte of the grouped copy [B, N, Mp]: block p (owner g) draws with g's seed as
    block p - g (its place on the global grid of 16 rows) of the [B, N, M] copy's stream 1, at ``place`` (the
    quantize's, ``reference.stochastic.split_seed``)."""
    bsz, n, mp = shape
    groups = group_seeds.shape[0]
    blocks = mp // BLOCK
    seeds = group_seeds[jnp.minimum(owner, groups - 1)].astype(jnp.uint32)  # [B, P, 2]
    j = place.block_ids(blocks)[jnp.arange(blocks) - jnp.minimum(owner, groups - 1)][:, None, :]
    r = jnp.arange(n, dtype=jnp.uint32)[:, None] + jnp.uint32(place.n)
    bi = jnp.arange(bsz, dtype=jnp.uint32)[:, None, None] + jnp.uint32(place.b)
    key = jnp.moveaxis(seeds[:, None], -1, 0)  # [2, B, 1, P]
    return block_bytes(key, j, r, bi, jnp.uint32(1), shape)


def grouped_quantize_core(x, group_sizes, amax, amax_t, seed, group_seeds, *, spec: QuantizeSpec):
    """x [B, M, N], group_sizes [B, G] -> (data, scale) if ``spec.rowwise``, then the grouped (data_t, scale_t).

    data [B, M, ceil(N/2)], scale [B, M, ceil(N/16)]: ``quantize_core``'s rowwise copy of x with the
    rows past the groups zero (``amax`` [B], or [B, M] row-scaled; ``seed`` [2] for its stochastic
    rounding, or [4 + M] with the place of both copies: ``reference.stochastic.split_seed``). data_t
    [B, N, Mp/2], scale_t [B, N, P]: the grouped columnwise copy of the module docstring, scaled by
    ``amax_t`` [B, G] ([B, G, N] row-scaled), rounding with ``group_seeds`` [G, 2] at that place.
    1x16 blocks only; every option of the columnwise 1x16 copy applies.
    """
    bsz = x.shape[0]
    groups = group_sizes.shape[-1]
    u = _valid_rows(b.to_bits(x), group_sizes)
    fos = spec.four_over_six_choice
    outs = []
    if spec.rowwise:
        seed_rows = seed if spec.draws_random else None
        data, scale = core.quantize_1d(u, core.global_scales(amax, spec.e4m3_max), seed_rows, 0, fos)
        outs += [data, core.as_e4m3(scale)]
    cols, owner = _columns(u, group_sizes, spec.rht, x.dtype)
    n, mp = cols.shape[1:]
    used = owner < groups  # [B, P]
    g_index = jnp.minimum(owner, groups - 1)
    amax_t = amax_t.astype(jnp.float32)
    if spec.global_scale.per_row:  # [B, G, N] -> each block's [B, N, P]
        block_amax = jnp.take_along_axis(jnp.swapaxes(amax_t, 1, 2), g_index[:, None, :], axis=2)
    else:
        block_amax = jnp.take_along_axis(amax_t, g_index, axis=1)[:, None, :]
    g = core.GlobalScales(b.to_bits(block_amax), spec.e4m3_max)
    # The barrier keeps the gather and transform that laid the blocks out out of the scaling's fusions, where
    # XLA's CPU compiler looped for minutes (per-row 4over6 scales, seen on a [1, 17, 33] float16 input).
    blocks = lax.optimization_barrier(cols.reshape(bsz, n, mp // BLOCK, BLOCK))
    if fos is not None:
        codes, scale = _fos.quantize_blocks(blocks[..., None, :], g, *fos)
    else:
        scale, enc = g.block_encode(core.block_scale(core.max_magnitude_bits(blocks, -1), g.encode_div6))
        v = b.mul(blocks, enc[..., None]).reshape(cols.shape)
        if spec.draws_random:
            codes = e2m1_encode_stochastic(v, _group_bytes(group_seeds, owner, cols.shape, split_seed(seed)[1]))
        else:
            codes = e2m1_encode(v)
    codes = jnp.where(used[:, None, :, None], codes.reshape(blocks.shape), 0).reshape(cols.shape)
    scale = jnp.where(used[:, None, :], scale, 0)
    outs += [core.pack(codes, mp), core.as_e4m3(scale)]
    return tuple(outs)


__all__ = [
    "block_owners",
    "bounds",
    "grouped_amax_core",
    "grouped_blocks",
    "grouped_quantize_core",
    "segment_sizes",
]
