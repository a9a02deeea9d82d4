"""Public API behaviour: layout, errors, NaN/Inf, round trip, jit/vmap/scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import IMPLS, assert_same_bytes, assert_same_tensor, canonical_zero_codes, random_tensor, unpack
from hypothesis import given
from hypothesis import strategies as st

import jax_nvfp4


def _x(shape=(40, 72), dtype=ml_dtypes.bfloat16, seed=0):
    return random_tensor(np.random.default_rng(seed), shape, dtype, spread=1, specials=(), frac=0)


@IMPLS
def test_layout_of_a_rank_3_input(impl):
    x = _x((3, 7, 40))  # M = 21 rows (padded to 32 for the columnwise copy)
    t = impl.quantize(x, columnwise=True)
    assert t.data.shape == (3, 7, 20) and t.data.dtype == np.uint8
    assert t.scale.shape == (3, 7, 3) and t.scale.dtype == jnp.float8_e4m3fn
    assert t.data_t.shape == (40, 11) and t.scale_t.shape == (40, 2)
    assert t.amax.shape == () and t.amax.dtype == jnp.float32
    assert (t.shape, t.dtype, t.rows, t.cols) == ((3, 7, 40), jnp.bfloat16, 21, 40)
    # Leading axes are flattened into rows: same bytes as the [21, 40] matrix.
    assert_same_tensor(impl.quantize(x.reshape(21, 40), columnwise=True), _reshaped(t, (21, 40)))


def _reshaped(t, shape):
    return jax_nvfp4.NVFP4Tensor(
        t.data.reshape(*shape[:-1], -1), t.scale.reshape(*shape[:-1], -1), t.amax,
        t.data_t, t.scale_t, t.amax_t, shape, t.dtype, t.spec,
    )  # fmt: skip


@IMPLS
def test_columnwise_copy_is_the_quantized_transpose(impl):
    x = _x((40, 72))
    t = impl.quantize(x, columnwise=True)
    tt = impl.quantize(x.T)
    assert_same_bytes(t.data_t, tt.data)
    assert_same_bytes(t.scale_t, tt.scale)


@IMPLS
def test_2d_columnwise_codes_are_the_transposed_rowwise_codes(impl):
    x = _x((40, 72))
    t = impl.quantize(x, columnwise=True, block_2d=True)
    np.testing.assert_array_equal(unpack(t.data_t)[:, :40], unpack(t.data)[:, :72].T)
    # One scale per 16x16 block, repeated on each of its rows / columns.
    s = np.asarray(t.scale).view(np.uint8)
    assert (s == np.repeat(s[::16], 16, axis=0)[:40]).all()


@IMPLS
def test_odd_sizes_keep_every_element(impl):
    x = _x((5, 33), np.float32)
    t = impl.quantize(x, columnwise=True)
    assert t.data.shape == (5, 17) and t.data_t.shape == (33, 3)
    assert (unpack(t.data)[:, 33] == 0).all()  # the padded nibble
    for columnwise in (False, True):
        y = np.asarray(impl.dequantize(t, columnwise=columnwise))
        assert y.shape == x.shape
        np.testing.assert_allclose(y, x, rtol=0.3, atol=0.25 * float(np.abs(x).max()))
        assert y[:, -1].any()  # the last column survived


@IMPLS
def test_ties_round_to_even(impl):
    # amax = 2688 makes the global scale 1 and a block holding 6 gets scale 1,
    # so the values reach the E2M1 rounding unchanged.
    row = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0]
    t = impl.quantize(jnp.asarray([row], jnp.float32), amax=2688.0)
    np.testing.assert_array_equal(unpack(t.data)[0], [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0])
    assert np.asarray(t.scale).view(np.uint8)[0, 0] == 0x38  # E4M3 1.0


@IMPLS
def test_nan_poisons_everything_deterministically(impl):
    x = np.asarray(_x((32, 32), np.float32))
    x[3, 5] = np.nan
    t = impl.quantize(x, columnwise=True)
    assert np.asarray(t.amax).view(np.uint32) == 0x7FC00000
    assert (np.asarray(t.scale).view(np.uint8) == 0xFF).all()
    assert (np.asarray(t.scale_t).view(np.uint8) == 0xFF).all()
    assert (np.asarray(t.data) == 0).all() and (np.asarray(t.data_t) == 0).all()
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert np.isnan(np.asarray(impl.dequantize(t, dtype), np.float32)).all()


@IMPLS
def test_nan_with_a_given_amax_poisons_only_its_block(impl):
    x = np.asarray(_x((16, 64), np.float32))
    x[2, 20] = np.nan  # block (row 2, columns 16..31)
    t = impl.quantize(x, amax=jnp.float32(np.nanmax(np.abs(x))))
    s = np.asarray(t.scale).view(np.uint8)
    assert s[2, 1] == 0xFF and (np.delete(s.ravel(), 2 * 4 + 1) != 0xFF).all()
    y = np.asarray(impl.dequantize(t))
    assert np.isnan(y[2, 16:32]).all() and not np.isnan(np.delete(y[2], range(16, 32))).any()


@IMPLS
def test_inf_saturates_its_block(impl):
    x = np.asarray(_x((16, 32), np.float32))
    x[0, 0], x[1, 17] = np.inf, -np.inf
    t = impl.quantize(x)
    assert np.isinf(t.amax)
    s = np.asarray(t.scale).view(np.uint8)
    assert s[0, 0] == 0x7E and s[1, 1] == 0x7E  # 448
    codes = unpack(t.data)
    assert codes[0, 0] == 7 and codes[1, 17] == 15
    y = np.asarray(impl.dequantize(t))
    # The decode scale amax/2688 is inf: nothing comes back finite (zeros give NaN).
    assert y[0, 0] == np.inf and y[1, 17] == -np.inf and not np.isfinite(y).any()


@IMPLS
def test_zeros(impl):
    t = impl.quantize(jnp.zeros((16, 32), jnp.bfloat16), columnwise=True, block_2d=True)
    assert float(t.amax) == 0 and not np.asarray(t.data).any() and not np.asarray(t.scale_t).view(np.uint8).any()
    assert not np.asarray(impl.dequantize(t)).any()


@given(st.integers(0, 2**32 - 1), st.sampled_from([(16, 64), (40, 72), (2, 24, 48)]), st.booleans())
def test_round_trip(seed, shape, block_2d):
    # Values within ~2 decades of each other: no block scale underflows or goes
    # E4M3-subnormal, where requantization may pick a different scale.
    x = random_tensor(np.random.default_rng(seed), shape, ml_dtypes.bfloat16, spread=1, specials=("zero",), frac=0.05)
    q = jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d)
    # Each copy round-trips through its own dequantization (1x16 row blocks and
    # column blocks differ); 16x16 blocks are shared, so both copies do.
    copies = {False: ("data", "scale"), True: ("data_t", "scale_t")}
    for columnwise, names in copies.items():
        r = jax_nvfp4.quantize(
            jax_nvfp4.dequantize(q, columnwise=columnwise), columnwise=True, block_2d=block_2d, amax=q.amax
        )
        checked = [*copies[False], *copies[True]] if block_2d else names
        for name in checked:
            got, want = getattr(r, name), getattr(q, name)
            if name.startswith("data"):
                got, want = canonical_zero_codes(got), canonical_zero_codes(want)
            assert_same_bytes(got, want)
        assert_same_bytes(r.amax, q.amax)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="rank >= 2"):
        jax_nvfp4.quantize(jnp.ones((32,)))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        jax_nvfp4.quantize(jnp.ones((16, 16), jnp.int32))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        jax_nvfp4.quantize(jnp.ones((16, 16), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="empty"):
        jax_nvfp4.quantize(jnp.ones((0, 16)))
    with pytest.raises(ValueError, match="rowwise=True or columnwise=True"):
        jax_nvfp4.quantize(jnp.ones((16, 16)), rowwise=False)
    with pytest.raises(ValueError, match="scalar"):
        jax_nvfp4.quantize(jnp.ones((16, 16)), amax=jnp.ones(2))
    t = jax_nvfp4.quantize(jnp.ones((16, 16)))
    with pytest.raises(TypeError, match="dequantize produces"):
        jax_nvfp4.dequantize(t, jnp.int8)
    with pytest.raises(ValueError, match="no columnwise copy"):
        jax_nvfp4.dequantize(t, columnwise=True)
    with pytest.raises(ValueError, match="no rowwise copy"):
        jax_nvfp4.dequantize(jax_nvfp4.quantize(jnp.ones((16, 16)), rowwise=False, columnwise=True))


def test_vmap_quantizes_each_entry_on_its_own():
    xs = np.stack([_x((20, 48), seed=s) * (10.0**s) for s in range(3)]).astype(ml_dtypes.bfloat16)
    batched = jax.jit(jax.vmap(lambda x: jax_nvfp4.quantize(x, columnwise=True, block_2d=True)))(xs)
    for i in range(3):
        single = jax_nvfp4.quantize(xs[i], columnwise=True, block_2d=True)
        assert_same_tensor(jax.tree.map(lambda a, i=i: a[i], batched), single)
    # Nested vmap, and dequantize under vmap.
    nested = jax.vmap(jax.vmap(lambda x: jax_nvfp4.dequantize(jax_nvfp4.quantize(x))))(xs[None])
    for i in range(3):
        assert_same_bytes(nested[0, i], jax_nvfp4.dequantize(jax_nvfp4.quantize(xs[i])))


def test_vmap_with_a_shared_amax():
    xs = np.stack([_x((16, 32), seed=s) for s in range(2)])
    amax = jnp.float32(10.0)
    batched = jax.vmap(lambda x: jax_nvfp4.quantize(x, amax=amax))(xs)
    for i in range(2):
        assert_same_tensor(jax.tree.map(lambda a, i=i: a[i], batched), jax_nvfp4.quantize(xs[i], amax=amax))


def test_scan_and_single_compilation_per_shape():
    traces = []

    @jax.jit
    def step(x):
        traces.append(x.shape)

        def body(carry, xi):
            t = jax_nvfp4.quantize(xi, columnwise=True)
            return carry + jax_nvfp4.dequantize(t).sum(), t.data

        return jax.lax.scan(body, jnp.float32(0), x)

    xs = np.stack([_x((16, 32), seed=s) for s in range(4)])
    total, datas = step(xs)
    step(xs * 2)  # same shape: no retrace
    assert len(traces) == 1
    for i in range(4):
        assert_same_bytes(datas[i], jax_nvfp4.quantize(xs[i]).data)
    expected = sum(float(jax_nvfp4.dequantize(jax_nvfp4.quantize(xs[i])).sum()) for i in range(4))
    np.testing.assert_allclose(float(total), expected, rtol=1e-6)
    step(np.stack([_x((32, 32), seed=s) for s in range(4)]))
    assert len(traces) == 2
