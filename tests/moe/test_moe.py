"""The mixture-of-experts MLP (linen and NNX): routing, the combination, NVFP4 against bf16, training, and
capacity dispatch (dropped pairs, batched GEMMs, their CUDA lowering)."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_same_bytes, dequantized_blocks, eqns_named, random_normal, stablehlo_functions

from jax_nvfp4 import Recipe
from jax_nvfp4.flax.linen.moe import MoEMLP
from jax_nvfp4.flax.nnx.moe import MoEMLP as NNXMoEMLP
from jax_nvfp4.moe.dispatch import expert_capacity, mixture, route

D, HIDDEN, EXPERTS, TOP_K = 32, 48, 4, 2


def _activations(shape=(2, 24, D), seed=0):
    return random_normal(shape, seed, jnp.bfloat16)


def test_route_sorts_rows_by_expert_and_balances_to_one():
    logits = jnp.array([[3.0, 2.0, 0.0, -1.0], [0.0, 1.0, 5.0, 4.0], [2.0, -1.0, 1.0, 0.0]])
    r = route(logits, 2)
    np.testing.assert_array_equal(r.group_sizes, [2, 1, 2, 1])  # choices: (0, 1), (2, 3), (0, 2)
    np.testing.assert_array_equal(np.asarray(r.order) // 2, [0, 2, 0, 1, 2, 1])  # tokens of experts 0, 1, 2, 3
    np.testing.assert_allclose(r.gates.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(r.gates[0], jax.nn.softmax(jnp.array([3.0, 2.0])), rtol=1e-6)
    assert float(route(jnp.zeros((8, 4)), 1).load_balance) == pytest.approx(1.0)  # ties go to expert 0: f = (1,0,0,0)
    balanced = jnp.tile(jnp.eye(4) * 10, (2, 1))
    assert float(route(balanced, 1).load_balance) == pytest.approx(1.0, abs=1e-3)


def _dense_reference(params, x, kept=None):
    """Each token through its top-k experts' MLPs one by one (float32), weighted by the gates; ``kept``
    [T, k] (bool): only those (token, choice) pairs."""
    tokens = x.reshape(-1, D).astype(jnp.float32)
    logits = tokens @ params["router"]["kernel"]
    top, chosen = jax.lax.top_k(logits, TOP_K)
    gates = jax.nn.softmax(top, axis=-1) * (1 if kept is None else kept)
    out = jnp.zeros_like(tokens)
    for j in range(TOP_K):
        up, down = params["up"][chosen[:, j]], params["down"][chosen[:, j]]
        h = nn.gelu(jnp.einsum("td,tdh->th", tokens, up), approximate=False)
        out += gates[:, j : j + 1] * jnp.einsum("th,thd->td", h, down)
    return out.reshape(x.shape)


def test_linen_bf16_is_the_per_token_mixture_and_nvfp4_is_close_to_it():
    x = _activations()
    bf16 = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=None)
    variables = bf16.init(jax.random.key(1), x)
    params = variables["params"]
    assert params["up"].shape == (EXPERTS, D, HIDDEN) and params["down"].shape == (EXPERTS, HIDDEN, D)
    want = np.asarray(_dense_reference(params, x))
    got = np.asarray(bf16.apply(variables, x), np.float32)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
    fp4 = np.asarray(MoEMLP(EXPERTS, HIDDEN, TOP_K).apply(variables, x), np.float32)
    assert not np.array_equal(fp4, got)
    assert np.linalg.norm(fp4 - want) < 0.3 * np.linalg.norm(want)  # two NVFP4 GEMMs in a row


def test_nnx_layer_equals_linen_with_the_same_parameters():
    x = _activations()
    linen = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=Recipe(stochastic_rounding=False))
    params = linen.init(jax.random.key(1), x)["params"]
    model = NNXMoEMLP(D, HIDDEN, EXPERTS, top_k=TOP_K, recipe=Recipe(stochastic_rounding=False), rngs=nnx.Rngs(0))
    model.router.kernel[...] = params["router"]["kernel"]
    model.up[...], model.down[...] = params["up"], params["down"]
    assert_same_bytes(model(x), linen.apply({"params": params}, x))
    state = linen.apply({"params": params}, x, mutable=["losses"])[1]
    assert_same_bytes(model.load_balance[...], state["losses"]["load_balance"][0])


@pytest.mark.parametrize("dispatch", ["ragged", "capacity"])
def test_linen_layer_trains_with_stochastic_rounding(dispatch):
    """Both dispatches; capacity's factor 1.25 (C = 30 of 48 tokens per expert) drops pairs while the router
    learns."""
    x, target = _activations(seed=2), _activations(seed=3)
    layer = MoEMLP(EXPERTS, HIDDEN, TOP_K, dispatch=dispatch)
    params = layer.init(jax.random.key(0), x)["params"]
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt, key):
        def loss_fn(params):
            y, aux = layer.apply({"params": params}, x, rngs={"nvfp4": key}, mutable=["losses"])
            mse = jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))
            return mse + 0.01 * aux["losses"]["load_balance"][0], mse

        (_, mse), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, mse

    opt, losses = tx.init(params), []
    for i in range(25):
        params, opt, mse = step(params, opt, jax.random.key(i))
        losses.append(float(mse))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("dispatch", ["ragged", "capacity"])
def test_nnx_layer_trains_under_nnx_jit_with_new_keys(dispatch):
    x, target = _activations(seed=2), _activations(seed=3)
    model = NNXMoEMLP(D, HIDDEN, EXPERTS, top_k=TOP_K, dispatch=dispatch, rngs=nnx.Rngs(0, nvfp4=1))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            mse = jnp.mean(jnp.square(model(x).astype(jnp.float32) - target.astype(jnp.float32)))
            return mse + 0.01 * model.load_balance[...], mse

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(25)]
    assert losses[-1] < 0.8 * losses[0], losses
    if dispatch == "capacity":  # the last call's statistic, kept through nnx.jit
        assert 0 <= int(model.dropped[...]) < 2 * x.size // D
        assert float(model.dropped_fraction[...]) == int(model.dropped[...]) / (2 * x.size // D)


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="top_k must be in"):
        MoEMLP(2, HIDDEN, 3).init(jax.random.key(0), _activations())
    with pytest.raises(ValueError, match="top_k must be in"):
        NNXMoEMLP(D, HIDDEN, 2, top_k=0, rngs=nnx.Rngs(0))


# ---- Capacity dispatch.


def test_expert_capacity():
    """C = ceil(capacity_factor * T * top_k / E), at most T; a factor's float error adds no slot."""
    assert expert_capacity(48, 2, 4, 1.25) == 30
    assert expert_capacity(48, 2, 4, 0.5) == 12
    assert expert_capacity(48, 1, 4, 0.3) == 4  # 3.6
    assert expert_capacity(48, 2, 4, 100.0) == 48
    assert 1.1 * 100 * 1 / 2 > 55 and expert_capacity(100, 1, 2, 1.1) == 55


def test_capacity_with_room_for_every_pair_is_the_ragged_dispatch():
    """capacity_factor E / top_k gives C = T: nothing is dropped. In bf16 (recipe=None) the batched GEMMs
    give the ragged dispatch's output; in NVFP4 (round to nearest) it is close to it, not equal: the
    batched GEMM quantizes all experts' weights with one amax, ragged_dot each expert's with its own."""
    x = _activations()
    variables = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=None).init(jax.random.key(1), x)
    want = np.asarray(_dense_reference(variables["params"], x))

    def both(recipe):
        ragged = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=recipe)
        capacity = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=recipe, dispatch="capacity", capacity_factor=EXPERTS / TOP_K)
        y, state = capacity.apply(variables, x, mutable=["intermediates"])
        assert int(state["intermediates"]["dropped"][0]) == 0
        assert float(state["intermediates"]["dropped_fraction"][0]) == 0.0
        return np.asarray(ragged.apply(variables, x), np.float32), np.asarray(y, np.float32)

    ragged, capacity = both(None)
    np.testing.assert_allclose(capacity, ragged, rtol=1e-2, atol=1e-3 * np.abs(ragged).max())
    ragged, capacity = both(Recipe(stochastic_rounding=False))
    assert np.linalg.norm(capacity - ragged) < 0.2 * np.linalg.norm(ragged)
    assert np.linalg.norm(capacity - want) < 0.3 * np.linalg.norm(want)  # as close as ragged's NVFP4


def test_capacity_drops_the_pairs_beyond_each_experts_capacity():
    """capacity_factor 0.5: C = ceil(0.5 * 48 * 2 / 4) = 12 slots per expert. The kept pairs are each
    expert's first 12 in token order (numpy); the output is the mixture of those alone (a token with no
    kept pair gives exactly 0), and the sown count and fraction are the dropped pairs'."""
    x = _activations()
    layer = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=None, dispatch="capacity", capacity_factor=0.5)
    variables = layer.init(jax.random.key(1), x)
    params = variables["params"]
    y, state = layer.apply(variables, x, mutable=["intermediates"])

    tokens = np.asarray(x.reshape(-1, D), np.float64)
    chosen = np.argsort(-(tokens @ np.asarray(params["router"]["kernel"], np.float64)), axis=1)[:, :TOP_K]
    capacity = 12
    kept, seen = np.zeros(chosen.shape, bool), np.zeros(EXPERTS, int)
    for t, j in np.ndindex(*chosen.shape):  # (token, choice) order
        kept[t, j] = seen[chosen[t, j]] < capacity
        seen[chosen[t, j]] += 1
    idle = ~kept.any(axis=1)  # tokens whose pairs are all dropped
    assert np.sum(~kept) == np.sum(np.maximum(seen - capacity, 0)) > 0 and np.any(idle)
    assert int(state["intermediates"]["dropped"][0]) == np.sum(~kept)
    assert float(state["intermediates"]["dropped_fraction"][0]) == np.float32(np.sum(~kept) / kept.size)

    got = np.asarray(y, np.float32).reshape(-1, D)
    assert not np.any(got[idle])
    want = np.asarray(_dense_reference(params, x, jnp.asarray(kept, jnp.float32))).reshape(-1, D)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
    # To the bit: the dispatch with room for all, the dropped pairs' gates set to 0.
    routing = route(jnp.asarray(tokens, jnp.float32) @ params["router"]["kernel"], TOP_K)
    np.testing.assert_array_equal(np.sort(routing.experts, axis=1), np.sort(chosen, axis=1))
    gelu = functools.partial(nn.gelu, approximate=False)
    experts = (x.reshape(-1, D), params["up"], params["down"], None, (None, None), gelu, "capacity")
    small, dropped = mixture(experts[0], routing, *experts[1:], 0.5)
    full, _ = mixture(experts[0], routing._replace(gates=routing.gates * kept), *experts[1:], EXPERTS / TOP_K)
    assert int(dropped) == np.sum(~kept)
    assert_same_bytes(small, full)


def test_nnx_capacity_layer_equals_linen_with_the_same_parameters():
    x, recipe = _activations(), Recipe(stochastic_rounding=False)
    linen = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=recipe, dispatch="capacity", capacity_factor=0.5)
    params = linen.init(jax.random.key(1), x)["params"]
    model = NNXMoEMLP(
        D, HIDDEN, EXPERTS, top_k=TOP_K, recipe=recipe, dispatch="capacity", capacity_factor=0.5, rngs=nnx.Rngs(0)
    )
    model.router.kernel[...] = params["router"]["kernel"]
    model.up[...], model.down[...] = params["up"], params["down"]
    y, state = linen.apply({"params": params}, x, mutable=["losses", "intermediates"])
    assert_same_bytes(model(x), y)
    assert_same_bytes(model.load_balance[...], state["losses"]["load_balance"][0])
    assert int(model.dropped[...]) == int(state["intermediates"]["dropped"][0]) > 0
    assert_same_bytes(model.dropped_fraction[...], state["intermediates"]["dropped_fraction"][0])


def test_dispatch_options_are_checked():
    for kwargs, match in [
        ({"dispatch": "dropless"}, r"dispatch must be one of \('ragged', 'capacity'\), got 'dropless'"),
        ({"dispatch": "capacity", "capacity_factor": 0.0}, "capacity_factor must be a positive finite number"),
        ({"capacity_factor": -1.0}, "capacity_factor must be a positive finite number"),
    ]:
        with pytest.raises(ValueError, match=match):
            MoEMLP(EXPERTS, HIDDEN, TOP_K, **kwargs).init(jax.random.key(0), _activations())
        with pytest.raises(ValueError, match=match):
            NNXMoEMLP(D, HIDDEN, EXPERTS, **kwargs, rngs=nnx.Rngs(0))


def test_capacity_experts_lower_for_cuda_to_batched_scaled_dots_on_fp4_codes():
    """A linen training step of the capacity layer (gradients of the parameters and of x, so that all six
    expert GEMMs run: fprop, dgrad and wgrad of up and down) with Recipe(impl="scaled_dot"), exported for
    CUDA. Each expert GEMM is one batched nvfp4_gemm (scaled_dot), and every xla.scaled_dot composite has
    f4E2M1FN codes and f8E4M3FN scales with the experts as its batch axis: batch dimensions [0] x [0],
    leading dimension E = 4, exactly the three signatures of the six GEMMs (C = 30 rows padded to 32).
    Outside the composites' decompositions the only stablehlo.dot_general ops are float32 ones of the
    router ([T, d] x [d, E] and its gradients) and of the gate weighting ("tkd,tk->td" and its
    transposes): no operand of any is bf16 or an expert's buffer or kernel; nothing is dequantized, and
    the codes reach the composites from their bytes by bitcasts and reshapes only."""
    layer = MoEMLP(EXPERTS, HIDDEN, TOP_K, recipe=Recipe(impl="scaled_dot"), dispatch="capacity")
    x = jax.ShapeDtypeStruct((2, 24, D), jnp.bfloat16)
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.ones(x.shape, x.dtype)))["params"]

    def step(params, x, key):
        def loss(params, x):
            y = layer.apply({"params": params}, x, rngs={"nvfp4": key})
            return jnp.mean(y.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    args = (params, x, jax.random.key(1))
    gemms = eqns_named(jax.make_jaxpr(step)(*args), "nvfp4_gemm")
    assert [e.params["impl"] for e in gemms] == ["scaled_dot"] * 6
    kernels = [jax.export.DisabledSafetyCheck.custom_call(f"nvfp4_{op}") for op in ("amax", "quantize", "dequantize")]
    module = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=kernels)(*args).mlir_module()

    composites = re.findall(
        r'stablehlo\.composite "xla\.scaled_dot" .*?dimension_numbers = (\[\[\[.*?\]\]\]),.*? : \(([^)]*)\) -> (\S+)',
        module,
    )
    assert len(composites) == module.count('stablehlo.composite "xla.scaled_dot"')
    e, rows, h, d = EXPERTS, 32, HIDDEN, D
    fp4 = lambda *shape: "tensor<" + "x".join(map(str, shape)) + "xf4E2M1FN>"  # noqa: E731
    # (codes of a, codes of c) [B, M, K] x [B, N, K]: fprop and dgrad of up and down, the wgrads contracting
    # the C rows.
    want = {(fp4(e, rows, d), fp4(e, h, d)), (fp4(e, rows, h), fp4(e, d, h)), (fp4(e, h, rows), fp4(e, d, rows))}
    want.add((fp4(e, d, rows), fp4(e, h, rows)))
    got = set()
    for dims, operands, result in composites:
        assert dims == "[[[2], [2]], [[0], [0]]]", dims  # contracting [2] x [2], batch [0] x [0]
        types = re.findall(r"tensor<([\dx]+)x(f4E2M1FN|f8E4M3FN)>", operands)
        assert [t for _, t in types] == ["f4E2M1FN", "f4E2M1FN", "f8E4M3FN", "f8E4M3FN"], operands
        assert all(shape.startswith(f"{e}x") for shape, _ in types) and result.startswith(f"tensor<{e}x"), operands
        got.add(tuple(operands.split(", ")[:2]))
    assert got <= want and len(got) == 3, got  # dgrads share their signature with the other layer's fprop

    t = x.shape[0] * x.shape[1]
    allowed = {f"{t}x{d}", f"{d}x{e}", f"{t}x{e}", f"{t}x{TOP_K}x{d}", f"{t}x{TOP_K}"}
    functions = stablehlo_functions(module)
    outside = {name: body for name, body in functions.items() if not name.startswith("xla.scaled_dot")}
    dots = [line for body in outside.values() for line in body.splitlines() if "stablehlo.dot_general" in line]
    assert dots
    for line in dots:
        operands = re.search(r" : \(([^)]*)\) -> ", line).group(1)
        shapes = re.findall(r"tensor<([\dx]+)x(\w+)>", operands)
        assert all(dtype == "f32" and shape in allowed for shape, dtype in shapes), line
    for name, body in outside.items():
        assert not dequantized_blocks(body), name
        for line in body.splitlines():
            if re.search(r"-> tensor<[\dx]*f4E2M1FN>", line) or re.search(r"\(tensor<[\dx]*f4E2M1FN>\)", line):
                assert re.search(r"stablehlo\.(bitcast_convert|reshape|composite)", line), line
