"""Every public option is checked in Python, with an error that names it, before anything reaches the FFI."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IMPLS

import jax_nvfp4

X = jnp.ones((32, 32), jnp.float32)
DIMS = (((1,), (0,)), ((), ()))

NOT_A_BOOL = ("yes", 1, None, np.array(True))

QUANTIZE_BAD = [
    *[
        (flag, bad, TypeError)
        for flag in ("rowwise", "columnwise", "block_2d", "rht", "row_scaled")
        for bad in NOT_A_BOOL
    ],
    ("four_over_six_fast_math", "fast", TypeError),
    ("four_over_six_error", "max", ValueError),
    ("four_over_six_error", ["mse"], ValueError),
    ("four_over_six_error", 1, ValueError),
    ("e4m3_max", 256.0, ValueError),
    ("e4m3_max", "448", ValueError),
    ("e4m3_max", True, ValueError),
    ("rht_amax_factor", True, ValueError),
    ("rht_amax_factor", "2", ValueError),
    ("rht_amax_factor", float("nan"), ValueError),
    ("rng_key", 3, TypeError),
    ("rng_key", jnp.zeros(3, jnp.uint32), TypeError),
    ("amax", "3", TypeError),
    ("amax", True, TypeError),
    ("amax", jnp.ones(3), ValueError),
    ("amax_mesh_axes", [1], TypeError),
]
# Options that only mean something beside others: the valid rest of the call.
CONTEXT = {
    "e4m3_max": {"four_over_six_error": "mse"},
    "rht_amax_factor": {"columnwise": True, "rht": True},
    "four_over_six_fast_math": {"four_over_six_error": "mse"},
}


def _raises(exc, option: str):
    """pytest.raises for ``exc`` whose message names ``option`` (as a word)."""
    return pytest.raises(exc, match=rf"(^|\W){re.escape(option)}\W")


@IMPLS
@pytest.mark.parametrize(("option", "bad", "exc"), QUANTIZE_BAD, ids=lambda v: repr(v)[:20])
def test_quantize_names_the_bad_option(impl, option, bad, exc):
    with _raises(exc, option):
        impl.quantize(X, **{**CONTEXT.get(option, {}), option: bad})


def test_a_bad_flag_fails_in_python_not_at_the_ffi_boundary():
    # It used to reach the kernel: "INVALID_ARGUMENT: Failed to decode all FFI handler operands".
    with pytest.raises(TypeError, match="block_2d must be a bool"):
        jax.jit(lambda x: jax_nvfp4.quantize(x, block_2d="yes"))(X)


def test_numpy_scalars_are_accepted_as_their_python_values():
    t = jax_nvfp4.quantize(X, block_2d=np.bool_(True), four_over_six_error=np.str_("mse"), e4m3_max=np.int64(256))
    assert t.spec.block_2d is True and t.spec.e4m3_max == 256 and type(t.spec.e4m3_max) is int
    plain = jax_nvfp4.quantize(X, block_2d=True, four_over_six_error="mse", e4m3_max=256)
    assert np.asarray(t.data).tobytes() == np.asarray(plain.data).tobytes()


@IMPLS
@pytest.mark.parametrize(
    ("kwargs", "exc", "option"),
    [
        ({"dtype": "float64x"}, TypeError, "dtype"),
        ({"dtype": jnp.int32}, TypeError, "dtype"),
        ({"columnwise": "yes"}, TypeError, "columnwise"),
    ],
)
def test_dequantize_names_the_bad_option(impl, kwargs, exc, option):
    t = impl.quantize(X, columnwise=True)
    with _raises(exc, option):
        impl.dequantize(t, **kwargs)


@IMPLS
def test_dequantize_takes_a_quantized_tensor(impl):
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        impl.dequantize(X)


@IMPLS
@pytest.mark.parametrize(
    ("kwargs", "exc", "option"),
    [
        ({"row_scaled": "yes"}, TypeError, "row_scaled"),
        ({"amax_mesh_axes": 3}, TypeError, "amax_mesh_axes must be mesh axis names"),
    ],
)
def test_amax_names_the_bad_option(impl, kwargs, exc, option):
    with pytest.raises(exc, match=option):
        impl.amax(X, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((X, "q"), {}, TypeError, "gemm's a must be an NVFP4Tensor"),
        (("q", X), {}, TypeError, "gemm's b_t must be an NVFP4Tensor"),
        (("q", "q"), {"out_dtype": jnp.int32}, TypeError, "out_dtype is int32"),
        (("q", "q"), {"out_dtype": "bf16x"}, TypeError, "out_dtype is"),
        (("q", "q"), {"bias": "a"}, TypeError, "gemm's bias must be an array of real numbers"),
        (("q", "q"), {"bias": jnp.ones(5)}, ValueError, r"gemm's bias of shape \(5,\) does not broadcast"),
        (("q", "q"), {"bias": jnp.ones(32, jnp.complex64)}, TypeError, "gemm's bias"),
    ],
)
def test_gemm_names_the_bad_option(args, kwargs, exc, match):
    q = jax_nvfp4.quantize(X)
    args = [q if isinstance(a, str) and a == "q" else a for a in args]
    with pytest.raises(exc, match=match):
        jax_nvfp4.gemm(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "option"),
    [
        ({"recipe": "full"}, TypeError, "recipe"),
        ({"rng_key": 5}, TypeError, "rng_key"),
        ({"rng_key": jnp.zeros(3, jnp.uint32)}, TypeError, "rng_key"),
        ({"rng_key": jax.random.split(jax.random.key(0))}, ValueError, "rng_key"),
        ({"preferred_element_type": jnp.int8}, TypeError, "preferred_element_type"),
    ],
)
def test_dot_general_names_the_bad_option(kwargs, exc, option):
    with _raises(exc, option):
        jax_nvfp4.dot_general(X, X, DIMS, **kwargs)


RECIPE_BAD = [
    *[
        (flag, "yes", TypeError)
        for flag in (
            "weight_block_2d",
            "rht",
            "rht_amax_estimate",
            "stochastic_rounding",
            "row_scaled_activations",
            "row_scaled_gradients",
        )
    ],
    ("rht", 1, TypeError),
    ("rht_amax_factor_x", 0.0, ValueError),
    ("rht_amax_factor_x", True, ValueError),
    ("rht_amax_factor_dy", "1", ValueError),
    ("rht_amax_factor_dy", float("inf"), ValueError),
    ("amax_mesh_axes", (1, 2), TypeError),
    ("amax_mesh_axes", 3, TypeError),
    ("four_over_six", "weights", TypeError),
    ("impl", "cublas", ValueError),
    ("impl", None, ValueError),
]


@pytest.mark.parametrize(("field", "bad", "exc"), RECIPE_BAD, ids=lambda v: repr(v)[:24])
def test_recipe_names_the_bad_field(field, bad, exc):
    with _raises(exc, f"Recipe.{field}"):
        jax_nvfp4.Recipe(**{field: bad})


FOUR_OVER_SIX_BAD = [
    ("operands", "both", ValueError),
    ("operands", None, ValueError),
    ("error", "l1", ValueError),
    ("fast_math", 1, TypeError),
    ("e4m3_max", 256.0, ValueError),
    ("e4m3_max", 300, ValueError),
]


@pytest.mark.parametrize(("field", "bad", "exc"), FOUR_OVER_SIX_BAD, ids=lambda v: repr(v)[:24])
def test_four_over_six_names_the_bad_field(field, bad, exc):
    with _raises(exc, f"FourOverSix.{field}"):
        jax_nvfp4.FourOverSix(**{field: bad})


def test_recipe_normalises_numpy_values_to_python_ones():
    fos = jax_nvfp4.FourOverSix(np.str_("weights"), e4m3_max=np.int32(448), fast_math=np.bool_(True))
    r = jax_nvfp4.Recipe(rht=np.bool_(False), four_over_six=fos)
    want = jax_nvfp4.Recipe(rht=False, four_over_six=jax_nvfp4.FourOverSix("weights", e4m3_max=448, fast_math=True))
    assert r == want and hash(r) == hash(want)


def test_gemm_names_a_bad_impl():
    t = jax_nvfp4.quantize(X)
    with _raises(ValueError, "gemm's impl"):
        jax_nvfp4.gemm(t, t, impl="fp4")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [({"tiled": "yes"}, TypeError, "tiled must be a bool"), ({"axis": 1.5}, TypeError, "axis must be an int")],
)
def test_all_gather_names_the_bad_option(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jax_nvfp4.all_gather(jax_nvfp4.quantize(X), "x", **kwargs)
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        jax_nvfp4.all_gather(X, "x")
