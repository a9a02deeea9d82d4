"""The fused GEMM's grouped forms: tokens sorted by expert times their expert's packed NVFP4 weight, and each
expert's weight gradient from its segment of the tokens.

``ragged_dot``'s token GEMMs (fprop and dgrad) with ``Recipe(impl="fused")``: rows [M, L] of packed codes and
E4M3 bytes, each row times the expert [G, n, L] of its group (or, ``transposed``, the expert's kept 16x16-block
copy [G, L, n] read as its transpose, as ``ops.fused_gemm``'s variant reads it), decoded in the kernel's tiles
(``ops.fused_gemm``'s decode), with no bf16 copy of either operand and no dense expansion of the ragged product.

The grid runs over (tile, group) pairs: a tile of ``tile_m`` rows meets each group that has rows in it, so a
pair's GEMM is one expert's product of one row tile, and it stores only its group's rows (a masked store). The
pairs are at most ceil(M / tile_m) + G: every group boundary inside a tile adds one. Rows past the last group
form a group of their own, stored as zeros (as ``lax.ragged_dot`` gives them). The epilogue multiplies each float32
sum by its group's scale ``s1[g]`` and its row's ``s2[row]``, in that order (``ragged_dot``'s: the product of the
per-tensor decode scales, then a row-scaled token's own), and casts.

``fused_segment_gemm`` is wgrad's (``ragged_dot``'s ``lax.ragged_dot_general`` of decoded blocks otherwise): two
grouped columnwise copies [K, Mp] and [N, Mp], blocked along the tokens, each group's tokens a segment of whole
16-token blocks, contracted segment by segment into [G, K, N]. Its grid runs over (group, K tile, N tile); a
program steps through its group's segment only (as many steps as the segment needs); the words and scales of its
last step past the segment's end are masked (not loaded: zero codes and scales, exact zeros), so that neither the
next group's tokens nor anything past the copy adds to the sums, NaN scales included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_nvfp4.ops.fused_gemm import (
    BYTES_PER_SCALE,
    NIBBLE,
    UNSCALE,
    WORDS_PER_SCALE,
    Tiles,
    compiler_params,
    in_order,
    on_platform,
    operand,
    pad_to,
    quarters,
    row_groups,
    tiles_for,
    transposed_operand,
    words,
)


def tile_pairs(sizes: jax.Array, rows: int, tile_m: int) -> jax.Array:
    """int32 [4, P]: each (tile, group) pair's group, row tile and rows [lo, hi) of the group in the tile.

    ``sizes`` [G]: the groups' rows in order, summing to at most ``rows``; the rows past their sum are group G.
    P = ceil(rows / tile_m) + G bounds the pairs; the pairs past the last are inactive (lo = hi = 0).
    """
    groups = sizes.shape[0]
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    starts = jnp.concatenate([ends - sizes, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])
    first, last = starts // tile_m, (ends - 1) // tile_m
    count = jnp.where(ends > starts, last - first + 1, 0)
    total = jnp.cumsum(count)
    pairs = -(-rows // tile_m) + groups
    p = jnp.arange(pairs, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(total, p, side="right").astype(jnp.int32), groups)
    active = p < total[-1]
    t = first[g] + p - (total[g] - count[g])
    lo = jnp.where(active, jnp.maximum(starts[g], t * tile_m), 0)
    hi = jnp.where(active, jnp.minimum(ends[g], (t + 1) * tile_m), 0)
    return jnp.stack([g, jnp.where(active, t, 0), lo, hi])


def _kernel(
    meta_ref, a_ref, a_scale_ref, c_ref, c_scale_ref, s1_ref, s2_ref, out_ref, *, steps, tile_words, tiles, transposed
):
    p, j = pl.program_id(0), pl.program_id(1)
    g, t, lo, hi = meta_ref[0, p], meta_ref[1, p], meta_ref[2, p], meta_ref[3, p]
    groups = c_ref.shape[0]
    expert = jnp.minimum(g, groups - 1)  # the rows past the last group: any expert, then zeros
    rows = pl.ds(t * tiles.m, tiles.m)
    tile_scales = tile_words // WORDS_PER_SCALE

    def step(k, acc):
        words, scales = pl.ds(k * tile_words, tile_words), pl.ds(k * tile_scales, tile_scales)
        a = quarters(a_ref[rows, words], a_scale_ref[rows, scales])
        if transposed:  # c [G, L / 8, 8, n / 8]: a's quarter meets its nibble's sub-row, decoded in column order
            cols, col_scales = pl.ds(j * (tiles.n // 8), tiles.n // 8), pl.ds(j * (tiles.n // 16), tiles.n // 16)
            for x, nibble in zip(a, NIBBLE, strict=True):
                c = c_ref[expert, words, nibble, cols]
                y = in_order(quarters(c, c_scale_ref[expert, words, nibble, col_scales]))
                acc = acc + lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            return acc
        cols = pl.ds(j * tiles.n, tiles.n)
        c = quarters(c_ref[expert, cols, words], c_scale_ref[expert, cols, scales])
        for x, y in zip(a, c, strict=True):
            acc = acc + lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((tiles.m, tiles.n), jnp.float32))
    y = (acc * UNSCALE * s1_ref[g]) * s2_ref[rows, :]
    y = jnp.where(g < groups, y, 0.0).astype(out_ref.dtype)
    row = t * tiles.m + lax.broadcasted_iota(jnp.int32, (tiles.m, tiles.n), 0)
    plgpu.store(out_ref.at[rows, pl.ds(j * tiles.n, tiles.n)], y, mask=(row >= lo) & (row < hi))


def fused_ragged_gemm(
    a_data: jax.Array,
    a_scale: jax.Array,
    c_data: jax.Array,
    c_scale: jax.Array,
    sizes: jax.Array,
    s1: jax.Array,
    s2: jax.Array,
    *,
    n: int,
    length: int,
    out_dtype,
    transposed: bool = False,
    interpret: bool | None = None,
    tiles: Tiles | None = None,
) -> jax.Array:
    """Rows a [M, ceil(L / 2)] (codes) and [M, ceil(L / 16)] (E4M3 bytes, uint8) times their group's expert
    -> [M, n] of ``out_dtype``: fp32(fp32(sum * s1[g]) * s2[row]) for a row of group g, zeros past the groups.

    ``c_data`` [G, n, ceil(L / 2)] and ``c_scale`` [G, n, ceil(L / 16)]: each expert blocked along L; or with
    ``transposed`` [G, L, ceil(n / 2)] and [G, L, ceil(n / 16)], a 16x16-block copy read as its transpose. ``sizes``
    int32 [G]: the groups' rows, in order, summing to at most M. ``s1`` float32 [G], ``s2`` float32 [M].
    ``interpret`` and ``tiles``: as ``ops.fused_gemm``'s.
    """
    rows = a_data.shape[0]
    if rows == 0 or n == 0:
        return jnp.zeros((rows, n), out_dtype)

    def run(a_data, a_scale, c_data, c_scale, sizes, s1, s2, *, interpret: bool):
        t = tiles_for(tiles, interpret)
        a, sa = (x[0] for x in operand(a_data[None], a_scale[None], rows, length, t.m, t.k_bytes))
        m, kb = a.shape
        if transposed:  # [G, L, n] -> words [G, Kb / 4, 8, n / 8]
            c, sc = row_groups(*transposed_operand(c_data, c_scale, 2 * kb, t.n))
            width = 8 * c.shape[3]
        else:  # [G, n, L] -> words [G, n', Kb / 4]
            c, sc = operand(c_data, c_scale, n, length, t.n, t.k_bytes)
            c, width = words(c), c.shape[1]
        meta = tile_pairs(sizes, rows, t.m)
        scales = jnp.concatenate([s1.astype(jnp.float32), jnp.zeros((1,), jnp.float32)])  # group G: zeros
        row_scales = pad_to(s2.astype(jnp.float32).reshape(-1, 1), 0, t.m)
        kernel = functools.partial(
            _kernel, steps=kb // t.k_bytes, tile_words=t.k_bytes // 4, tiles=t, transposed=transposed
        )
        whole = lambda x: pl.BlockSpec(x.shape, lambda p, j, n=x.ndim: (0,) * n)  # noqa: E731
        operands = (meta, words(a), sa, c, sc, scales, row_scales)
        y = pl.pallas_call(
            kernel,
            grid=(meta.shape[1], width // t.n),
            in_specs=[whole(x) for x in operands],
            out_specs=pl.BlockSpec((m, width), lambda p, j: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((m, width), jnp.dtype(out_dtype)),
            interpret=interpret,
            compiler_params=compiler_params(t, interpret),
            name="nvfp4_fused_ragged_gemm" + ("_transposed" if transposed else ""),
        )(*operands)
        return y[:rows, :n]

    return on_platform(run, (a_data, a_scale, c_data, c_scale, sizes, s1, s2), interpret)


def _segment_kernel(
    meta_ref, a_ref, a_scale_ref, c_ref, c_scale_ref, s1_ref, ra_ref, rc_ref, out_ref, *, tile_words, tiles, c_first
):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # The segment's words [first, last), in whole blocks (a scale's two words): what the loads may assume.
    first, last = (pl.multiple_of(meta_ref[r, g], WORDS_PER_SCALE) for r in (0, 1))
    rows, cols = pl.ds(i * tiles.m, tiles.m), pl.ds(j * tiles.n, tiles.n)
    tile_scales = tile_words // WORDS_PER_SCALE

    def load(ref, lines, at, size, end, masked):  # a step's words or scales; masked: none read past ``end``
        if not masked:
            return ref[lines, pl.ds(at, size)]
        inside = at + lax.broadcasted_iota(jnp.int32, (lines.size, size), 1) < end
        return plgpu.load(ref.at[lines, pl.ds(at, size)], mask=inside, other=0)

    def step(k, acc, masked):
        at = first + k * tile_words
        words = (at, tile_words, last, masked)
        scales = (at // WORDS_PER_SCALE, tile_scales, last // WORDS_PER_SCALE, masked)
        a = quarters(load(a_ref, rows, *words), load(a_scale_ref, rows, *scales))
        c = quarters(load(c_ref, cols, *words), load(c_scale_ref, cols, *scales))
        for x, y in zip(a, c, strict=True):
            acc = acc + lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    # The whole steps load unmasked; the segment's last part step, if any, masked (so the loop stays lean).
    whole, steps = (last - first) // tile_words, (last - first + tile_words - 1) // tile_words
    acc = lax.fori_loop(0, whole, functools.partial(step, masked=False), jnp.zeros((tiles.m, tiles.n), jnp.float32))
    acc = lax.fori_loop(whole, steps, functools.partial(step, masked=True), acc)
    row_scales = (ra_ref[g, rows, :], rc_ref[g, :, cols])
    first, second = row_scales[::-1] if c_first else row_scales
    out_ref[...] = (((acc * UNSCALE * s1_ref[g]) * first) * second).astype(out_ref.dtype)


def fused_segment_gemm(
    a_data: jax.Array,
    a_scale: jax.Array,
    c_data: jax.Array,
    c_scale: jax.Array,
    segments: jax.Array,
    s1: jax.Array,
    ra: jax.Array,
    rc: jax.Array,
    *,
    out_dtype,
    c_first: bool = False,
    interpret: bool | None = None,
    tiles: Tiles | None = None,
) -> jax.Array:
    """Two grouped copies blocked along the tokens, contracted group by group over their segments -> [G, K, N].

    ``a_data`` [K, Mp / 2] (codes) and ``a_scale`` [K, Mp / 16] (E4M3 bytes, uint8), likewise c [N, ...];
    ``segments`` int32 [G]: each group's tokens in the copies, consecutive from token 0, each a multiple of 16,
    as Mp is. Group g's result is fp32(fp32(fp32(sum * s1[g]) * ra[g, k]) * rc[g, n]) cast to ``out_dtype``:
    ``s1`` float32 [G] the product of the per-tensor decode scales, ``ra`` [G, K] and ``rc`` [G, N] the per-row
    ones (ones where an operand has none: a multiply by 1 is exact); ``c_first``: ``rc`` before ``ra`` instead
    (the order of a GEMM with c as its first operand, written transposed). ``interpret`` and ``tiles``: as
    ``ops.fused_gemm``'s.
    """
    groups, k, n = segments.shape[0], a_data.shape[0], c_data.shape[0]
    if a_data.shape[1] % 8 or c_data.shape[1] != a_data.shape[1]:
        raise ValueError(
            f"the copies' tokens must be one whole number of 16-token blocks, got {a_data.shape} and {c_data.shape}"
        )
    if groups == 0 or k == 0 or n == 0 or a_data.shape[1] == 0:  # no sums, or sums of no tokens
        return jnp.zeros((groups, k, n), out_dtype)

    def run(a_data, a_scale, c_data, c_scale, segments, s1, ra, rc, *, interpret: bool):
        t = tiles_for(tiles, interpret)
        narrow = a_data.shape[1] < t.k_bytes

        def padded(x, tile, bytes_per_entry):
            # Rows to whole tiles (zeros). The tokens are not padded (a step's loads past its segment are masked,
            # so the last step reads nothing past the copy), unless the copy is narrower than one step's load.
            x = pad_to(x, 0, tile)
            return pad_to(x, 1, t.k_bytes // bytes_per_entry) if narrow else x

        a, c = padded(a_data, t.m, 1), padded(c_data, t.n, 1)
        sa, sc = padded(a_scale, t.m, BYTES_PER_SCALE), padded(c_scale, t.n, BYTES_PER_SCALE)
        segment_words = segments.astype(jnp.int32) // 8  # words of 8 codes
        ends = jnp.cumsum(segment_words)
        meta = jnp.stack([ends - segment_words, ends])
        ra = pad_to(ra.astype(jnp.float32), 1, t.m)[:, :, None]
        rc = pad_to(rc.astype(jnp.float32), 1, t.n)[:, None, :]
        kernel = functools.partial(_segment_kernel, tile_words=t.k_bytes // 4, tiles=t, c_first=c_first)
        whole = lambda x: pl.BlockSpec(x.shape, lambda g, i, j, n=x.ndim: (0,) * n)  # noqa: E731
        operands = (meta, words(a), sa, words(c), sc, s1.astype(jnp.float32), ra, rc)
        y = pl.pallas_call(
            kernel,
            grid=(groups, a.shape[0] // t.m, c.shape[0] // t.n),
            in_specs=[whole(x) for x in operands],
            out_specs=pl.BlockSpec((None, t.m, t.n), lambda g, i, j: (g, i, j)),
            out_shape=jax.ShapeDtypeStruct((groups, a.shape[0], c.shape[0]), jnp.dtype(out_dtype)),
            interpret=interpret,
            compiler_params=compiler_params(t, interpret),
            name="nvfp4_fused_segment_gemm",
        )(*operands)
        return y[:, :k, :n]

    return on_platform(run, (a_data, a_scale, c_data, c_scale, segments, s1, ra, rc), interpret)
