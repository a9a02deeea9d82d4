"""ragged_dot with Recipe(impl="fused"): the fused grouped GEMMs (ops.fused_ragged_gemm, Pallas interpret mode
here) for fprop and dgrad, and for wgrad, against float64 sums of the decoded blocks and against the emulated
ragged_dot. Their operands are made so that every float32 partial sum is exact, as in
tests/gemm/test_fused_gemm.py: then the orders of accumulation cannot differ and the bytes must be equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import CPUS, assert_same_bytes, examples, needs_8_cpus
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4.core.transpose import transpose_codes, transpose_scales
from jax_nvfp4.ops.fused_ragged_gemm import fused_ragged_gemm, fused_segment_gemm, tile_pairs
from jax_nvfp4.ops.gemm import block_values
from jax_nvfp4.sharding.hlo import collectives


def _block_values64(data: np.ndarray, scale: np.ndarray, length: int) -> np.ndarray:
    e4m3 = jnp.asarray(scale.view(ml_dtypes.float8_e4m3fn))[None]
    return np.asarray(block_values(jnp.asarray(data)[None], e4m3, length))[0].astype(np.float64)


def test_tile_pairs_cover_every_row_once():
    """Groups of 10, 0 and 25 rows and 5 rows past them, tiles of 16: one pair per (tile, group) with rows in it,
    the rows past the groups a group of their own (G), the remaining pairs inactive (no rows)."""
    pairs = np.asarray(tile_pairs(jnp.asarray([10, 0, 25], jnp.int32), 40, 16))
    want = [[0, 0, 0, 10], [2, 0, 10, 16], [2, 1, 16, 32], [2, 2, 32, 35], [3, 2, 35, 40], [3, 0, 0, 0]]
    assert pairs.T.tolist() == want


@settings(max_examples=examples(12))
@given(
    sizes=st.lists(st.integers(0, 90), min_size=1, max_size=4),
    tail=st.integers(0, 20),
    length=st.integers(1, 100),
    n=st.integers(1, 150),
    transposed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_each_row_is_its_experts_product(sizes, tail, length, n, transposed, seed):
    """Rows of random packed codes (E4M3 scales in [1, 2): exact float32 sums) in groups of any size (empty ones,
    boundaries inside a tile, rows past the groups), each times its expert (as stored, or a 16x16-block copy read
    transposed), then the group's and the row's scale: the float64 sums rounded as the epilogue says, bit for bit;
    zeros past the groups."""
    rng = np.random.default_rng(seed)
    rows, groups = sum(sizes) + tail, len(sizes)
    a = rng.integers(0, 256, (rows, -(-length // 2)), dtype=np.uint8)
    sa = rng.integers(0x38, 0x40, (rows, -(-length // 16)), dtype=np.uint8)
    if transposed:  # [G, L, n]: one scale a 16x16 block, repeated on its 16 rows
        c = rng.integers(0, 256, (groups, length, -(-n // 2)), dtype=np.uint8)
        blocks = rng.integers(0x38, 0x40, (groups, -(-length // 16), -(-n // 16)), dtype=np.uint8)
        sc = np.repeat(blocks, 16, axis=1)[:, :length]
        codes, scales = transpose_codes(jnp.asarray(c), length, n), transpose_scales(jnp.asarray(sc), length, n)
        as_stored = (np.asarray(codes), np.asarray(scales))
    else:
        c = rng.integers(0, 256, (groups, n, -(-length // 2)), dtype=np.uint8)
        sc = rng.integers(0x38, 0x40, (groups, n, -(-length // 16)), dtype=np.uint8)
        as_stored = (c, sc)
    s1 = rng.uniform(0.5, 2, groups).astype(np.float32)
    s2 = rng.uniform(0.5, 2, rows).astype(np.float32)
    args = (*(jnp.asarray(v) for v in (a, sa, c, sc)), jnp.asarray(sizes, jnp.int32), jnp.asarray(s1), jnp.asarray(s2))
    got = fused_ragged_gemm(*args, n=n, length=length, out_dtype=jnp.float32, transposed=transposed)
    va, want, start = _block_values64(a, sa, length), np.zeros((rows, n), np.float32), 0
    for g, size in enumerate(sizes):
        expert = _block_values64(as_stored[0][g], as_stored[1][g], length)
        acc = (va[start : start + size] @ expert.T).astype(np.float32)
        want[start : start + size] = (acc * s1[g]).astype(np.float32) * s2[start : start + size, None]
        start += size
    assert_same_bytes(np.asarray(got) + 0, want + 0)  # -0 + 0 = +0: the accumulator's sign of a zero sum


@settings(max_examples=examples(12))
@given(
    blocks=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    tail=st.integers(0, 3),
    k=st.integers(1, 150),
    n=st.integers(1, 150),
    c_first=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_each_group_contracts_its_segment(blocks, tail, k, n, c_first, seed):
    """Two grouped copies [K, Mp] and [N, Mp] of random codes (E4M3 scales in [1, 2): exact float32 sums), each
    group a segment of whole 16-token blocks (empty ones included), then blocks no group owns whose scales are NaN:
    each group's sum over its segment alone, times its scale, then a's row scales and c's (or c's first), bit for
    bit."""
    rng = np.random.default_rng(seed)
    segments = [16 * b for b in blocks]
    mp = sum(segments) + 16 * tail
    a, c = (rng.integers(0, 256, (r, mp // 2), dtype=np.uint8) for r in (k, n))
    sa, sc = (rng.integers(0x38, 0x40, (r, mp // 16), dtype=np.uint8) for r in (k, n))
    for scales in (sa, sc):
        scales[:, sum(segments) // 16 :] = 0x7F  # NaN: a step past the last segment must not read them
    groups = len(segments)
    s1 = rng.uniform(0.5, 2, groups).astype(np.float32)
    ra, rc = (rng.uniform(0.5, 2, (groups, r)).astype(np.float32) for r in (k, n))
    args = [jnp.asarray(v) for v in (a, sa, c, sc, np.asarray(segments, np.int32), s1, ra, rc)]
    got = np.asarray(fused_segment_gemm(*args, out_dtype=jnp.float32, c_first=c_first))
    va, vc = _block_values64(a, sa, mp), _block_values64(c, sc, mp)
    want, start = np.zeros((groups, k, n), np.float32), 0
    for g, size in enumerate(segments):
        acc = (va[:, start : start + size] @ vc[:, start : start + size].T).astype(np.float32)
        rows, cols = ra[g][:, None], rc[g][None, :]
        want[g] = (acc * s1[g]) * cols * rows if c_first else (acc * s1[g]) * rows * cols
        start += size
    assert_same_bytes(got + 0, want + 0)


def test_segment_copies_of_part_blocks_or_unequal_tokens_are_refused():
    ones = lambda shape: jnp.ones(shape, jnp.uint8)  # noqa: E731
    scales = (jnp.ones((1,), jnp.float32), jnp.ones((1, 4), jnp.float32), jnp.ones((1, 4), jnp.float32))
    segments = jnp.asarray([16], jnp.int32)
    for a_tokens, c_tokens in ((12, 12), (16, 32)):  # 12 tokens: not whole blocks of 16; 16 against 32
        a = (ones((4, a_tokens // 2)), ones((4, -(-a_tokens // 16))))
        c = (ones((4, c_tokens // 2)), ones((4, -(-c_tokens // 16))))
        with pytest.raises(ValueError, match="whole number of 16-token blocks"):
            fused_segment_gemm(*a, *c, segments, *scales, out_dtype=jnp.float32)


@pytest.mark.parametrize(
    "options",
    [{}, {"weight_block_2d": False}, {"row_scaled_activations": True, "row_scaled_gradients": True}],
    ids=["16x16", "1x16", "per-token"],
)
def test_a_training_step_is_the_emulated_one(options):
    """x [M, K] . W [G, K, N] through ragged_dot with the full recipe (RHT, stochastic rounding) and each weight
    layout: y, dx and dW of impl="fused" (its three GEMMs fused) equal the emulation's, and so does the forward
    pass alone, with an empty group and rows past the groups: bit for bit on the CPU, within float32 accumulation
    on a GPU."""
    x = jax.random.normal(jax.random.key(0), (70, 48), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (3, 48, 40), jnp.float32) * 0.1
    dy = jax.random.normal(jax.random.key(2), (70, 40), jnp.float32)
    sizes = jnp.asarray([30, 0, 33], jnp.int32)

    def run(impl):
        recipe = jax_nvfp4.Recipe(impl=impl, **options)
        f = lambda x, w: jax_nvfp4.ragged_dot(x, w, sizes, recipe=recipe, rng_key=jax.random.key(3))  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return (f(x, w), y, *vjp(dy))

    for got, want in zip(run("fused"), run("emulated"), strict=True):
        if jax.default_backend() == "cpu":
            assert_same_bytes(got, want)
        else:
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.abs(got - want).max() <= 2.0**-8 * np.abs(want).max()


@needs_8_cpus
def test_on_a_mesh_it_runs_whole_on_gathered_packed_operands():
    """Tokens sharded by feature and experts over a 2 x 4 mesh: XLA does not partition the Pallas call, so it
    gathers the packed codes and scales (uint32 words, uint8 bytes), never bf16 values, and runs it whole: the
    bytes of the unsharded emulated layer, forward and gradients."""
    mesh = jax.make_mesh((2, 4), ("d", "e"), devices=CPUS[:8], axis_types=(AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(0), (64, 48), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, 48, 32), jnp.float32) * 0.1
    sizes = jnp.asarray([10, 20, 0, 30], jnp.int32)

    def loss(x, w, impl):
        recipe = jax_nvfp4.Recipe(impl=impl)
        y = jax_nvfp4.ragged_dot(x, w, sizes, recipe=recipe, rng_key=jax.random.key(3))
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    sharded = (
        jax.device_put(x, NamedSharding(mesh, P(None, "e"))),
        jax.device_put(w, NamedSharding(mesh, P("e", None, None))),
    )
    step = jax.jit(jax.grad(loss, (0, 1), has_aux=True), static_argnums=2)
    (dx, dw), y = step(*sharded, "fused")
    (want_dx, want_dw), want_y = step(x, w, "emulated")
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert_same_bytes(got, want)
    forward = jax.jit(lambda x, w: loss(x, w, "fused")[1]).lower(*sharded).compile().as_text()
    gathered = {c.dtype for c in collectives(forward) if c.op == "all-gather" and c.nbytes > 64}
    assert {"u32", "u8"} <= gathered and not gathered & {"bf16", "f16"}, gathered
