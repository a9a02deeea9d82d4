"""NVFP4 for models nobody here wrote: rules, linen interception (quantize_model), NNX conversion.

The models below are plain Flax (Flax's own attention, Dense, DenseGeneral, Einsum; NNX's Linear,
LinearGeneral, Einsum, MultiHeadAttention), with no jax_nvfp4 in them; the rules convert them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_same_bytes

import jax_nvfp4
from jax_nvfp4 import Recipe

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
from jax_nvfp4.flax import Rule, keep_ends, quantize_model  # noqa: E402
from jax_nvfp4.flax import nnx as nvfp4_nnx  # noqa: E402
from jax_nvfp4.flax.linen.convert import module_path  # noqa: E402
from jax_nvfp4.flax.rules import recipe_for  # noqa: E402

D, HEADS, LAYERS = 32, 2, 3
RTN = Recipe(stochastic_rounding=False)  # forward-only comparisons need no key


# ---- A plain linen transformer ------------------------------------------------------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, name="attn")(h, mask=None)
        h = nn.gelu(nn.DenseGeneral((2, D), name="up")(nn.LayerNorm()(x)))  # [b, l, 2, D]
        return x + nn.Einsum((2, D, D), "blgd,gdf->blf", name="down")(h)


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, D, name="embed")(tokens)
        for i in range(LAYERS):
            x = LinenBlock(name=f"block{i}")(x)
        return nn.Dense(64, name="head")(nn.LayerNorm()(x))


def _tokens(seed=0, shape=(2, 16)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, shape), jnp.int32)


def test_rules_take_the_first_full_match():
    rules = (Rule("block0/.*", None), Rule(".*/(up|down)", RTN), Rule(".*"))
    assert recipe_for(rules, "block0/up") is None
    assert recipe_for(rules, "block1/up") == RTN
    assert recipe_for(rules, "block1/attn/query") == Recipe()
    assert recipe_for(rules[:2], "head") is None  # no match: kept
    assert recipe_for((Rule("block1"),), "block10") is None  # matched whole, not as a prefix
    rules = keep_ends(12, first=1, last=2, recipe=RTN)
    kept = {
        p
        for p in ("block0/q", "block1/q", "block9/q", "block10/mlp/up", "block11/q", "head", "lm/head")
        if recipe_for(rules, p) is None
    }
    assert kept == {"block0/q", "block10/mlp/up", "block11/q", "head", "lm/head"}
    assert recipe_for(keep_ends(4, block="blocks/{i}"), "blocks/2/attn/query") == Recipe()
    assert recipe_for(keep_ends(4, block="blocks/{i}"), "blocks/3/attn/query") is None


def test_rule_errors():
    with pytest.raises(ValueError, match="not a valid regex"):
        Rule("block(")
    with pytest.raises(TypeError, match=r"Recipe, a jax_nvfp4\.MXFP8 or None"):
        Rule(".*", "fp4")
    with pytest.raises(TypeError, match="Rule objects"):
        quantize_model(LinenLM(), [(".*", Recipe())])
    with pytest.raises(ValueError, match="add up to at most 4"):
        keep_ends(4, first=3, last=2)


def _record_layers(fn):
    """Run fn() and return {path: (module, args, output)} for every Dense/DenseGeneral/Einsum call in it."""
    calls = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, nn.Dense | nn.DenseGeneral | nn.Einsum):
            calls[module_path(context.module)] = (context.module, args, out)
        return out

    with nn.intercept_methods(record):
        fn()
    return calls


def _layer_alone(module, args, dot_general=None):
    """The recorded layer applied on its own to its recorded inputs: Flax's module, with ``dot_general`` if given."""
    params = module.variables["params"]
    if isinstance(module, nn.Einsum):
        assert dot_general is None
        return module.clone(parent=None).apply({"params": params}, *args)
    return module.clone(parent=None, dot_general=dot_general).apply({"params": params}, *args)


def test_a_stock_linen_model_converted_by_rules():
    model, tokens = LinenLM(), _tokens()
    rules = keep_ends(LAYERS, last=1, recipe=RTN)  # block2 and head stay float32
    converted = quantize_model(model, rules)
    variables = model.init(jax.random.key(0), tokens)
    # The same parameters (tree, names, values): a checkpoint of the original applies unchanged.
    jax.tree.map(assert_same_bytes, converted.init(jax.random.key(0), tokens), variables)

    calls = _record_layers(lambda: converted.apply(variables, tokens))
    names = ("attn/query", "attn/key", "attn/value", "attn/out", "up", "down")
    assert set(calls) == {f"block{i}/{n}" for i in range(LAYERS) for n in names} | {"head"}
    for path, (module, args, out) in calls.items():
        plain = _layer_alone(module, args)
        if recipe_for(rules, path) is None:
            assert_same_bytes(out, plain)  # excluded: bit-identical to Flax's layer
            continue
        assert not np.array_equal(out, plain), path  # really quantized
        if isinstance(module, nn.Einsum):
            p = module.variables["params"]
            want = jax_nvfp4.einsum("blgd,gdf->blf", args[0], p["kernel"], recipe=RTN) + p["bias"]
        else:
            want = _layer_alone(module, args, functools.partial(jax_nvfp4.dot_general, recipe=RTN))
        assert_same_bytes(out, want)  # the layer's GEMM is jax_nvfp4's, bit for bit


def test_a_converted_linen_model_trains_with_stochastic_rounding():
    model, tokens = LinenLM(), _tokens(1, (4, 16))
    converted = quantize_model(model, keep_ends(LAYERS, last=1))  # the full recipe: RHT and SR
    params = model.init(jax.random.key(0), tokens)["params"]

    def loss(params, key):
        logits = converted.apply({"params": params}, tokens[:, :-1], rngs={"nvfp4": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    with pytest.raises(ValueError, match="rng_key"):  # stochastic rounding needs the stream for gradients
        jax.jit(jax.grad(lambda p: converted.apply({"params": p}, tokens).sum()))(params)  # raised while tracing
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, key):
        value, grads = jax.value_and_grad(loss)(params, key)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value, grads

    losses = []
    for i in range(30):
        params, opt_state, value, grads = step(params, opt_state, jax.random.key(i))
        losses.append(float(value))
        if i == 0:  # every layer gets a gradient
            for j in range(LAYERS):
                for name in ("query", "out"):
                    assert float(jnp.abs(grads[f"block{j}"]["attn"][name]["kernel"]).sum()) > 0
                assert float(jnp.abs(grads[f"block{j}"]["down"]["kernel"]).sum()) > 0
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_a_layer_with_its_own_dot_general_is_not_replaced():
    model = nn.Dense(16, dot_general=jax.lax.dot_general)
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="has its own dot_general"):
        quantize_model(model, [Rule(".*")]).init(jax.random.key(0), x)
    # Excluding it keeps it as it is.
    variables = model.init(jax.random.key(0), x)
    assert_same_bytes(quantize_model(model, [Rule(".*", None)]).apply(variables, x), model.apply(variables, x))


# ---- A plain NNX transformer --------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, qkv_features=D, decode=False, rngs=rngs)
        self.up = nnx.LinearGeneral(D, (2, D), rngs=rngs)
        self.down = nnx.Einsum("blgd,gdf->blf", (2, D, D), (D,), rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NNXLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, layers: int = LAYERS):
        self.embed = nnx.Embed(64, D, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_a_stock_nnx_model_converted_by_rules():
    tokens = _tokens()
    original, model = NNXLM(nnx.Rngs(0)), NNXLM(nnx.Rngs(0))
    params = _params(model)
    rules = keep_ends(LAYERS, last=1, block="blocks/{i}", recipe=RTN)
    assert nvfp4_nnx.quantize_model(model, rules) is model
    jax.tree.map(assert_same_bytes, _params(model), params)  # parameters untouched

    x = jax.random.normal(jax.random.key(1), (2, 16, D))
    for i in range(LAYERS):
        block, plain = model.blocks[i], original.blocks[i]
        for name in ("query", "key", "value", "out"):
            layer, plain_layer = getattr(block.attn, name), getattr(plain.attn, name)
            h = x if name != "out" else x.reshape(2, 16, HEADS, D // HEADS)
            if i == LAYERS - 1:  # kept by the rule: bit-identical
                assert_same_bytes(layer(h), plain_layer(h))
                continue
            dims = (
                (tuple(range(h.ndim - len(layer.in_features), h.ndim)), tuple(range(len(layer.in_features)))),
                ((), ()),
            )
            want = jax_nvfp4.dot_general(h, layer.kernel[...], dims, recipe=RTN) + layer.bias[...]
            assert_same_bytes(layer(h), want)
            assert not np.array_equal(layer(h), plain_layer(h))
        g = jax.nn.gelu(block.up(x))
        if i < LAYERS - 1:
            want = jax_nvfp4.einsum("blgd,gdf->blf", g, block.down.kernel[...], recipe=RTN) + block.down.bias[...]
            assert_same_bytes(block.down(g), want)
        else:
            assert_same_bytes(block.down(g), plain.down(g))
    assert_same_bytes(model.head(x), original.head(x))  # the head: kept
    assert not np.array_equal(model(tokens), original(tokens))
    # Gradients reach every layer, converted or kept.
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens) ** 2)))(model)
    for i in range(LAYERS):
        g = grads.blocks[i]
        kernels = [g.attn.query.kernel, g.attn.out.kernel, g.up.kernel, g.down.kernel]
        assert all(float(jnp.abs(k[...]).sum()) > 0 for k in kernels), i


def test_a_converted_nnx_model_trains_under_nnx_jit_with_an_optimizer():
    tokens = _tokens(1, (4, 17))

    @nnx.jit  # one function for both models: compiled once, the RNG state and parameters passed in
    def step(model, optimizer):
        def loss(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    models = []
    tx = optax.adam(1e-2)  # one transformation: the optimizers' graph is static, and a new adam's is another
    for _ in range(2):  # the same seeds twice: the same steps
        model = nvfp4_nnx.quantize_model(
            NNXLM(nnx.Rngs(0)), keep_ends(LAYERS, last=1, block="blocks/{i}"), rngs=nnx.Rngs(nvfp4=5)
        )
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        models.append([float(step(model, optimizer)) for _ in range(30)])
    assert models[0] == models[1]
    assert np.mean(models[0][-5:]) < 0.7 * np.mean(models[0][:5])


def _nvfp4_ops(model):
    """Each converted layer's NVFP4 op (dot_general or einsum_op) by path; plain layers are absent."""
    ops = {}
    for path, node in nnx.iter_graph(model):
        op = getattr(node, "einsum_op", None) or getattr(node, "dot_general", None)
        layer = isinstance(node, nnx.Einsum | nnx.Linear | nnx.LinearGeneral)
        if layer and isinstance(op, nvfp4_nnx.NVFP4DotGeneral | nvfp4_nnx.NVFP4Einsum):
            ops["/".join(map(str, path))] = op
    return ops


def test_an_nnx_precision_schedule_switches_the_rules_in_place():
    """quantize_model(replace=True) part-way through training: the same parameters and optimizer go on, the
    rules decide the converted layers again (None: plain, another recipe: the layer keeps its RNG stream)."""
    tokens = _tokens(1, (4, 17))
    # Two blocks (one in NVFP4, one kept): each switch compiles the step again, and one block shows it.
    layers = 2
    model = nvfp4_nnx.quantize_model(
        NNXLM(nnx.Rngs(0), layers), keep_ends(layers, last=1, block="blocks/{i}"), rngs=nnx.Rngs(nvfp4=5)
    )
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @nnx.jit
    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    step(model, optimizer)
    before = _nvfp4_ops(model)
    assert len(before) == 4 * (layers - 1) + 2 * (layers - 1)  # q, k, v, out, up, down of the NVFP4 blocks
    # Without replace, layers already in NVFP4 stay as they are.
    nvfp4_nnx.quantize_model(model, [Rule(".*", None)])
    assert _nvfp4_ops(model) == before
    # Another recipe with stochastic rounding: new ops, each with its layer's stream.
    other = Recipe(rht=False)
    rules = (Rule(f"blocks/[0-{layers - 2}]/attn/.*", other), *keep_ends(layers, last=1, block="blocks/{i}"))
    nvfp4_nnx.quantize_model(model, rules, replace=True)
    after = _nvfp4_ops(model)
    assert after.keys() == before.keys()
    for path, op in after.items():
        assert op.recipe == (other if "/attn/" in path else Recipe()), path
        assert op.rngs is before[path].rngs, path
    step(model, optimizer)
    # To bf16: every layer plain, the model that of its parameters alone.
    nvfp4_nnx.quantize_model(model, [Rule(".*", None)], replace=True)
    assert _nvfp4_ops(model) == {}
    plain = NNXLM(nnx.Rngs(1), layers)
    nnx.update(plain, nnx.state(model, nnx.Param))
    assert_same_bytes(model(tokens), plain(tokens))
    params = _params(model)
    value = step(model, optimizer)
    assert np.isfinite(float(value)) and int(optimizer.step[...]) == 3
    assert not any(np.array_equal(a, b) for a, b in zip(params, _params(model), strict=True))  # all trained


def test_nvfp4_linear_modules():
    rngs_a, rngs_b = nnx.Rngs(0, nvfp4=1), nnx.Rngs(0, nvfp4=1)
    layer, plain = nvfp4_nnx.NVFP4Linear(48, 32, recipe=RTN, rngs=rngs_a), nnx.Linear(48, 32, rngs=rngs_b)
    assert_same_bytes(layer.kernel[...], plain.kernel[...])  # the same initial values as nnx.Linear
    x = jax.random.normal(jax.random.key(1), (4, 48))
    want = jax_nvfp4.dot_general(x, layer.kernel[...], (((1,), (0,)), ((), ())), recipe=RTN) + layer.bias[...]
    assert_same_bytes(layer(x), want)
    general = nvfp4_nnx.NVFP4LinearGeneral((2, 24), 32, axis=(-2, -1), recipe=RTN, rngs=nnx.Rngs(0))
    x2 = x.reshape(4, 2, 24)
    want = jax_nvfp4.dot_general(x2, general.kernel[...], (((1, 2), (0, 1)), ((), ())), recipe=RTN) + general.bias[...]
    assert_same_bytes(general(x2), want)
    with pytest.raises(ValueError, match="do not pass dot_general"):
        nvfp4_nnx.NVFP4Linear(48, 32, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))
    # Quantized inference applies to them as to any NVFP4 layer.
    y = layer(x)
    nvfp4_nnx.quantize_weights(layer)
    assert isinstance(layer.kernel[...], jax_nvfp4.QuantizedWeight)
    assert_same_bytes(layer(x), y)
