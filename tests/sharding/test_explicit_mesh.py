"""Explicit sharding: the public functions and layers under ``jax.set_mesh`` on a mesh of ``AxisType.Explicit`` axes.

One (4, 2) mesh ("data", "model") on 8 CPU devices. Results must carry the shardings their inputs imply in
their types (as ``lax.dot_general``'s do), and give the bytes of the same program on an Auto mesh with the
same input shardings; quantizations also those of the unsharded one, GEMMs its values up to the order of
float32 partial sums that XLA may split over shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, assert_same_tree, needs_8_cpus
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4

pytestmark = needs_8_cpus

DIMS = (((1,), (0,)), ((), ()))
RECIPE = jax_nvfp4.Recipe(stochastic_rounding=False)


@functools.cache
def _typed_mesh(axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=CPUS[:8])


EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto


def _scaled_normal(shape, dtype=jnp.bfloat16, seed=0, scale=1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _spec(a) -> P:
    """The sharding in the type of an array, or of a ``jax.eval_shape`` result (the type as traced)."""
    return a.sharding.spec if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a).sharding.spec


def _specs(tree) -> list[P]:
    """The shardings in the types of a tree's arrays, or a tree of PartitionSpecs, as a list."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, P))
    return [a if isinstance(a, P) else _spec(a) for a in leaves]


def _put(tree, specs, mesh):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def _run(f, *args):
    """``f`` jitted on ``args``, and its result's types as traced (what the program's next op sees; a jitted
    program's outputs need not be laid out as typed)."""
    return jax.jit(f)(*args), jax.eval_shape(f, *args)


def _on_both_meshes(step, args, specs):
    """``step`` jitted on the Explicit and the Auto mesh, on ``args`` placed as ``specs`` on each; and the
    types of its result on the Explicit mesh, as traced."""
    results = []
    for axis_type in (EXPLICIT, AUTO):
        mesh = _typed_mesh(axis_type)
        with jax.set_mesh(mesh):
            results.append(_run(step, *_put(args, specs, mesh)))
    (explicit, types), (auto, _) = results
    return explicit, auto, types


@pytest.mark.parametrize(
    "x_spec,shape,data_t_spec",
    [
        (P("data", None), (64, 128), P(None, "data")),
        (P("data", "model"), (64, 128), P("model", "data")),
        (P("data", "model", None), (4, 64, 128), P(None, ("data", "model"))),  # M = batch x sequence, merged
    ],
)
def test_quantize_and_dequantize_types_carry_the_input_sharding(x_spec, shape, data_t_spec):
    x = _scaled_normal(shape)
    want = jax_nvfp4.quantize(x, columnwise=True)
    with jax.set_mesh(_typed_mesh(EXPLICIT)):
        xs = _put(x, x_spec, _typed_mesh(EXPLICIT))
        t, traced = _run(functools.partial(jax_nvfp4.quantize, columnwise=True), xs)
        for tree in (t, traced):
            assert (_spec(tree.data), _spec(tree.scale), _spec(tree.amax)) == (x_spec, x_spec, P())
            assert _spec(tree.data_t) == _spec(tree.scale_t) == data_t_spec
        assert_same_tree(t, want)
        for columnwise in (False, True):
            y, traced = _run(functools.partial(jax_nvfp4.dequantize, columnwise=columnwise), t)
            assert_same_tree(y, jax_nvfp4.dequantize(want, columnwise=columnwise))
            assert _spec(y) == _spec(traced) == x_spec
        # Row amaxes go with their rows, and eager calls take the same path.
        amax = jax_nvfp4.amax(xs, row_scaled=True)
        assert_same_tree(amax, jax_nvfp4.amax(x, row_scaled=True))
        assert _spec(amax) == P(*x_spec[:-1])


@pytest.mark.parametrize(
    "x_spec,w_spec,out_sharding",
    [
        (P("data", None), P(None, None), None),
        (P("data", None), P(None, "model"), None),
        (P("data", None), P("model", None), None),  # FSDP: W gathered (4-bit)
        (P("data", None), P(None, None), P("data", "model")),
    ],
)
def test_dot_general_result_has_lax_dot_generals_type(x_spec, w_spec, out_sharding):
    x, w = _scaled_normal((64, 128)), _scaled_normal((128, 256), jnp.float32, seed=1)
    mesh = _typed_mesh(EXPLICIT)
    with jax.set_mesh(mesh):
        xs, ws = _put((x, w), (x_spec, w_spec), mesh)
        lax_type = jax.eval_shape(lambda x, w: lax.dot_general(x, w, DIMS, out_sharding=out_sharding), xs, ws)
    explicit, auto, traced = _on_both_meshes(
        lambda x, w: jax_nvfp4.dot_general(x, w, DIMS, out_sharding=out_sharding), (x, w), (x_spec, w_spec)
    )
    assert _spec(explicit) == _spec(traced) == lax_type.sharding.spec == (out_sharding or P(x_spec[0], w_spec[1]))
    assert_same_tree(explicit, auto)
    # XLA may still split K over "model" (free for x, replicated along it) and all-reduce float32 partial sums.
    want = jax_nvfp4.dot_general(x, w, DIMS)
    np.testing.assert_allclose(explicit, want, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_dot_general_eager_and_ambiguous_contractions_as_lax():
    mesh = _typed_mesh(EXPLICIT)
    x, w = _scaled_normal((64, 128)), _scaled_normal((128, 256), jnp.float32, seed=1)
    with jax.set_mesh(mesh):
        xs, ws = _put((x, w), (P("data", "model"), P("model", None)), mesh)
        # K sharded on both operands: lax asks for out_sharding, and so does dot_general.
        with pytest.raises(Exception, match="out_sharding") as lax_error:
            lax.dot_general(xs, ws, DIMS)
        with pytest.raises(type(lax_error.value), match="out_sharding"):
            jax_nvfp4.dot_general(xs, ws, DIMS)
        y = jax_nvfp4.dot_general(xs, ws, DIMS, out_sharding=NamedSharding(mesh, P("data", None)))  # eager
    assert _spec(y) == P("data", None)
    # The float32 partial sums are all-reduced: exact up to their order.
    want = jax_nvfp4.dot_general(x, w, DIMS)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def _tensor_parallel_problem():
    x = _scaled_normal((64, 128), seed=3)
    w1, w2 = (
        _scaled_normal((128, 256), jnp.float32, seed=4, scale=0.1),
        _scaled_normal((256, 128), jnp.float32, seed=5, scale=0.1),
    )
    return x, (w1, w2)


@pytest.mark.parametrize(
    "recipe", [RECIPE, jax_nvfp4.Recipe(), jax_nvfp4.MXFP8()], ids=["rht", "stochastic_rounding", "mxfp8"]
)
def test_training_step_on_explicit_axes_equals_auto(recipe):
    """A tensor-parallel 2-layer MLP: hidden units over "model", tokens over "data". The Explicit program is the
    Auto one (its layouts, and so each shard's stochastic-rounding key): loss and grads bitwise equal."""
    x, params = _tensor_parallel_problem()

    def loss(params, x, key):
        w1, w2 = (w.astype(jnp.bfloat16) for w in params)
        dot = functools.partial(jax_nvfp4.dot_general, recipe=recipe, preferred_element_type=jnp.bfloat16)
        h = jax.nn.gelu(dot(x, w1, DIMS, rng_key=jax.random.fold_in(key, 0)))
        # Both operands are sharded along K = hidden: as with lax.dot_general the result's sharding is named.
        y = dot(h, w2, DIMS, rng_key=jax.random.fold_in(key, 1), out_sharding=P("data", None))
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    specs = ((P(None, "model"), P("model", None)), P("data", None), P())
    explicit, auto, traced = _on_both_meshes(jax.value_and_grad(loss), (params, x, jax.random.key(7)), specs)
    assert_same_tree(explicit, auto)
    for grads in (explicit[1], traced[1]):  # each grad has its param's type
        assert _specs(grads) == _specs(specs[0])


def _assert_same_step(got, want) -> None:
    """Loss and gradients bitwise, but a bias gradient: XLA's own float32 sum of dy over the sharded tokens,
    which it may reduce in another order on each mesh."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want), strict=True):
        if "bias" in jax.tree_util.keystr(path):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(np.max(np.abs(w))))
        else:
            assert_same_tree(g, w)


def test_flax_linen_and_nnx_layers_on_explicit_axes_equal_auto():
    """Linen NVFP4Dense (weights FSDP-sharded over "model") and NNX NVFP4Linear (tensor parallel): a jitted
    training step on the Explicit mesh gives the Auto mesh's loss and grads (bitwise but for the biases')."""
    import flax.linen as nn
    from flax import nnx

    from jax_nvfp4.flax import NVFP4Dense
    from jax_nvfp4.flax.nnx.layers import NVFP4Linear

    x, _ = _tensor_parallel_problem()

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return NVFP4Dense(128, recipe=RECIPE)(jax.nn.gelu(NVFP4Dense(256, recipe=RECIPE)(x)))

    linen = Linen()
    params = linen.init(jax.random.key(0), x)["params"]
    fsdp = jax.tree.map(lambda p: P("model", None) if p.ndim == 2 else P(None), params)  # biases replicated

    def linen_step(params, x):
        return jax.value_and_grad(lambda p: jnp.mean(jnp.square(linen.apply({"params": p}, x))))(params)

    explicit, auto, traced = _on_both_meshes(linen_step, (params, x), (fsdp, P("data", None)))
    _assert_same_step(explicit, auto)
    assert _specs(explicit[1]) == _specs(traced[1]) == _specs(fsdp)

    class NNX(nnx.Module):
        def __init__(self, rngs):
            self.up = NVFP4Linear(128, 256, recipe=RECIPE, rngs=rngs)
            self.down = NVFP4Linear(256, 128, recipe=RECIPE, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)), out_sharding=P("data", None))

    graph, state = nnx.split(NNX(nnx.Rngs(0)))
    tensor_parallel = {
        ("up", "kernel"): P(None, "model"),
        ("up", "bias"): P("model"),
        ("down", "kernel"): P("model", None),
    }
    specs = jax.tree.map_with_path(
        lambda path, _: tensor_parallel.get(tuple(k.key for k in path if hasattr(k, "key")), P(None)), state
    )

    def nnx_step(state, x):
        return jax.value_and_grad(lambda s: jnp.mean(jnp.square(nnx.merge(graph, s)(x))))(state)

    explicit, auto, traced = _on_both_meshes(nnx_step, (state, x), (specs, P("data", None)))
    _assert_same_step(explicit, auto)
    assert _specs(explicit[1]) == _specs(traced[1]) == _specs(specs)


def test_ragged_dot_on_explicit_axes_equals_auto():
    """Experts over "model", tokens over "data": lax.ragged_dot has no Explicit rule; ours types y as lax.dot_general
    types x times one expert's W, each gradient as its operand, and runs the Auto program byte for byte."""
    x, w = _scaled_normal((64, 128), seed=6), _scaled_normal((4, 128, 96), jnp.float32, seed=7, scale=0.1)
    sizes = jnp.array([20, 0, 37, 7], jnp.int32)

    def step(x, w, sizes, key):
        def loss(x, w):
            y = jax_nvfp4.ragged_dot(x, w.astype(jnp.bfloat16), sizes, rng_key=key)
            return jnp.mean(jnp.square(y.astype(jnp.float32))), y

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)

    specs = (P("data", None), P("model", None, None), P(), P())
    explicit, auto, traced = _on_both_meshes(step, (x, w, sizes, jax.random.key(3)), specs)
    assert_same_tree(explicit, auto)
    ((_, y), grads) = traced
    assert _spec(y) == _spec(explicit[0][1]) == P("data", None)
    assert _specs(grads) == _specs(explicit[1]) == [P("data", None), P("model", None, None)]
    assert_same_tree(explicit[0][1], jax.jit(lambda *a: step(*a)[0][1])(x, w, sizes, jax.random.key(3)))


def test_moe_layer_on_explicit_axes_equals_auto():
    """The linen MoE MLP (experts over "model", the batch over "data"): a training step on Explicit axes gives the
    Auto mesh's outputs and expert gradients byte for byte, the router's up to float32 summation order, and types
    each gradient as its parameter. (ReLU: XLA's erf, in the exact GELU, can round differently in another fusion.)"""
    from jax_nvfp4.flax.linen.moe import MoEMLP

    layer = MoEMLP(4, 64, recipe=RECIPE, activation=jax.nn.relu)
    x = _scaled_normal((4, 16, 128), seed=8)
    params = layer.init(jax.random.key(0), x)["params"]
    experts = jax.tree.map(lambda p: P("model", None, None) if p.ndim == 3 else P(None, None), params)

    def step(params, x):
        def loss(p):
            y = layer.apply({"params": p}, x)
            return jnp.mean(jnp.square(y.astype(jnp.float32))), y

        return jax.value_and_grad(loss, has_aux=True)(params)

    explicit, auto, traced = _on_both_meshes(step, (params, x), (experts, P("data", None, None)))
    (_, y), grads = explicit
    assert_same_tree(y, auto[0][1])
    assert _spec(y) == _spec(traced[0][1]) == P("data", None, None)
    assert_same_tree((grads["up"], grads["down"]), (auto[1]["up"], auto[1]["down"]))
    router, want = grads["router"]["kernel"], auto[1]["router"]["kernel"]
    np.testing.assert_allclose(router, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
    assert _specs(grads) == _specs(traced[1]) == _specs(experts)
