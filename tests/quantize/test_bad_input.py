"""Bad input a user meets (issue 38): a given amax, differentiating the quantizer, amax_mesh_axes; and
``fake_quantize``, the straight-through fake quantization the gradient error points to.

Each error names what is wrong; where a value is traced and cannot be read, what it does is what
docs/quantization.md ("What bad input does") says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, IMPLEMENTATIONS, IMPLS, assert_same_bytes, needs_8_cpus, raw_bytes
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4

X = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)
DIMS = (((1,), (0,)), ((), ()))
NO_DERIVATIVE = r"has no derivative: .*jax_nvfp4\.dot_general.*jax_nvfp4\.fake_quantize"

# ---- a given amax ----

BAD_AMAXES = {
    "negative": -1.0,
    "nan": float("nan"),
    "negative zero": -0.0,
    "numpy negative": np.float32(-2.0),
    "array nan": jnp.array(jnp.nan),
}


@IMPLS
@pytest.mark.parametrize("value", list(BAD_AMAXES.values()), ids=list(BAD_AMAXES))
def test_a_concrete_negative_or_nan_amax_is_refused(impl, value):
    with pytest.raises(ValueError, match=r"amax must be >= 0 and not NaN \(it stands for max\|x\|\), got"):
        impl.quantize(X, amax=value)
    with pytest.raises(ValueError, match="amax must be >= 0"):
        impl.fake_quantize(X, amax=value)
    # A Python constant is concrete under jit too (fake_quantize checks it before its custom JVP traces it).
    for f in (impl.quantize, impl.fake_quantize):
        with pytest.raises(ValueError, match="amax must be >= 0"):
            jax.jit(lambda x, f=f: f(x, amax=value))(X)


def test_the_error_says_why_negative_zero_and_which_row():
    with pytest.raises(ValueError, match=r"got -0\.0 \(negative zero: its sign bit would reach the block scales"):
        jax_nvfp4.quantize(X, amax=-0.0)
    rows = jnp.ones(32).at[5].set(jnp.nan)
    with pytest.raises(ValueError, match=r"got nan at index \(5,\)"):
        jax_nvfp4.quantize(X, row_scaled=True, amax=rows)


@IMPLS
def test_inf_and_zero_amaxes_do_what_a_computed_one_does(impl):
    # +inf, the amax of a tensor holding an inf: nothing dequantizes to a finite value.
    assert not np.isfinite(np.asarray(impl.dequantize(impl.quantize(X, amax=jnp.inf)))).any()
    # 0, the amax of an all-zero tensor: saturated codes (0x7 / 0xF) and scales (448), everything dequantizes to 0.
    t = impl.quantize(X, amax=0.0)
    assert set(np.unique(np.asarray(t.data))) <= {0x77, 0x7F, 0xF7, 0xFF}
    assert (np.asarray(t.scale.astype(jnp.float32)) == 448).all()
    assert not np.asarray(impl.dequantize(t)).any()


@IMPLS
def test_a_traced_amax_is_not_checked_and_quantizes_as_documented(impl):
    quantize = jax.jit(lambda x, a: impl.quantize(x, amax=a))
    assert np.isnan(np.asarray(impl.dequantize(quantize(X, jnp.nan)))).all()
    t = quantize(X, jnp.float32(-1.0))
    assert np.signbit(np.asarray(t.scale.astype(jnp.float32))).all()  # negative block scales
    # fake_quantize passes a traced amax to quantize alike.
    fq = jax.jit(lambda x, a: impl.fake_quantize(x, amax=a))
    assert np.isnan(np.asarray(fq(X, jnp.nan))).all()


# ---- differentiating the quantizer ----


def _dequantized(impl, x):
    return impl.dequantize(impl.quantize(x)).sum()


def _with_amax(impl, a):
    return impl.dequantize(impl.quantize(X, amax=a)).sum()


def _dequantize_amax(impl, a):
    t = impl.quantize(X)
    fields = {f: getattr(t, f) for f in ("data", "scale", "data_t", "scale_t", "amax_t", "shape", "dtype", "spec")}
    return impl.dequantize(jax_nvfp4.NVFP4Tensor(amax=a, **fields)).sum()


FUNCTIONS = {
    "quantize": (_dequantized, X),
    "quantize given amax": (_with_amax, jnp.float32(3.0)),
    "dequantize": (_dequantize_amax, jnp.float32(3.0)),
    "amax": (lambda impl, x: impl.amax(x), X),
}
TRANSFORMS = {
    "grad": lambda f, x: jax.grad(f)(x),
    "jit grad": lambda f, x: jax.jit(jax.grad(f))(x),
    "vjp": lambda f, x: jax.vjp(f, x),
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    "linearize": lambda f, x: jax.linearize(f, x),
}


@IMPLS
@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_differentiating_the_quantizer_points_to_dot_general_and_fake_quantize(impl, function, transform):
    f, x = FUNCTIONS[function]
    with pytest.raises(TypeError, match=NO_DERIVATIVE):
        TRANSFORMS[transform](functools.partial(f, impl), x)


def test_values_without_a_tangent_still_quantize_under_grad():
    """The rules run only where a tangent reaches the op: through stop_gradient, and inside dot_general's VJP."""

    def loss(x):
        return jnp.sum(jax_nvfp4.dequantize(jax_nvfp4.quantize(jax.lax.stop_gradient(x))) * x)

    np.testing.assert_array_equal(jax.grad(loss)(X), jax_nvfp4.dequantize(jax_nvfp4.quantize(X)))
    w = X[:, :16]
    dx = jax.grad(lambda x: jax_nvfp4.dot_general(x.T, w, DIMS, rng_key=jax.random.key(1)).sum())(X)
    assert dx.shape == X.shape and np.isfinite(np.asarray(dx)).all()


# ---- fake_quantize ----

FAKE_SPECS = {
    "rowwise": {},
    "columnwise": {"rowwise": False, "columnwise": True},
    "16x16": {"block_2d": True},
    "row-scaled": {"row_scaled": True},
    "4over6": {"four_over_six_error": "mse", "e4m3_max": 256},
    "stochastic": {"rng_key": jax.random.key(3)},
}


# The kernels in every dtype; the reference's frontend (three compiles of its bit-level program a case) in one.
FAKE_RUNS = [(jax_nvfp4, d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)] + [(jax_nvfp4.reference, jnp.bfloat16)]


@pytest.mark.parametrize(
    ("impl", "dtype"),
    FAKE_RUNS,
    ids=[f"{'kernel' if i is jax_nvfp4 else 'reference'}-{jnp.dtype(d).name}" for i, d in FAKE_RUNS],
)
@pytest.mark.parametrize("options", list(FAKE_SPECS.values()), ids=list(FAKE_SPECS))
def test_fake_quantize_is_dequantize_of_quantize_bit_for_bit(impl, dtype, options):
    x = (X * 3).astype(dtype)
    want = impl.dequantize(impl.quantize(x, **options), dtype=dtype, columnwise=not options.get("rowwise", True))
    assert_same_bytes(impl.fake_quantize(x, **options), want)
    assert_same_bytes(jax.jit(functools.partial(impl.fake_quantize, **options))(x), want)


def test_fake_quantize_takes_a_spec_and_the_reference_agrees():
    spec = jax_nvfp4.QuantizeSpec(block_2d=True)
    x = X.astype(jnp.bfloat16)
    assert_same_bytes(jax_nvfp4.fake_quantize(x, spec), jax_nvfp4.fake_quantize(x, block_2d=True))
    assert_same_bytes(jax_nvfp4.reference.fake_quantize(x, spec), jax_nvfp4.fake_quantize(x, spec))


@pytest.mark.parametrize("amax", [None, 0.5], ids=["computed amax", "clipping amax"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fake_quantize_gradient_is_the_cotangent_exactly(amax, dtype):
    """Straight through, not masked: with amax 0.5 most of X clips, and its gradient still passes."""
    x = X.astype(dtype)
    dy = jax.random.normal(jax.random.key(4), x.shape, dtype)
    fq = functools.partial(jax_nvfp4.fake_quantize, amax=amax)
    y, vjp = jax.vjp(fq, x)
    assert_same_bytes(vjp(dy)[0], dy)
    assert_same_bytes(jax.jit(jax.grad(lambda x: jnp.vdot(fq(x), dy)))(x), dy)
    y_jvp, tangent = jax.jvp(fq, (x,), (dy,))
    assert_same_bytes(tangent, dy)
    assert_same_bytes(y_jvp, y)
    if amax is not None:  # amax is a constant of the quantization: no gradient
        assert float(jax.grad(lambda a: jnp.sum(jax_nvfp4.fake_quantize(x, amax=a)))(jnp.float32(amax))) == 0.0


def test_fake_quantize_under_vmap_and_with_an_amax_computed_from_x():
    x = X.astype(jnp.bfloat16)
    assert_same_bytes(jax.vmap(jax_nvfp4.fake_quantize)(x[None])[0], jax_nvfp4.fake_quantize(x))
    # An amax traced from x takes no part in the gradient: x's is the cotangent alone.
    dx = jax.grad(lambda x: jnp.sum(jax_nvfp4.fake_quantize(x, amax=jnp.max(jnp.abs(x))).astype(jnp.float32)))(x)
    assert (np.asarray(dx, np.float32) == 1).all()


def test_fake_quantize_errors():
    with pytest.raises(ValueError, match="fake_quantize returns one quantization of x"):
        jax_nvfp4.fake_quantize(X, columnwise=True)
    with pytest.raises(ValueError, match=r"stochastic_rounding=True needs rng_key= \(a JAX PRNG key\)"):
        jax_nvfp4.fake_quantize(X, stochastic_rounding=True)
    with pytest.raises(ValueError, match="Random Hadamard Transform"):
        jax_nvfp4.fake_quantize(X, rowwise=False, columnwise=True, rht=True)
    with pytest.raises(TypeError, match="amax must be an array of real numbers"):
        jax_nvfp4.fake_quantize(X, amax="3")


# ---- amax_mesh_axes ----

NO_MESH = r"amax_mesh_axes=\('nope',\) names mesh axes, but there is no mesh here \(mesh axes: none\)"
NOT_IN_MESH = r"amax_mesh_axes=\('nope',\): the mesh has no axis 'nope' \(its axes: \('x', 'y'\)\)"


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
def test_amax_mesh_axes_outside_any_mesh_are_refused(impl):
    with pytest.raises(ValueError, match=NO_MESH):
        impl.amax(X, amax_mesh_axes=("nope",))
    with pytest.raises(ValueError, match=NO_MESH):
        impl.quantize(X, amax_mesh_axes="nope")
    with pytest.raises(ValueError, match=NO_MESH):
        impl.quantize(X, jax_nvfp4.QuantizeSpec(amax_mesh_axes=("nope",)))


def test_recipe_amax_mesh_axes_outside_any_mesh_are_refused():
    recipe = jax_nvfp4.Recipe(amax_mesh_axes=("nope",))
    with pytest.raises(ValueError, match=r"Recipe\.amax_mesh_axes=\('nope',\) names mesh axes, but there is no mesh"):
        jax_nvfp4.dot_general(X, X.T, DIMS, recipe=recipe, rng_key=jax.random.key(0))


def _mesh_2x4() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("x", "y"), devices=CPUS[:8], axis_types=(AxisType.Auto,) * 2)


@needs_8_cpus
def test_amax_mesh_axes_the_mesh_lacks_are_named_with_the_mesh_axes():
    mesh = _mesh_2x4()
    xs = jax.device_put(X, NamedSharding(mesh, P("x", "y")))
    scoped = functools.partial(jax_nvfp4.amax, amax_mesh_axes=("nope",))
    with pytest.raises(ValueError, match=NOT_IN_MESH):  # a concrete x sharded over the mesh
        scoped(xs)
    with pytest.raises(ValueError, match=NOT_IN_MESH):  # traced, its sharding in its type
        jax.jit(functools.partial(jax_nvfp4.quantize, amax_mesh_axes=("nope",)))(xs)
    with pytest.raises(ValueError, match=NOT_IN_MESH):
        jax.shard_map(lambda x: scoped(x)[None], mesh=mesh, in_specs=P("x"), out_specs=P("x"))(X)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=NOT_IN_MESH):
            scoped(X)
        with pytest.raises(ValueError, match=NOT_IN_MESH):
            jax.jit(scoped)(X)
        recipe = jax_nvfp4.Recipe(amax_mesh_axes=("nope",))
        with pytest.raises(ValueError, match=r"Recipe\.amax_mesh_axes=\('nope',\): the mesh has no axis 'nope'"):
            jax.jit(lambda x: jax_nvfp4.dot_general(x, x.T, DIMS, recipe=recipe, rng_key=jax.random.key(0)))(X)
    # Known only when XLA partitions the program: the same message, from the partitioner.
    with pytest.raises(jax.errors.JaxRuntimeError, match=NOT_IN_MESH):
        jax.jit(scoped, in_shardings=NamedSharding(mesh, P("x", "y")))(X)


@needs_8_cpus
def test_amax_mesh_axes_the_mesh_has_still_scope_the_amax():
    """The check leaves known axes alone: in shard_map (where each shard's amax is its own) and where the mesh is
    known only when partitioning (reduced over both axes: the whole tensor's)."""
    mesh = _mesh_2x4()
    x = X.at[0, 0].set(100.0)
    local = jax.shard_map(
        lambda x: jax_nvfp4.amax(x, amax_mesh_axes=("x",))[None], mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )(x)
    np.testing.assert_array_equal(local, [100.0, float(jnp.max(jnp.abs(X[16:])))])
    scoped = functools.partial(jax_nvfp4.amax, amax_mesh_axes=("x", "y"))
    scoped = jax.jit(scoped, in_shardings=NamedSharding(mesh, P("x", "y")))
    assert_same_bytes(raw_bytes(scoped(x)), raw_bytes(jax_nvfp4.amax(x)))
