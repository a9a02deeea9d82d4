"""jax_nvfp4.qwix: NVFP4 as a Qwix provider, ``qwix.quantize_model(model, NVFP4Provider(rules), ...)``.

The models are plain Flax, written as published JAX models write them: a linen ``Einsum`` module of its own whose
``__call__`` is ``jnp.einsum(eqn, x, w)`` (as google-deepmind/gemma's), attention scores as an einsum of two
activations, Flax's ``nn.Dense`` / ``nnx.Linear`` / ``nnx.Einsum``. The provider must route every weight GEMM the
rules match and no product of two activations, give the bytes of our own ``quantize_model`` where both convert
a model, and train.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CPUS, assert_same_tree, needs_8_cpus, nnx_adam_losses, normal, quantized_shapes
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4 import MXFP8, Recipe

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
qwix = pytest.importorskip("qwix")
from jax_nvfp4.flax import Rule, UnmatchedRuleWarning, quantize_model  # noqa: E402
from jax_nvfp4.flax import nnx as nvfp4_nnx  # noqa: E402
from jax_nvfp4.qwix import NVFP4Provider  # noqa: E402

RTN = Recipe(stochastic_rounding=False)
D, N, H = 64, 4, 16


class OwnEinsum(nn.Module):
    """A projection as gemma writes one: its own parameter, the equation given at the call, ``jnp.einsum``."""

    shape: tuple[int, ...]

    @nn.compact
    def __call__(self, eqn: str, x):
        w = self.param("w", nn.initializers.normal(0.1), self.shape)
        return jnp.einsum(eqn, x, w)


class OwnAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q = OwnEinsum((N, D, H), name="q_einsum")("BTD,NDH->BTNH", x)
        k = OwnEinsum((N, D, H), name="k_einsum")("BSD,NDH->BSNH", x)
        scores = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BTNS", q, k) / np.sqrt(H), axis=-1)  # two activations
        return OwnEinsum((N, H, D), name="attn_vec_einsum")("BTNH,NHD->BTD", jnp.einsum("BTNS,BSNH->BTNH", scores, k))


class OwnLM(nn.Module):
    """Two blocks of own-einsum attention and an MLP of ``nn.Dense``, layers named ``layer_{i}`` as gemma's."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + OwnAttention(name=f"layer_{i}")(x)
            x = x + nn.Dense(D, name=f"mlp_{i}")(jax.nn.gelu(nn.Dense(2 * D, name=f"up_{i}")(x)))
        return x


def _qwix_batch(seed=0, shape=(2, 16, D)):
    return normal(shape, seed, jnp.bfloat16)


def _linen_loss(model, key=None):
    def loss(params, x):
        rngs = None if key is None else {"nvfp4": key}
        return jnp.mean(jnp.square(model.apply(params, x, rngs=rngs).astype(jnp.float32)))

    return loss


def test_a_model_that_calls_jnp_einsum_itself_is_converted():
    """Our quantize_model sees no Flax layer in OwnAttention and says to use the provider; the provider routes
    every weight projection (x and w quantized forward, dy and the columnwise copies backward) and leaves the
    attention scores' einsums of two activations as they are."""
    model, x = OwnLM(), _qwix_batch()
    params = model.init(jax.random.key(0), x)
    with pytest.warns(UnmatchedRuleWarning, match="jax_nvfp4.qwix.NVFP4Provider"):
        quantize_model(OwnAttention(), [Rule(".*", RTN)]).init(jax.random.key(0), x)
    converted = qwix.quantize_model(model, NVFP4Provider([Rule(".*", RTN)]))
    forward = quantized_shapes(jax.make_jaxpr(lambda p: converted.apply(p, x))(params))
    # Per block: q, k, attn_vec, up and mlp, each its w [1, K, N] and its x [1, *M, K]; the activation products
    # would add operands of the scores' shapes.
    block = [(1, D, N * H), (1, D, N * H), (1, N * H, D), (1, D, 2 * D), (1, 2 * D, D)]
    assert forward[0::2] == 2 * block
    assert forward[1::2] == 2 * ([(1, 2, 16, D)] * 4 + [(1, 2, 16, 2 * D)])
    plain = qwix.quantize_model(model, NVFP4Provider([Rule(".*", None)]))
    assert quantized_shapes(jax.make_jaxpr(lambda p: plain.apply(p, x))(params)) == []
    assert_same_tree(plain.apply(params, x), model.apply(params, x))


def test_linen_provider_gives_quantize_models_bytes_with_stochastic_rounding():
    """Where both convert a model (its Dense layers), the provider's step is our quantize_model's, byte for byte:
    the same op, recipe and keys (the layer's "nvfp4" stream)."""
    model, x, key = OwnLM(), _qwix_batch(1), jax.random.key(5)
    params = model.init(jax.random.key(0), x)
    rules = [Rule("layer_.*", None), Rule(r"up_\d", Recipe()), Rule(r"mlp_\d", MXFP8())]
    ours = jax.jit(jax.value_and_grad(_linen_loss(quantize_model(model, rules), key)))(params, x)
    theirs = jax.jit(jax.value_and_grad(_linen_loss(qwix.quantize_model(model, NVFP4Provider(rules)), key)))(params, x)
    assert_same_tree(theirs, ours)


def test_linen_provider_trains_with_stochastic_rounding():
    """The gemma-style model, every projection in NVFP4 with stochastic rounding (keys from the "nvfp4" stream, a
    new one a step): Adam steps lower the loss, and the same keys give the same steps."""
    model, x = OwnLM(), _qwix_batch(6)
    converted = qwix.quantize_model(model, NVFP4Provider([Rule(".*")]))
    target = normal(x.shape, 7, jnp.float32)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, state, key):
        def loss(p):
            y = converted.apply(p, x, rngs={"nvfp4": key}).astype(jnp.float32)
            return jnp.mean(jnp.square(y - target))

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    def run():
        params = model.init(jax.random.key(0), x)
        state, losses = optimizer.init(params), []
        for i in range(6):
            params, state, value = step(params, state, jax.random.fold_in(jax.random.key(1), i))
            losses.append(float(value))
        return losses

    losses = run()
    assert losses[-1] < 0.8 * losses[0], losses
    assert run() == losses


class ZooBlock(nnx.Module):
    """An NNX block as model zoos write one: q/o as ``nnx.Einsum``, the MLP as ``nnx.Linear``, an own weight
    contracted by ``jnp.einsum`` in the block itself."""

    def __init__(self, rngs: nnx.Rngs):
        self.q_proj = nnx.Einsum("BTD,DNH->BTNH", (D, N, H), rngs=rngs)
        self.o_proj = nnx.Einsum("BTNH,NHD->BTD", (N, H, D), rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)
        self.gate = nnx.Param(normal((D, 2 * D), 9, jnp.float32) * 0.1)

    def __call__(self, x):
        q = self.q_proj(x)
        scores = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BTNS", q, q), axis=-1)
        x = x + self.o_proj(jnp.einsum("BTNS,BSNH->BTNH", scores, q))
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate[...].astype(x.dtype))
        return x + self.down(jax.nn.gelu(gate) * self.up(x))


def _nnx_loss(model, x):
    return jnp.mean(jnp.square(model(x).astype(jnp.float32)))


def test_nnx_provider_gives_quantize_models_bytes():
    """Round to nearest: the forward and backward passes of the provider's model are our quantize_model's, byte for
    byte (the own einsum aside: quantize_model cannot see it, so it is kept by a rule in both)."""
    x = _qwix_batch(2)
    rules = [Rule(".*", RTN)]
    ours = nvfp4_nnx.quantize_model(ZooBlock(nnx.Rngs(0)), rules)
    theirs = qwix.quantize_model(ZooBlock(nnx.Rngs(0)), NVFP4Provider([Rule("", None), *rules]), x)
    got, want = (nnx.jit(nnx.value_and_grad(_nnx_loss))(m, x) for m in (theirs, ours))
    assert_same_tree(got[0], want[0])
    assert_same_tree(nnx.state(got[1], nnx.Param), nnx.state(want[1], nnx.Param))


def test_nnx_provider_trains_with_stochastic_rounding_and_an_optimizer():
    """Every GEMM of the block (the own einsum included) in NVFP4 with stochastic rounding: each op keeps its own
    stream on the module (``nvfp4_<op id>``), a step takes new keys, the same seed gives the same steps."""
    x = _qwix_batch(3)

    def run():
        model = qwix.quantize_model(ZooBlock(nnx.Rngs(0)), NVFP4Provider([Rule(".*")], rngs=nnx.Rngs(nvfp4=1)), x)
        return model, nnx_adam_losses(model, _nnx_loss, x, steps=8, learning_rate=1e-2)

    model, losses = run()
    assert losses[-1] < 0.7 * losses[0]
    assert run()[1] == losses
    assert {name for name in vars(model.up) if name.startswith("nvfp4_")} == {"nvfp4_dot_general0"}
    assert isinstance(model.nvfp4_einsum2, nvfp4_nnx.NVFP4Einsum)  # the block's own gate, its third einsum


def test_provider_reports_a_rule_that_matches_nothing_and_checks_its_arguments():
    x = _qwix_batch(4)
    with pytest.warns(UnmatchedRuleWarning, match="'nothing/.*'"):
        qwix.quantize_model(ZooBlock(nnx.Rngs(0)), NVFP4Provider([Rule("nothing/.*"), Rule(".*", RTN)]), x)
    with pytest.raises(ValueError, match="matched no layer"):
        qwix.quantize_model(ZooBlock(nnx.Rngs(0)), NVFP4Provider([Rule("x")], on_unmatched="raise"), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedRuleWarning)
        qwix.quantize_model(ZooBlock(nnx.Rngs(0)), NVFP4Provider([Rule(".*", RTN)]), x)
    with pytest.raises(TypeError, match=r"jax_nvfp4\.flax\.Rule"):
        NVFP4Provider([qwix.QtRule()])
    with pytest.raises(TypeError, match=r"nnx\.Rngs"):
        NVFP4Provider([Rule(".*")], rngs=jax.random.key(0))


class WeightFirst(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.einsum("FD,BTD->BTF", self.param("w", nn.initializers.normal(0.1), (48, D)), x)


def test_jax_nvfp4_ops_are_what_the_provider_runs():
    """The provider's NVFP4 einsum in a module is jax_nvfp4.einsum with the rule's recipe, a weight given first
    made the second operand; kept by a rule, or matched by none, the call runs as written."""
    model, x = OwnEinsum((D, 48)), _qwix_batch(5)
    params = model.init(jax.random.key(0), "BTD,DF->BTF", x)
    converted = qwix.quantize_model(model, NVFP4Provider([Rule(".*", RTN)]))
    want = jax_nvfp4.einsum("BTD,DF->BTF", x, params["params"]["w"], recipe=RTN)
    assert_same_tree(converted.apply(params, "BTD,DF->BTF", x), want)
    first = WeightFirst()
    params = first.init(jax.random.key(0), x)
    want = jax_nvfp4.einsum("BTD,FD->BTF", x, params["params"]["w"], recipe=RTN)
    assert_same_tree(qwix.quantize_model(first, NVFP4Provider([Rule(".*", RTN)])).apply(params, x), want)
    for rules in ([Rule(".*", None)], [Rule("elsewhere", RTN)]):
        kept = qwix.quantize_model(first, NVFP4Provider(rules, on_unmatched="ignore"))
        assert_same_tree(kept.apply(params, x), first.apply(params, x))


class CheckpointedLayer(nnx.Module):
    """A projection and an RMSNorm-style scale (``"...k,k->...k"``, which contracts nothing)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(normal((D, D), 10, jnp.float32) * 0.1)
        self.scale = nnx.Param(jnp.full((D,), 1.5))

    def __call__(self, x):
        return jnp.einsum("...k,k->...k", jnp.einsum("bd,df->bf", x, self.w[...]), self.scale[...])


class CheckpointedStack(nnx.Module):
    """Its layer run inside ``jax.checkpoint`` of a split / merge function, as MaxText's NNX decoder runs its
    layers (at Qwix's first run too, where the provider makes its ops)."""

    def __init__(self, rngs: nnx.Rngs):
        self.layer = CheckpointedLayer(rngs)

    def __call__(self, x):
        def pure(graph, state, x):
            layer = nnx.merge(graph, state)
            return layer(x), nnx.split(layer)

        y, (graph, state) = jax.checkpoint(pure, static_argnums=(0,))(*nnx.split(self.layer), x)
        self.layer = nnx.merge(graph, state)
        return y


def test_nnx_ops_made_inside_a_transform_train_and_a_scale_stays_as_it_is():
    """The provider makes the layer's op inside the model's jax.checkpoint with stochastic rounding (drawing from an
    outer stream there raised TraceContextError), the op's key derived from its path; the norm's scale einsum
    contracts no axis and is not routed (it was: its scale quantized to FP4)."""
    x = normal((16, D), 11, jnp.float32)
    provider = NVFP4Provider([Rule(".*")], rngs=nnx.Rngs(nvfp4=0))
    model = qwix.quantize_model(CheckpointedStack(nnx.Rngs(0)), provider, x)
    assert provider.seen == {"layer"}
    assert [name for name in vars(model.layer) if name.startswith("nvfp4_")] == ["nvfp4_einsum0"]
    plain = CheckpointedLayer(nnx.Rngs(0))
    want = jax_nvfp4.einsum("bd,df->bf", x, plain.w[...], recipe=Recipe()) * 1.5
    assert_same_tree(model(x), want)
    drawn = int(model.layer.nvfp4_einsum0.rngs.count[...])
    losses = nnx_adam_losses(model, _nnx_loss, x, steps=4, learning_rate=1e-2)
    assert losses[-1] < losses[0]
    assert int(model.layer.nvfp4_einsum0.rngs.count[...]) == drawn + 4  # a key a step


class ShardedBlock(nnx.Module):
    """``nnx.Einsum`` and ``nnx.Linear`` projections as zoo models call them on Explicit meshes (``out_sharding``)."""

    def __init__(self, rngs: nnx.Rngs, sharded: bool):
        meta = (lambda names: {"sharding_names": names}) if sharded else (lambda names: {})
        self.q = nnx.Einsum("BTD,DNH->BTNH", (D, 8, 8), kernel_metadata=meta(("fsdp", "tensor", None)), rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (8, 8, D), kernel_metadata=meta(("tensor", None, "fsdp")), rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, kernel_metadata=meta(("fsdp", "tensor")), rngs=rngs)
        self.down = nnx.Linear(2 * D, D, kernel_metadata=meta(("tensor", "fsdp")), rngs=rngs)
        self.sharded = sharded

    def __call__(self, x):
        def spec(*entries):
            return P(*entries) if self.sharded else None

        x = x + self.o(self.q(x, out_sharding=spec("fsdp", None, "tensor", None)), out_sharding=spec("fsdp"))
        return x + self.down(
            jax.nn.gelu(self.up(x, out_sharding=spec("fsdp", None, "tensor"))), out_sharding=spec("fsdp")
        )


@needs_8_cpus
def test_provider_on_an_explicit_mesh_equals_unsharded():
    """fsdp=2 x tensor=4, Explicit, the calls passing ``out_sharding``: converted by the provider (its first run on
    the mesh), a step's loss and gradients are the unsharded model's to float32 rounding, each gradient typed as
    its parameter."""
    x = normal((8, 16, D), 12, jnp.float32)

    def step(model, x):
        return nnx.value_and_grad(_nnx_loss)(model, x)

    rules = [Rule(".*", RTN)]
    want_loss, want = nnx.jit(step)(qwix.quantize_model(ShardedBlock(nnx.Rngs(0), False), NVFP4Provider(rules), x), x)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=CPUS[:8])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("fsdp"))
        provider = NVFP4Provider(rules)
        loss, grads = nnx.jit(step)(qwix.quantize_model(ShardedBlock(nnx.Rngs(0), True), provider, xs), xs)
        assert jax.typeof(grads.q.kernel[...]).sharding.spec == P("fsdp", "tensor", None)
    assert provider.seen == {"q", "o", "up", "down"}
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    leaves = zip(jax.tree.leaves(nnx.state(grads, nnx.Param)), jax.tree.leaves(nnx.state(want, nnx.Param)), strict=True)
    for g, w in leaves:
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-6 * float(np.max(np.abs(w))))
