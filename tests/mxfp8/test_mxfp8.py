"""MXFP8 (``jax_nvfp4.mxfp8``): the quantization against an independent float64 model (every value and scale byte),
its edge values, the GEMMs of a training step against float64 sums of the model's operands, ``lax.scaled_dot``
against the emulation, and MXFP8 as a layer's choice (rules, linen, NNX) and its errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, examples
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import mxfp8

E4M3 = ml_dtypes.float8_e4m3fn
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def model_quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """float64 model: (E4M3 values [..., Lp], E8M0 bytes [..., Lp / 32]) of x along its last axis."""
    x = np.asarray(x, np.float64)
    pad = -x.shape[-1] % 32
    x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)  # NaN where a block holds one
    scales = np.full(amax.shape, 0xFF, np.int64)
    values = np.full(blocks.shape, np.nan)
    for idx in np.ndindex(amax.shape):
        a = amax[idx]
        if not np.isfinite(a):
            continue
        e = -127
        if a > 0:
            m, ex = math.frexp(a / 448.0)  # a / 448 = m 2^ex, m in [0.5, 1): the smallest e with 2^e >= a / 448
            e = max(ex - 1 if m == 0.5 else ex, -127)
        scales[idx] = e + 127
        values[idx] = blocks[idx] / 2.0**e  # exact: |.| <= 448
    return values.reshape(x.shape).astype(np.float32).astype(E4M3), scales.astype(np.uint8)


def model_dequantize(values, scales) -> np.ndarray:
    v = np.asarray(values).astype(np.float64).reshape(*scales.shape, 32)
    e = np.where(scales == 0xFF, np.nan, 2.0 ** (scales.astype(np.float64) - 127))
    return (v * e[..., None]).reshape(values.shape)


@st.composite
def mx_inputs(draw):
    """Rows of values spread over 2^-40..2^40 (float16: its own range), some blocks all zero."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 100)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = 10 if dtype == jnp.float16 else 40
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-spread, spread, (shape[0], 1))
    x[:, :32] *= draw(st.sampled_from([0.0, 1.0]))
    return jnp.asarray(x, dtype)


@given(x=mx_inputs())
@settings(max_examples=examples(60), deadline=None)
def test_quantize_matches_the_float64_model(x):
    got = jax.jit(mxfp8.quantize)(x)
    values, scales = model_quantize(np.asarray(x, np.float64))
    assert_same_bytes(got.scales, scales, "scales")
    assert_same_bytes(got.values, values, "values")
    np.testing.assert_array_equal(np.asarray(mxfp8.dequantize(got)), model_dequantize(values, scales))


def test_edge_values():
    """Zeros: the smallest scale (2^-127). NaN or inf in a block: the NaN scale (0xFF), the block dequantizes to
    NaN and the others are untouched. A block max of exactly 448 * 2^j takes 2^j, the next float above it 2^(j + 1).
    The largest float32 takes 2^120 and rounds to E4M3 256, so it dequantizes to 2^128: inf, as the format has it."""
    big = np.float32(np.finfo(np.float32).max)
    above = np.nextafter(np.float32(448 * 2.0**-3), np.float32(np.inf))
    rows = np.zeros((6, 64), np.float32)
    rows[1, 5], rows[2, 40] = np.nan, np.inf
    rows[3, :2] = [448 * 2.0**-3, 1.0]
    rows[4, :2] = [above, 1.0]
    rows[5, 0] = -big
    t = jax.jit(mxfp8.quantize)(jnp.asarray(rows))
    scales = np.asarray(t.scales)
    assert scales.tolist() == [[0, 0], [0xFF, 0], [0, 0xFF], [124, 0], [125, 0], [247, 0]]
    y = np.asarray(mxfp8.dequantize(t))
    assert np.isnan(y[1, :32]).all() and (y[1, 32:] == 0).all() and np.isnan(y[2, 32:]).all()
    assert y[3, 0] == y[4, 0] == 448 * 2.0**-3 and y[5, 0] == -np.inf  # 224.00002 (2^-2) rounds to 224


def _gemm_operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 40)) * 4, dtype)  # batch, two row axes, K = 40
    w = jnp.asarray(rng.standard_normal((2, 40, 24)) * 0.1, dtype)  # batch, K, N
    dy = jnp.asarray(rng.standard_normal((2, 3, 5, 24)), jnp.float32)
    return x, w, dy


DIMS = (((3,), (1,)), ((0,), (0,)))


def _model_gemm(a, c) -> tuple[np.ndarray, np.ndarray]:
    """float64 sum over the last axis of a [B, R, L] and c [B, S, L], each quantized along L, and the sum of the
    products' magnitudes (for float32 accumulation's error bound)."""
    da = model_dequantize(*model_quantize(a))
    dc = model_dequantize(*model_quantize(c))
    return np.einsum("brl,bsl->brs", da, dc), np.einsum("brl,bsl->brs", np.abs(da), np.abs(dc))


def _assert_within_float32_sums(got, want, magnitude, length):
    """float32 accumulation of ``length`` terms, then the cast to ``got``'s dtype (half a unit in its last place)."""
    cast = {np.dtype(np.float32): 0.0, np.dtype(ml_dtypes.bfloat16): 2.0**-8}[np.asarray(got).dtype]
    bound = length * 2.0**-24 * magnitude * (1 + cast) + cast * np.abs(want) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_training_gemms_match_the_float64_model(dtype):
    """y = x . W^T (x, W along K), dx = dy . W (dy, W along N), dW = dy^T . x (dy, x along the tokens): each a
    float64 sum of the model's quantized operands, within float32 accumulation's error."""
    x, w, dy = _gemm_operands(dtype)

    def f(x, w):
        return jax_nvfp4.dot_general(x, w, DIMS, preferred_element_type=jnp.float32, recipe=jax_nvfp4.MXFP8())

    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(dy)
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    xr = x64.reshape(2, 15, 40)  # [B, M, K]
    wt = np.swapaxes(w64, 1, 2)  # W^T [B, N, K]
    dyr = dy64.reshape(2, 15, 24)  # [B, M, N]
    want, mag = _model_gemm(xr, wt)
    _assert_within_float32_sums(np.asarray(y).reshape(2, 15, 24), want, mag, 40)
    want, mag = _model_gemm(dyr, np.swapaxes(wt, 1, 2))  # dy [B, M, N] . W [B, K, N]
    assert dx.dtype == dtype and dw.dtype == dtype
    _assert_within_float32_sums(np.asarray(dx).reshape(2, 15, 40), want, mag, 24)
    want, mag = _model_gemm(np.swapaxes(dyr, 1, 2), np.swapaxes(xr, 1, 2))  # dy^T [B, N, M] . x^T [B, K, M]
    # dW [B, K, N] as the kernel's layout
    _assert_within_float32_sums(np.swapaxes(np.asarray(dw), 1, 2), want, mag, 15)


def test_scaled_dot_gives_the_emulated_sums():
    """``MXFP8(impl="scaled_dot")``: ``lax.scaled_dot`` on the E4M3 values and E8M0 scales (decomposed by XLA on the
    CPU) gives the emulation's outputs and gradients, bit for bit."""
    x, w, dy = _gemm_operands(jnp.bfloat16, seed=1)
    outs = []
    for impl in ("emulated", "scaled_dot"):
        recipe = jax_nvfp4.MXFP8(impl=impl)
        y, vjp = jax.vjp(lambda x, w: jax_nvfp4.dot_general(x, w, DIMS, recipe=recipe), x, w)  # noqa: B023
        outs.append((y, *vjp(dy.astype(y.dtype))))
    for a, b in zip(*outs, strict=True):
        assert_same_bytes(a, b)


def test_a_layer_in_mxfp8_by_a_rule():
    """A rule maps one layer to MXFP8 and another to NVFP4 (linen and NNX): the MXFP8 layer's output is
    ``dot_general`` with ``MXFP8()``, and it runs no NVFP4 primitive; training steps take gradients."""
    import flax.linen as nn
    from flax import nnx

    from jax_nvfp4.flax import Rule, quantize_model
    from jax_nvfp4.flax.nnx import quantize_model as nnx_quantize_model

    rules = [Rule("up", jax_nvfp4.MXFP8()), Rule("down", jax_nvfp4.Recipe())]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 48)), jnp.bfloat16)

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, name="down")(jax.nn.gelu(nn.Dense(64, name="up")(x)))

    model = quantize_model(Linen(), rules)
    params = model.init(jax.random.key(0), x)["params"]
    up = jax_nvfp4.dot_general(x, params["up"]["kernel"], (((1,), (0,)), ((), ())), recipe=jax_nvfp4.MXFP8())
    _, seen = model.apply({"params": params}, x, capture_intermediates=True, mutable=["intermediates"])
    assert_same_bytes(seen["intermediates"]["up"]["__call__"][0], up + params["up"]["bias"])
    only_up = quantize_model(Linen(), rules[:1])
    jaxpr = str(jax.make_jaxpr(lambda p: only_up.apply({"params": p}, x))(params))
    assert "nvfp4_" not in jaxpr
    grads = jax.grad(lambda p: model.apply({"params": p}, x, rngs={"nvfp4": jax.random.key(1)}).sum())(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(48, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    net = nnx_quantize_model(Nnx(nnx.Rngs(0)), rules, rngs=nnx.Rngs(nvfp4=1))
    assert net.up.dot_general.recipe == jax_nvfp4.MXFP8() and net.up.dot_general.rngs is None
    want = jax_nvfp4.dot_general(x, net.up.kernel[...], (((1,), (0,)), ((), ())), recipe=jax_nvfp4.MXFP8())
    assert_same_bytes(net.up(x), (want + net.up.bias[...]).astype(want.dtype))
    grads = nnx.grad(lambda m: m(x).astype(jnp.float32).sum())(net)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_errors():
    x = jnp.ones((4, 32), jnp.bfloat16)
    w = jax_nvfp4.quantize_weight(jnp.ones((32, 16), jnp.bfloat16))
    with pytest.raises(TypeError, match="QuantizedWeight holds NVFP4 codes"):
        jax_nvfp4.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=jax_nvfp4.MXFP8())
    with pytest.raises(TypeError, match=r"ragged_dot.s recipe must be a jax_nvfp4\.Recipe, got MXFP8"):
        jax_nvfp4.ragged_dot(x, jnp.ones((2, 32, 16), jnp.bfloat16), jnp.array([2, 2]), recipe=jax_nvfp4.MXFP8())
    with pytest.raises(ValueError, match=r"MXFP8\.impl"):
        jax_nvfp4.MXFP8(impl="fast")
    for nvfp4_only in ("fused", "cudnn"):  # the NVFP4 GEMM's Pallas kernel and cuDNN call: no MXFP8 ones
        with pytest.raises(ValueError, match=r"MXFP8\.impl"):
            jax_nvfp4.MXFP8(impl=nvfp4_only)
    from jax_nvfp4.flax import Rule

    with pytest.raises(TypeError, match=r"a jax_nvfp4\.MXFP8 or None"):
        Rule("x", "mxfp8")
