"""Every keyword the plain ops and layers take, taken by ours or refused with a clear error.

The signatures are read from the installed jax and Flax: ``lax.dot_general``, ``jnp.einsum``,
``lax.ragged_dot`` and the ``__call__`` of ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` and
``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Einsum``. A keyword that a new jax or Flax adds and that no probe
here covers fails the test that lists them, so a model calling a layer with it cannot meet an op of ours that
drops it silently. Each probe calls each of our ops with a value other than the default and checks what the
keyword is documented to do there: the same bytes (an ignored ``precision``), the result's dtype or sharding,
or the error that refuses it.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, assert_same_bytes, needs_8_cpus, normal
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4 import Recipe

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
from jax_nvfp4.flax import Rule, quantize_model  # noqa: E402
from jax_nvfp4.flax import nnx as nvfp4_nnx  # noqa: E402
from jax_nvfp4.flax.linen import NVFP4DotGeneral as LinenDotGeneral  # noqa: E402

pytestmark = needs_8_cpus
RTN = Recipe(stochastic_rounding=False)
DIMS = (((1,), (0,)), ((), ()))
X, W = normal((64, 128), 0, jnp.bfloat16), normal((128, 48), 1, jnp.bfloat16)


def _mesh_sharding(spec: P) -> NamedSharding:
    return NamedSharding(jax.make_mesh((4, 2), ("data", "model"), devices=CPUS[:8]), spec)


def _keywords(fn, operands: int) -> list[str]:
    """The parameters of ``fn`` after its first ``operands`` (self and the operands), but ``*args``/``**kwargs``."""
    params = list(inspect.signature(fn).parameters.values())[operands:]
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


# ---- The ops: lax.dot_general, jnp.einsum, lax.ragged_dot ---------------------------------------------------


def _dot_ops():
    """Ours in lax.dot_general's place, each as (name, f(lhs, rhs, dims, **kw))."""
    nnx_op = nvfp4_nnx.NVFP4DotGeneral(RTN)

    def linen(lhs, rhs, dims, **kw):
        return LinenDotGeneral(RTN).apply({}, lhs, rhs, dims, **kw)

    return [
        ("jax_nvfp4.dot_general", lambda *a, **kw: jax_nvfp4.dot_general(*a, recipe=RTN, **kw)),
        ("nnx.NVFP4DotGeneral", nnx_op),
        ("linen.NVFP4DotGeneral", linen),
    ]


def _probe_dot(op, keyword: str) -> None:
    plain = op(X, W, DIMS)
    if keyword == "precision":  # ignored: the GEMM is NVFP4 with float32 accumulation
        assert_same_bytes(op(X, W, DIMS, precision=lax.Precision.HIGHEST), plain)
    elif keyword == "preferred_element_type":
        y = op(X, W, DIMS, preferred_element_type=jnp.float32)
        assert y.dtype == jnp.float32
        assert_same_bytes(y.astype(jnp.bfloat16), plain)  # the same float32 sums, rounded once
    elif keyword == "out_sharding":
        sharding = _mesh_sharding(P("data", "model"))
        y = op(X, W, DIMS, out_sharding=sharding)
        assert y.sharding.is_equivalent_to(sharding, 2)
        assert_same_bytes(np.asarray(y), plain)
    else:
        raise AssertionError(f"no probe for lax.dot_general's keyword {keyword!r}")


DOT_KEYWORDS = ("precision", "preferred_element_type", "out_sharding")
EINSUM_KEYWORDS = ("out", "optimize", "precision", "preferred_element_type", "_dot_general", "out_sharding")
RAGGED_KEYWORDS = ("precision", "preferred_element_type", "group_offset", "out_sharding")


@pytest.mark.parametrize(
    ("plain", "operands", "probed"),
    [(lax.dot_general, 3, DOT_KEYWORDS), (jnp.einsum, 2, EINSUM_KEYWORDS), (lax.ragged_dot, 3, RAGGED_KEYWORDS)],
    ids=["lax.dot_general", "jnp.einsum", "lax.ragged_dot"],
)
def test_every_keyword_of_the_plain_ops_has_a_probe(plain, operands, probed):
    assert set(_keywords(plain, operands)) <= set(probed), (
        f"{plain.__name__} takes keywords no probe here covers: {sorted(set(_keywords(plain, operands)) - set(probed))}"
    )


@pytest.mark.parametrize("keyword", DOT_KEYWORDS)
@pytest.mark.parametrize("index", range(3), ids=[name for name, _ in _dot_ops()])
def test_dot_general_ops_take_every_keyword(index, keyword):
    _probe_dot(_dot_ops()[index][1], keyword)


def _einsum_ops():
    return [
        ("jax_nvfp4.einsum", lambda *a, **kw: jax_nvfp4.einsum(*a, recipe=RTN, **kw)),
        ("nnx.NVFP4Einsum", nvfp4_nnx.NVFP4Einsum(RTN)),
    ]


@pytest.mark.parametrize("keyword", EINSUM_KEYWORDS)
@pytest.mark.parametrize("index", range(2), ids=[name for name, _ in _einsum_ops()])
def test_einsum_ops_take_every_keyword(index, keyword):
    op = _einsum_ops()[index][1]
    # The output's axes in another order than dot_general's (batch, lhs free, rhs free): out_sharding is permuted.
    x, w, eq = normal((8, 16, 64), 2, jnp.bfloat16), normal((48, 64), 3, jnp.bfloat16), "bld,fd->bfl"
    plain = op(eq, x, w)
    if keyword in ("optimize", "precision"):  # ignored: one contraction, NVFP4 with float32 accumulation
        value = "greedy" if keyword == "optimize" else lax.Precision.HIGHEST
        assert_same_bytes(op(eq, x, w, **{keyword: value}), plain)
    elif keyword == "preferred_element_type":
        assert op(eq, x, w, preferred_element_type=jnp.float32).dtype == jnp.float32
    elif keyword == "out":  # refused as jnp.einsum refuses it
        assert_same_bytes(op(eq, x, w, out=None), plain)
        with pytest.raises(NotImplementedError, match="'out' argument"):
            op(eq, x, w, out=plain)
    elif keyword == "_dot_general":  # jnp's hook for another contraction: ours is NVFP4
        assert_same_bytes(op(eq, x, w, _dot_general=lax.dot_general), plain)
        with pytest.raises(ValueError, match="takes no other _dot_general"):
            op(eq, x, w, _dot_general=lambda *a, **k: lax.dot_general(*a, **k))
    elif keyword == "out_sharding":
        sharding = _mesh_sharding(P("data", "model", None))
        y = op(eq, x, w, out_sharding=sharding)
        assert y.sharding.is_equivalent_to(sharding, 3)
        assert_same_bytes(np.asarray(y), plain)
    else:
        raise AssertionError(f"no probe for jnp.einsum's keyword {keyword!r}")


@pytest.mark.parametrize("keyword", RAGGED_KEYWORDS)
def test_ragged_dot_takes_every_keyword(keyword):
    x, w = normal((64, 128), 4, jnp.bfloat16), normal((3, 128, 48), 5, jnp.bfloat16)
    sizes = jnp.array([20, 12, 32], jnp.int32)

    def op(**kw):
        return jax_nvfp4.ragged_dot(x, w, sizes, recipe=RTN, **kw)

    plain = op()
    if keyword == "precision":
        assert_same_bytes(op(precision=lax.Precision.HIGHEST), plain)
    elif keyword == "preferred_element_type":
        assert op(preferred_element_type=jnp.float32).dtype == jnp.float32
    elif keyword == "group_offset":  # as lax.ragged_dot on CPU and GPU
        with pytest.raises(NotImplementedError, match="group_offset"):
            op(group_offset=jnp.array([0], jnp.int32))
    elif keyword == "out_sharding":
        sharding = _mesh_sharding(P("data", None))
        y = op(out_sharding=sharding)
        assert y.sharding.is_equivalent_to(sharding, 2)
        assert_same_bytes(np.asarray(y), plain)
    else:
        raise AssertionError(f"no probe for lax.ragged_dot's keyword {keyword!r}")


# ---- The layers' calls: converted by rules, then called with every keyword of their __call__ ----------------


class _Linen(nn.Module):
    """One plain linen layer, built by ``make`` and called with ``kwargs``."""

    make: object
    kwargs: dict

    @nn.compact
    def __call__(self, x):
        return self.make()(x, **self.kwargs)


LINEN_LAYERS = {
    "nn.Dense": (lambda: nn.Dense(48, dtype=jnp.bfloat16), {}),
    "nn.DenseGeneral": (lambda: nn.DenseGeneral((2, 24), dtype=jnp.bfloat16), {}),
    "nn.Einsum": (lambda: nn.Einsum((64, 48), dtype=jnp.bfloat16), {"einsum_str": "bld,df->blf"}),
}


@pytest.mark.parametrize("name", LINEN_LAYERS)
def test_converted_linen_layers_take_every_keyword_of_their_call(name):
    """Converted by ``quantize_model``, each layer called with every keyword of its ``__call__`` gives its plain
    twin's dtype, shape and, to NVFP4's error (a relative RMS error under 0.2), values."""
    make, kwargs = LINEN_LAYERS[name]
    keywords = _keywords(getattr(nn, name.removeprefix("nn.")).__call__, 2)  # self, inputs
    assert set(keywords) == set(kwargs), f"{name}.__call__ takes keywords no probe covers: {keywords}"
    x = normal((2, 16, 64), 6, jnp.bfloat16)
    model = _Linen(make, kwargs)
    params = model.init(jax.random.key(0), x)
    ours, theirs = quantize_model(model, [Rule(".*", RTN)]).apply(params, x), model.apply(params, x)
    assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
    theirs = np.asarray(theirs, np.float32)
    assert np.linalg.norm(np.asarray(ours, np.float32) - theirs) < 0.2 * np.linalg.norm(theirs)


def _nnx_layers():
    rngs = nnx.Rngs(0)
    return {
        "nnx.Linear": (nnx.Linear(64, 48, rngs=rngs), {}, P("data", None, "model")),
        "nnx.LinearGeneral": (nnx.LinearGeneral(64, (2, 24), rngs=rngs), {}, P("data", None, "model", None)),
        "nnx.Einsum": (
            nnx.Einsum("bld,fd->bfl", (48, 64), rngs=rngs),
            {"einsum_str": "bld,df->blf"},  # the call's equation takes precedence over the layer's
            P("data", None, "model"),
        ),
    }


@pytest.mark.parametrize("name", ["nnx.Linear", "nnx.LinearGeneral", "nnx.Einsum"])
def test_converted_nnx_layers_take_every_keyword_of_their_call(name):
    """Converted by ``quantize_model`` and called under an Explicit mesh as model zoos call them, with every
    keyword of their ``__call__``: ``out_sharding`` is the result's type, and the bytes are the unsharded call's."""
    layer, kwargs, spec = _nnx_layers()[name]
    if name == "nnx.Einsum":  # the kernel of the call's equation
        layer.kernel = nnx.Param(normal((64, 48), 8, jnp.float32))
    keywords = _keywords(type(layer).__call__, 2)  # self, inputs
    assert set(keywords) == {*kwargs, "out_sharding"}, f"{name}.__call__ takes keywords no probe covers: {keywords}"
    nvfp4_nnx.quantize_model(layer, [Rule(".*", RTN)])
    x = normal((8, 16, 64), 7, jnp.bfloat16)
    want = layer(x, **kwargs)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=CPUS[:8])
    with jax.set_mesh(mesh):
        y = nnx.jit(lambda layer, x: layer(x, **kwargs, out_sharding=spec))(layer, jax.device_put(x, P("data")))
        assert jax.typeof(y).sharding.spec == spec
    assert_same_bytes(np.asarray(y), np.asarray(want))
