"""impl="fused": the Pallas GEMM that decodes packed NVFP4 operands in its tiles (run here in Pallas's
interpret mode), against the emulation. Its float32 sums may be accumulated in another order, so the
operands are made so that every partial sum is exact: then the two are equal bit for bit. The float64
bound over random tensors is tests/gemm/test_gemm.py's; what reaches XLA on a GPU, test_gemm_impl.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, examples
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4.core.transpose import transpose_codes, transpose_scales
from jax_nvfp4.ops import fused_gemm
from jax_nvfp4.ops.gemm import block_values, gemm_p


def test_the_tile_decode_is_block_values_for_every_code_and_scale():
    """All 16 E2M1 codes under each of the 256 E4M3 bytes: the kernel's decode, put back in order and times
    2^14, gives block_values' values (-0 included; exact), and NaN under the two NaN scales."""
    codes = np.arange(16, dtype=np.uint8)
    data = np.tile(codes[0::2] | (codes[1::2] << 4), (256, 2))  # each row: codes 0..15 twice, two blocks
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 2, axis=1)
    words = jnp.asarray(data.view(np.uint32))  # [256, 4]: 8 codes a word, byte 0 in the low bits
    quarters = jax.jit(fused_gemm.quarters)(words, jnp.asarray(scale))
    got = np.empty((256, 4, 8), np.float32)  # [row, word, nibble]
    for i, values in enumerate(quarters):
        assert values.dtype == jnp.float16
        got[:, :, i // 2 + 4 * (i % 2)] = np.asarray(values, np.float32) * np.float32(2.0**14)
    got = got.reshape(256, 32)
    e4m3 = jnp.asarray(scale.view(ml_dtypes.float8_e4m3fn)[None])
    want = np.asarray(block_values(jnp.asarray(data[None]), e4m3, 32))[0].astype(np.float32)
    finite = (np.arange(256) & 0x7F) != 0x7F
    assert_same_bytes(got[finite], want[finite])
    assert np.isnan(got[~finite]).all() and np.isnan(want[~finite]).all()
    # The transposed variant's decode puts them back in order itself (joins and a reshape).
    in_order = np.asarray(jax.jit(fused_gemm.in_order)(quarters), np.float32) * np.float32(2.0**14)
    assert_same_bytes(in_order[finite], want[finite])


def test_tiles_take_whole_blocks_and_a_gpu_whole_float16_mmas():
    with pytest.raises(ValueError, match="multiple of 8"):
        fused_gemm.Tiles(k_bytes=12)
    a, sa = _exact_operand(np.random.default_rng(0), (1, 8), 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        fused_gemm.fused_gemm(
            a, sa, a, sa, 1.0, rows_a=8, rows_c=8, length=64, out_dtype=jnp.float32,
            interpret=False, tiles=fused_gemm.Tiles(k_bytes=32),
        )  # fmt: skip


def _exact_operand(rng, shape: tuple[int, ...], length: int):
    """Random packed codes [*shape, ceil(length/2)] and E4M3 bytes in [1, 2): products are multiples of 2^-4
    below 12, so every float32 partial sum of fewer than 10^5 of them is exact."""
    data = rng.integers(0, 256, (*shape, -(-length // 2)), dtype=np.uint8)
    scale = rng.integers(0x38, 0x40, (*shape, -(-length // 16)), dtype=np.uint8)
    return jnp.asarray(data), jnp.asarray(scale)


@settings(max_examples=examples(16))
@given(
    batch=st.integers(1, 3),
    rows_a=st.lists(st.integers(1, 140), min_size=1, max_size=2),
    rows_c=st.lists(st.integers(1, 40), min_size=1, max_size=2),
    lead=st.lists(st.integers(1, 5), max_size=1),
    length=st.integers(1, 150),
    out_dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fused_gemms_equal_the_emulation_bit_for_bit(batch, rows_a, rows_c, lead, length, out_dtype, seed):
    """The GEMM primitive over batch axes, one or two row axes per operand, one or two contracting axes
    (a columnwise copy's layout), ragged row counts (past a 128-row tile) and lengths (odd, past a block
    of 16, past a 64-value step), with the global decode scales and the cast to each output dtype applied
    after the sums (in the kernel's epilogue): the same bytes but for the sign of a zero sum, which is the
    accumulator's (the kernel's starts at +0)."""
    rng = np.random.default_rng(seed)
    a, sa = _exact_operand(rng, (batch, *rows_a, *lead), length)
    c, sc = _exact_operand(rng, (batch, *rows_c, *lead), length)
    amax_a, amax_c = jnp.full((batch,), 2688.0), jnp.asarray(rng.uniform(1, 3000, batch), jnp.float32)

    def run(impl):
        (y,) = gemm_p.bind(
            a, sa, amax_a, c, sc, amax_c, contract_ndim=1 + len(lead), length=length,
            out_dtype=jnp.dtype(out_dtype), impl=impl, keep_c=False,
        )  # fmt: skip
        return y

    y = run("fused")
    assert y.shape == (batch, *rows_a, *rows_c)
    assert_same_bytes(y + 0, run("emulated") + 0)  # -0 + 0 = +0; every other value unchanged


@settings(max_examples=examples(12))
@given(
    batch=st.integers(1, 2),
    rows_a=st.integers(1, 140),
    rows_c=st.integers(1, 200),
    length=st.integers(1, 100),
    out_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_16x16_copy_read_transposed_is_its_columnwise_copy(batch, rows_a, rows_c, length, out_dtype, seed):
    """c packed along its rows, [B, L, ceil(Rc / 2)] with one scale a 16x16 block (repeated on its 16 rows), read
    transposed by the GEMM (``c_packed_rows``, dgrad's read of a weight's rowwise copy): every impl gives the
    emulation of its columnwise copy (core.transpose's bytes), bit for bit; ragged and odd rows and lengths, a
    byte's high nibble past an odd row count holding a code, past a 128-column tile."""
    rng = np.random.default_rng(seed)
    a, sa = _exact_operand(rng, (batch, rows_a), length)
    c = jnp.asarray(rng.integers(0, 256, (batch, length, -(-rows_c // 2)), dtype=np.uint8))
    blocks = rng.integers(0x38, 0x40, (batch, -(-length // 16), -(-rows_c // 16)), dtype=np.uint8)
    sc = jnp.asarray(np.repeat(blocks, 16, axis=1)[:, :length])
    c_t, sc_t = transpose_codes(c, length, rows_c), transpose_scales(sc, length, rows_c)
    amax_a, amax_c = jnp.full((batch,), 2688.0), jnp.asarray(rng.uniform(1, 3000, batch), jnp.float32)

    def run(impl, c, sc, c_packed_rows):
        (y,) = gemm_p.bind(
            a, sa, amax_a, c, sc, amax_c, contract_ndim=1, length=length, out_dtype=jnp.dtype(out_dtype),
            impl=impl, keep_c=False, c_packed_rows=c_packed_rows,
        )  # fmt: skip
        return y

    want = run("emulated", c_t, sc_t, 0)
    assert want.shape == (batch, rows_a, rows_c)
    for impl in ("emulated", "fused", "scaled_dot"):
        assert_same_bytes(run(impl, c, sc, rows_c) + 0, want + 0)  # -0 + 0 = +0: as above


def test_a_copy_read_transposed_is_one_contracted_axis_and_not_kept():
    a, sa = _exact_operand(np.random.default_rng(0), (1, 4, 2), 16)
    c, sc = _exact_operand(np.random.default_rng(1), (1, 16), 32)
    one = jnp.ones((1,), jnp.float32)
    common = {"length": 16, "out_dtype": jnp.dtype(jnp.float32), "impl": "emulated", "c_packed_rows": 32}
    with pytest.raises(ValueError, match="packed along its rows"):
        gemm_p.bind(a, sa, one, c, sc, one, contract_ndim=2, keep_c=False, **common)
    with pytest.raises(ValueError, match="packed along its rows"):
        gemm_p.bind(a[:, :, 0], sa[:, :, 0], one, c, sc, one, contract_ndim=1, keep_c=True, **common)
    q = jax_nvfp4.quantize(jnp.ones((32, 32), jnp.bfloat16))  # 1x16 blocks: its copies hold other blocks
    from jax_nvfp4.linear.gemm import batched_gemm

    with pytest.raises(ValueError, match="16x16"):
        batched_gemm(q, q, jnp.float32, c_columnwise=True, c_transposed=True)


def test_a_training_step_of_the_full_recipe_is_the_emulated_one():
    """x [B, T, K] . W through dot_general with RHT, stochastic rounding and 16x16 weight blocks: y, dx and
    dW of impl="fused" (each GEMM of the same quantized operands) equal the emulation's: bit for bit on the
    CPU (the kernel adds the products in another order, which for these shapes rounds no sum differently);
    within float32 accumulation on a GPU."""
    x = jax.random.normal(jax.random.key(0), (2, 24, 96), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (96, 40), jnp.float32) * 0.1
    dy = jax.random.normal(jax.random.key(2), (2, 24, 40), jnp.float32)
    dims = (((2,), (0,)), ((), ()))

    def grads(impl):
        recipe = jax_nvfp4.Recipe(impl=impl)
        f = lambda x, w: jax_nvfp4.dot_general(x, w, dims, recipe=recipe, rng_key=jax.random.key(3))  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    run = jax.jit(grads, static_argnums=0)
    for got, want in zip(run("fused"), run("emulated"), strict=True):
        if jax.default_backend() == "cpu":
            assert_same_bytes(got, want)
        else:
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.abs(got - want).max() <= 2.0**-8 * np.abs(want).max()  # other float32 summation orders


def test_the_gpu_tiles_give_the_interpreted_tiles_bytes():
    """The GPU's blocking (fused_gemm.TILES, 128 x 256) and the interpreter's (128 x 128) change which tile a
    sum is in, not how it is summed: the same bytes, run here in interpret mode, on rows past both tile sizes."""
    rng = np.random.default_rng(1)
    a, sa = _exact_operand(rng, (2, 300), 200)
    c, sc = _exact_operand(rng, (2, 270), 200)
    scale = jnp.asarray([0.75, 3.0], jnp.float32)
    args = {"rows_a": 300, "rows_c": 270, "length": 200, "out_dtype": jnp.bfloat16, "interpret": True}
    got = fused_gemm.fused_gemm(a, sa, c, sc, scale, **args, tiles=fused_gemm.TILES)
    assert_same_bytes(got, fused_gemm.fused_gemm(a, sa, c, sc, scale, **args, tiles=fused_gemm.INTERPRET_TILES))
