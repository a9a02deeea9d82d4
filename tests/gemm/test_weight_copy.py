"""One copy of a 16x16-block weight: its columnwise copy is its rowwise bytes transposed, made after the gather."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import DENSE, assert_same_bytes, dense_problem, examples, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import FourOverSix, Recipe, gemm, quantize
from jax_nvfp4.core.pipeline import quantize_batch
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.core.transpose import with_columnwise_copy
from jax_nvfp4.ops import KERNELS

_COPY = ("data_t", "scale_t", "amax_t")
# 4over6 picks each 16x16 block's scale from error sums over its rows in one copy and over its columns in the
# other: in a near tie the float32 sums may pick differently (none in 786,432 blocks of N(0, 1) data), so the
# transposed copy is compared with quantizing x^T on fixed cases, not on drawn ones.
_FOUR_OVER_SIX = [{"four_over_six_error": "mse"}, {"four_over_six_error": "mae", "e4m3_max": 256}]
_FOUR_OVER_SIX += [{"four_over_six_error": "mse", "four_over_six_fast_math": True}]
_SPECIALS = ("zero", "nan", "inf", "tiny")


def _assert_same_copy(made, want):
    for name in _COPY:
        assert_same_bytes(getattr(made, name), getattr(want, name), name)
    assert made.spec == want.spec


def _check_transpose(x, **options):
    spec = QuantizeSpec(rowwise=True, columnwise=True, block_2d=True, **options)
    want = quantize_batch(KERNELS, x, spec)
    rows = quantize_batch(KERNELS, x, dataclasses.replace(spec, columnwise=False))
    assert rows.data_t is None
    _assert_same_copy(with_columnwise_copy(rows), want)


@settings(max_examples=examples(25), deadline=None)
@given(
    b=st.integers(1, 3),
    n=st.integers(1, 50),
    k=st.integers(1, 50),
    dtype=st.sampled_from([ml_dtypes.bfloat16, np.float16, np.float32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_transposed_bytes_equal_the_columnwise_quantize(b, n, k, dtype, seed):
    """A batch [B, N, K] (a weight as dot_general holds it), any sizes, special values: byte-equal."""
    rng = np.random.default_rng(seed)
    _check_transpose(jnp.asarray(random_tensor(rng, (b, n, k), dtype, spread=3, specials=_SPECIALS, frac=0.02)))


@pytest.mark.parametrize("options", _FOUR_OVER_SIX)
def test_transposed_4over6_bytes_equal_the_columnwise_quantize(options):
    rng = np.random.default_rng(7)
    x = random_tensor(rng, (2, 37, 50), ml_dtypes.bfloat16, spread=3, specials=_SPECIALS, frac=0.02)
    _check_transpose(jnp.asarray(x), **options)


@pytest.mark.parametrize("shape", [(2, 3, 40), (17, 33), (4, 8, 16)])
def test_transposed_bytes_of_a_tensor_from_quantize(shape):
    """``quantize``'s tensors flatten their leading axes into rows; the copy is [N, M/2] as quantize makes it."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.bfloat16)
    _assert_same_copy(with_columnwise_copy(quantize(x, block_2d=True)), quantize(x, block_2d=True, columnwise=True))


def test_transposing_needs_16x16_blocks_and_the_rowwise_copy():
    x = jnp.ones((32, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="16x16 blocks"):
        with_columnwise_copy(quantize(x))
    with pytest.raises(ValueError, match="lacks"):
        with_columnwise_copy(quantize(x, block_2d=True, rowwise=False, columnwise=True))


@pytest.mark.parametrize("impl", ["emulated", "scaled_dot", "cudnn"])
@pytest.mark.parametrize("four_over_six", [None, FourOverSix(operands="weights")])
def test_dgrad_reads_the_forward_copy_transposed(impl, four_over_six):
    """The backward pass keeps W's rowwise copy alone, and dx is the GEMM with W quantized along N, bit for bit:
    ragged sizes (not multiples of 16) and a batch axis, in each impl."""
    recipe = Recipe(rht=False, stochastic_rounding=False, impl=impl, four_over_six=four_over_six)
    dot = functools.partial(jax_nvfp4.dot_general, recipe=recipe)
    x, w, dy = dense_problem(24, 40, 19)
    y, vjp = jax.vjp(lambda x, w: dot(x, w, DENSE), x, w)
    shapes = {leaf.shape for leaf in jax.tree.leaves(vjp)}
    # W^T [1, N, K]: its rowwise codes [1, 19, 20] and scales [1, 19, 3] are kept, not its columnwise [1, 40, 10].
    assert {(1, 19, 20), (1, 19, 3)} <= shapes and (1, 40, 10) not in shapes, shapes
    dx, _ = vjp(dy.astype(y.dtype))
    spec = recipe.spec("w", columnwise=False, tokens=1)  # W [K, N] quantized along N as W^T is along K
    assert_same_bytes(dx, gemm(quantize(dy), quantize(w, spec), x.dtype, impl=impl))
    # Batched: [B, M, K] . [B, K, N], each entry's dx its own GEMM (one amax for the stack: equal maxima).
    xs, ws = jnp.stack([x, -x]), jnp.stack([w, w[::-1]])
    dys = jnp.stack([dy, 2 * dy])
    batched = (((2,), (1,)), ((0,), (0,)))
    _, vjp = jax.vjp(lambda x, w: dot(x, w, batched), xs, ws)
    dxs, _ = vjp(dys.astype(y.dtype))
    for i in range(2):
        q = quantize(ws[i], spec, amax=jnp.max(jnp.abs(ws)).astype(jnp.float32))
        assert_same_bytes(
            dxs[i], gemm(quantize(dys[i], amax=jnp.max(jnp.abs(dys)).astype(jnp.float32)), q, x.dtype, impl=impl)
        )
