"""QuantizeSpec: one static parameter, one validation, one mapping to the kernels (checked against the C++
header), one spelling per option."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_tensor

import jax_nvfp4
from jax_nvfp4 import QuantizeSpec, Recipe

FACTOR = {"rht_amax_factor": 2.0}
X = jax.random.normal(jax.random.key(0), (32, 48), jnp.float32)


def test_the_quantize_primitive_carries_one_spec():
    spec = QuantizeSpec(columnwise=True, four_over_six_error="mse", e4m3_max=256)
    jaxpr = jax.make_jaxpr(lambda x: jax_nvfp4.quantize(x, spec))(X)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "nvfp4_quantize"]
    assert eqn.params == {"spec": spec}


def test_keywords_build_the_spec_the_tensor_records():
    t = jax_nvfp4.quantize(X, columnwise=True, block_2d=True)
    assert t.spec == QuantizeSpec(columnwise=True, block_2d=True)
    assert_same_tensor(jax_nvfp4.quantize(X, t.spec), t)
    keyed = jax_nvfp4.quantize(X, rng_key=jax.random.key(1))
    assert keyed.spec.stochastic_rounding


def test_spec_is_hashable_and_normalises_numpy_values():
    a = QuantizeSpec(block_2d=np.bool_(True), four_over_six_error=np.str_("mae"), e4m3_max=np.int64(256))
    b = QuantizeSpec(block_2d=True, four_over_six_error="mae", e4m3_max=256)
    assert a == b and hash(a) == hash(b) and type(a.e4m3_max) is int
    assert QuantizeSpec(amax_mesh_axes="fsdp").amax_mesh_axes == ("fsdp",)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rowwise": False}, "rowwise=True or columnwise=True"),
        ({"rht": True}, "rht applies to the columnwise copy"),
        ({"rht_amax_factor": 2.0}, "only with rht"),
        ({"row_scaled": True, "block_2d": True}, "1x16 blocks only"),
        ({"four_over_six_error": "mse", "stochastic_rounding": True}, "no stochastic rounding"),
        ({"four_over_six_fast_math": True}, "four_over_six_fast_math applies only with 4over6"),
        ({"e4m3_max": 256}, "e4m3_max=256 applies only with 4over6"),
    ],
)
def test_validate_is_where_combinations_fail(fields, match):
    with pytest.raises(ValueError, match=match):
        QuantizeSpec(**fields)
    with pytest.raises(ValueError, match=match):  # replace() validates too
        dataclasses.replace(QuantizeSpec(), **fields)


def _cpp_quantize_spec() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(type, name) of each member of ffi/nvfp4/spec.h's QuantizeSpec, as declared and as its attributes decode."""
    header = (pathlib.Path(__file__).resolve().parents[2] / "ffi" / "nvfp4" / "spec.h").read_text()
    body = re.search(r"struct QuantizeSpec \{(.*?)\n\n", header, re.S).group(1)
    declared = re.findall(r"^\s*(bool|int32_t) (\w+);", body, re.M)
    decoding = re.search(r"ATTR_DECODING\(nvfp4::QuantizeSpec,(.*?)\);", header, re.S).group(1)
    return declared, re.findall(r'StructMember<(\w+)>\("(\w+)"\)', decoding)


def test_kernel_attrs_are_the_fields_the_cpp_spec_decodes():
    declared, decoded = _cpp_quantize_spec()
    assert len(declared) >= 9 and declared == decoded  # the struct's members are what its decoding names
    attrs = QuantizeSpec(columnwise=True, four_over_six_error="mse", e4m3_max=256).kernel_attrs()
    cpp_type = {bool: "bool", np.int32: "int32_t"}
    assert [(cpp_type[type(v)], k) for k, v in attrs.items()] == declared
    assert attrs["four_over_six_error"] == 2 and attrs["e4m3_max"] == 256


def test_quantize_takes_a_spec_or_keywords_not_both():
    with pytest.raises(TypeError, match="not both"):
        jax_nvfp4.quantize(X, QuantizeSpec(), columnwise=True)
    with pytest.raises(TypeError, match="QuantizeSpec"):
        jax_nvfp4.quantize(X, "columnwise")
    with pytest.raises(TypeError, match="unexpected keyword"):
        jax_nvfp4.quantize(X, colwise=True)


def test_the_key_goes_with_stochastic_rounding():
    with pytest.raises(ValueError, match="needs rng_key"):
        jax_nvfp4.quantize(X, QuantizeSpec(stochastic_rounding=True))
    with pytest.raises(ValueError, match="stochastic_rounding=False"):
        jax_nvfp4.quantize(X, QuantizeSpec(), rng_key=jax.random.key(0))


@pytest.mark.parametrize(
    "old",
    [{"four_over_six": "mse"}, {"rht_amax_estimate": 2.0}, {"stochastic_rounding_key": jax.random.key(3)}],
    ids=lambda old: next(iter(old)),
)
def test_quantize_refuses_keywords_it_does_not_have(old):
    # One spelling per option: the pre-0.1 aliases are gone, and an unknown keyword is an error, not ignored.
    with pytest.raises(TypeError, match=next(iter(old))):
        jax_nvfp4.quantize(X, **old)


def test_amax_and_recipe_refuse_keywords_they_do_not_have():
    with pytest.raises(TypeError, match="mesh_axes"):
        jax_nvfp4.amax(X, mesh_axes=("x",))
    for old in ({"four_over_six_e4m3_max": 448}, {"e4m3_max": 256}, {"four_over_six_error": "mse"}):
        with pytest.raises(TypeError, match=next(iter(old))):
            Recipe(**old)
    with pytest.raises(TypeError, match="FourOverSix"):
        Recipe(four_over_six="weights")


def test_recipe_hands_each_operand_its_spec():
    recipe = Recipe(four_over_six=jax_nvfp4.FourOverSix("weights"), stochastic_rounding=True, row_scaled_gradients=True)
    w = recipe.spec("w", columnwise=True, tokens=64)
    assert w == QuantizeSpec(columnwise=True, block_2d=True, four_over_six_error="mse", e4m3_max=256)
    dy = recipe.spec("dy", columnwise=True, tokens=64)
    assert (dy.rht, dy.stochastic_rounding, dy.row_scaled, dy.four_over_six_error) == (True, True, True, None)
    # The transform needs whole chunks of 16 tokens, and a columnwise copy.
    assert not recipe.spec("dy", columnwise=True, tokens=40).rht
    assert not recipe.spec("x", columnwise=False, tokens=64).rht
    estimated = dataclasses.replace(recipe, rht_amax_estimate=True).spec("x", columnwise=True, tokens=64)
    assert estimated.rht_amax_factor == recipe.rht_amax_factor_x


def test_the_decoded_views_say_what_the_options_mean():
    from jax_nvfp4.core.spec import GlobalScale

    per_row, fos = QuantizeSpec(row_scaled=True), QuantizeSpec(four_over_six_error="mse", e4m3_max=256)
    assert (QuantizeSpec().global_scale, per_row.global_scale) == (GlobalScale(False, 448), GlobalScale(True, 448))
    assert QuantizeSpec().global_scale.plain and not per_row.global_scale.plain and not fos.global_scale.plain
    assert (QuantizeSpec().block_shape, QuantizeSpec(block_2d=True).block_shape) == ((1, 16), (16, 16))
    assert QuantizeSpec(block_2d=True).transposable and not QuantizeSpec(columnwise=True).transposable
    assert QuantizeSpec(rowwise=False, columnwise=True).blocked_cols is False
    assert (fos.four_over_six_choice, QuantizeSpec().four_over_six_choice) == (("mse", False), None)
    # The rowwise copy's spec drops the transform and its factor (which alone would not validate).
    transformed = QuantizeSpec(columnwise=True, rht=True, **FACTOR)
    assert transformed.rowwise_only() == QuantizeSpec()
    with pytest.raises(ValueError, match="grouped quantize makes a columnwise copy in 1x16 blocks"):
        QuantizeSpec(columnwise=True, block_2d=True).check_grouped()


def test_the_seed_comes_from_the_key_where_the_spec_draws_random_words():
    key = jax.random.key(3)
    assert (QuantizeSpec().seed(None) == 0).all() and (QuantizeSpec().seed(key) == 0).all()
    rounded = QuantizeSpec(stochastic_rounding=True)
    assert rounded.draws_random and (rounded.seed(key) == jax.random.bits(key, (2,), jnp.uint32)).all()
    with pytest.raises(ValueError, match="needs row_key="):
        rounded.seed(None, "row_key")


def test_a_tensors_spec_fields_read_from_the_tensor_warn():
    t = jax_nvfp4.quantize(X, block_2d=True)
    with pytest.warns(DeprecationWarning, match=r"NVFP4Tensor.block_2d is deprecated.*t.spec.block_2d"):
        assert t.block_2d is True
    with pytest.raises(AttributeError, match="no attribute 'blocks'"):
        t.blocks  # noqa: B018
