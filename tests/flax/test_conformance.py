"""Conformance: the call patterns of published JAX models, converted by rules as they are written, trained, compared.

Written here after how model zoos build and call their layers (jax-ml/bonsai's Qwen3 for NNX on Explicit meshes,
google-deepmind/gemma and flax's lm1b/MaxText for linen), none of their code copied: GQA projections as
multi-axis ``nnx.Einsum`` (``BTD,DKH->BTKH``, ``BTNH,NHD->BTD``) called with ``out_sharding=``, ``nnx.List`` and
``nnx.Sequential`` blocks, a tied head (``nnx.Embed.attend``, left alone), ``nn.DenseGeneral`` over
``axis=(-2, -1)``, a vocabulary head of 50257 (not a multiple of 16) and a contraction of K = 40, ``nn.scan`` and
``nnx.scan`` stacks, dropout with ``deterministic``, bf16 parameters computed in float32 and the reverse.

Each pattern: the forward pass quantizes exactly the GEMMs the rules select (2 quantize calls a GEMM, its x and w:
none silently stays in its input precision), a few Adam steps train, and the NVFP4 losses stay within
``LOSS_GAP`` of the unconverted twin's. The zoo-style decoder's step on an Explicit 2x4 mesh (fsdp x tensor, its
layers called with ``out_sharding``) equals its unsharded step: the loss to float32 rounding (``rtol`` 1e-5), and
each gradient's values to 1e-5 of its largest magnitude but for at most 3% of them, which stay within 5% of it.
Those are XLA's other order of float32 partial sums over the tensor axis: where a sum lands on the other side of
an NVFP4 rounding boundary, a value moves by one E2M1 step and its block's products with it (seen: 1.4% of one
gradient's values, by up to 1.7% of its largest).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CPUS, needs_8_cpus, nnx_adam_losses, normal, quantized_shapes
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import Recipe

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
from jax_nvfp4.flax import Rule, quantize_model  # noqa: E402
from jax_nvfp4.flax import nnx as nvfp4_nnx  # noqa: E402
from jax_nvfp4.flax.nnx.layers import NVFP4Op  # noqa: E402

RTN = Recipe(stochastic_rounding=False)
LOSS_GAP = 0.2  # NVFP4's losses within 20% of the unconverted twin's over the first steps
STEPS = 4
D, N, K, H, F = 64, 8, 4, 8, 128  # model width, query heads, kv heads (GQA), head width, MLP width


def _target(shape, seed=11):
    return normal(shape, seed, jnp.float32)


# ---- NNX: a Qwen3-style decoder as a zoo writes it for Explicit meshes ---------------------------------------


def _act(spec, sharded: bool):
    return spec if sharded else None


class ZooAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, sharded: bool):
        meta = (lambda names: {"sharding_names": names}) if sharded else (lambda names: {})
        self.sharded = sharded
        self.q_proj = nnx.Einsum("BTD,DNH->BTNH", (D, N, H), kernel_metadata=meta(("fsdp", "tensor", None)), rngs=rngs)
        self.k_proj = nnx.Einsum("BSD,DKH->BSKH", (D, K, H), kernel_metadata=meta(("fsdp", "tensor", None)), rngs=rngs)
        self.v_proj = nnx.Einsum("BSD,DKH->BSKH", (D, K, H), kernel_metadata=meta(("fsdp", "tensor", None)), rngs=rngs)
        self.o_proj = nnx.Einsum("BTNH,NHD->BTD", (N, H, D), kernel_metadata=meta(("tensor", None, "fsdp")), rngs=rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        s = self.sharded
        h = self.norm(x)
        q = self.q_proj(h, out_sharding=_act(P("fsdp", None, "tensor", None), s))
        k = self.k_proj(h, out_sharding=_act(P("fsdp", None, "tensor", None), s))
        v = self.v_proj(h, out_sharding=_act(P("fsdp", None, "tensor", None), s))
        b, t = x.shape[:2]
        q = q.reshape(b, t, K, N // K, H)
        scores = jnp.einsum("BTKGH,BSKH->BTSKG", q, k) / np.sqrt(H)
        mask = jnp.tril(jnp.ones((t, t), bool))[None, :, :, None, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=2)
        out = jnp.einsum("BTSKG,BSKH->BTKGH", probs, v).reshape(b, t, N, H)
        return x + self.o_proj(out, out_sharding=_act(P("fsdp", None, None), s))


class ZooMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, sharded: bool):
        meta = (lambda names: {"sharding_names": names}) if sharded else (lambda names: {})
        self.sharded = sharded
        self.gate_proj = nnx.Linear(D, F, use_bias=False, kernel_metadata=meta(("fsdp", "tensor")), rngs=rngs)
        self.up_proj = nnx.Linear(D, F, use_bias=False, kernel_metadata=meta(("fsdp", "tensor")), rngs=rngs)
        self.down_proj = nnx.Linear(F, D, use_bias=False, kernel_metadata=meta(("tensor", "fsdp")), rngs=rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        s, spec = self.sharded, P("fsdp", None, "tensor")
        h = self.norm(x)
        g = jax.nn.silu(self.gate_proj(h, out_sharding=_act(spec, s))) * self.up_proj(h, out_sharding=_act(spec, s))
        return x + self.down_proj(g, out_sharding=_act(P("fsdp", None, None), s))


class ZooDecoder(nnx.Module):
    """Embedding, an ``nnx.List`` of blocks (each an ``nnx.Sequential`` of attention and MLP) and a tied head."""

    def __init__(self, rngs: nnx.Rngs, sharded: bool = False, layers: int = 2, vocab: int = 96):
        self.embed = nnx.Embed(vocab, D, rngs=rngs)
        self.layers = nnx.List(
            [nnx.Sequential(ZooAttention(rngs, sharded), ZooMLP(rngs, sharded)) for _ in range(layers)]
        )
        self.sharded = sharded

    def __call__(self, tokens):
        x = self.embed.embedding[...].at[(tokens,)].get(out_sharding=_act(P("fsdp", None, None), self.sharded))
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(x, out_sharding=_act(P("fsdp", None, None), self.sharded))  # tied: left alone


def _zoo_tokens(shape=(8, 16), vocab=96, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _nnx_train(model, loss, *batch):
    return nnx_adam_losses(model, loss, *batch, steps=STEPS, learning_rate=3e-3)


def _forward_quantizes(fn, *args) -> int:
    return len(quantized_shapes(jax.make_jaxpr(fn)(*args)))


def _nnx_forward_quantizes(model, *args) -> int:
    """Quantize calls in ``model``'s forward pass (traced on a copy: its RNG streams advance in the trace)."""
    graph, state = nnx.split(model)
    return _forward_quantizes(lambda state: nnx.merge(graph, state)(*args), state)


def _assert_trains_as_its_twin(nvfp4: list[float], plain: list[float]) -> None:
    assert nvfp4[-1] < nvfp4[0], nvfp4
    np.testing.assert_allclose(nvfp4, plain, rtol=LOSS_GAP)


ZOO_RULES = [Rule(".*", Recipe())]


def test_zoo_decoder_converts_every_projection_and_trains():
    """q/k/v/o (multi-axis GQA einsums), gate/up/down: 7 GEMMs a block in NVFP4, the tied head and the attention
    scores as they are; paths as the rules see them, one a layer."""
    tokens = _zoo_tokens()
    model = nvfp4_nnx.quantize_model(ZooDecoder(nnx.Rngs(0)), ZOO_RULES, rngs=nnx.Rngs(nvfp4=1))
    paths = sorted("/".join(map(str, p)) for p, n in nnx.iter_graph(model) if isinstance(n, NVFP4Op))
    assert len(paths) == 14 and paths[0] == "layers/0/layers/0/k_proj/einsum_op", paths
    assert _nnx_forward_quantizes(model, tokens) == 2 * 14
    _assert_trains_as_its_twin(
        _nnx_train(model, _lm_loss, tokens), _nnx_train(ZooDecoder(nnx.Rngs(0)), _lm_loss, tokens)
    )


@needs_8_cpus
def test_zoo_decoder_step_on_an_explicit_mesh_equals_unsharded():
    """fsdp=2 x tensor=4, Explicit: the parameters sharded by their metadata, every projection called with
    ``out_sharding``; a training step's loss and gradients equal the unsharded model's (module docstring), and
    each gradient carries its parameter's sharding."""
    tokens = _zoo_tokens()

    def step(model, tokens):
        return nnx.value_and_grad(_lm_loss)(model, tokens)

    rules = [Rule(".*", RTN)]
    want_loss, want = nnx.jit(step)(nvfp4_nnx.quantize_model(ZooDecoder(nnx.Rngs(0)), rules), tokens)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=CPUS[:8])
    with jax.set_mesh(mesh):
        model = nvfp4_nnx.quantize_model(ZooDecoder(nnx.Rngs(0), sharded=True), rules)
        loss, grads = nnx.jit(step)(model, jax.device_put(tokens, P("fsdp")))
        q = grads["layers"][0]["layers"][0]["q_proj"]["kernel"][...]
        assert jax.typeof(q).sharding.spec == P("fsdp", "tensor", None)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    leaves = zip(jax.tree.leaves(nnx.state(grads, nnx.Param)), jax.tree.leaves(nnx.state(want, nnx.Param)), strict=True)
    for g, w in leaves:
        scale = float(np.max(np.abs(w)))
        off = np.abs(np.asarray(g) - np.asarray(w))
        assert np.mean(off > 1e-5 * scale) <= 0.03 and np.max(off) <= 0.05 * scale, (
            np.mean(off > 1e-5 * scale),
            off.max(),
        )


# ---- NNX: scan-stacked layers, dropout, dtypes -------------------------------------------------------------


class ScanBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(jax.nn.gelu(self.up(x))))


class ScanStack(nnx.Module):
    """Three blocks made by ``nnx.vmap`` (parameters stacked on a leading axis) and run by ``nnx.scan``."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return ScanBlock(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)  # each block's streams stacked with it
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


def _mse(model, x, target):
    return jnp.mean(jnp.square(model(x).astype(jnp.float32) - target))


def test_nnx_scan_stacked_layers_take_a_key_each():
    """One path a stacked layer (``blocks/up``, ``blocks/down``), each layer of the stack its own stochastic-rounding
    stream (``nnx.scan`` hands them out, as the parameters), dropout on; trains as its twin."""
    x = normal((4, 16, D), 1, jnp.float32)
    model = nvfp4_nnx.quantize_model(ScanStack(nnx.Rngs(0)), ZOO_RULES, rngs=nnx.Rngs(nvfp4=1))
    assert model.blocks.up.dot_general.rngs.key[...].shape == (3,)
    assert _nnx_forward_quantizes(model, x) == 2 * 2  # the scan's body, once
    target = _target(x.shape)
    losses = _nnx_train(model, _mse, x, target)
    assert model.blocks.down.dot_general.rngs.count[...].tolist() == [STEPS] * 3
    _assert_trains_as_its_twin(losses, _nnx_train(ScanStack(nnx.Rngs(0)), _mse, x, target))
    model.eval()  # deterministic dropout: the same output twice
    np.testing.assert_array_equal(model(x), model(x))


@pytest.mark.parametrize(("param_dtype", "dtype"), [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_nnx_param_and_compute_dtypes(param_dtype, dtype):
    """A layer's result has its plain twin's dtype, its gradient its parameter's."""
    x = normal((4, 16, D), 2, jnp.bfloat16)

    def make():
        return nnx.Sequential(
            nnx.Linear(D, F, param_dtype=param_dtype, dtype=dtype, rngs=nnx.Rngs(0)),
            nnx.LinearGeneral(F, (2, D // 2), param_dtype=param_dtype, dtype=dtype, rngs=nnx.Rngs(1)),
        )

    plain, model = make(), nvfp4_nnx.quantize_model(make(), ZOO_RULES, rngs=nnx.Rngs(nvfp4=1))
    assert model(x).dtype == plain(x).dtype == dtype
    assert _nnx_forward_quantizes(model, x) == 2 * 2
    grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    assert {g.dtype for g in jax.tree.leaves(nnx.state(grads, nnx.Param))} == {np.dtype(param_dtype)}
    target = _target((4, 16, 2, D // 2))
    _assert_trains_as_its_twin(_nnx_train(model, _mse, x, target), _nnx_train(plain, _mse, x, target))


# ---- linen: DenseGeneral over two axes, odd sizes, nn.scan, dropout, dtypes ----------------------------------


class LinenAttentionOut(nn.Module):
    """q as ``DenseGeneral(features=(N, H))``, the output as ``DenseGeneral(axis=(-2, -1))`` (flax's attention,
    lm1b, MaxText), dropout between them; then a K = 40 projection and a 50257-way head."""

    deterministic: bool = False

    @nn.compact
    def __call__(self, x):
        q = nn.DenseGeneral((N, H), name="query")(x)
        q = nn.Dropout(0.1, deterministic=self.deterministic)(q)
        y = nn.DenseGeneral(40, axis=(-2, -1), name="out")(q)
        return nn.Dense(50257, name="head")(nn.Dense(D, name="narrow")(y))  # narrow: K = 40


def _linen_train(model, params, x, target, rngs_fn, steps=STEPS):
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(params, state, i):
        def loss(p):
            y = model.apply(p, x, rngs=rngs_fn(i))
            return jnp.mean(jnp.square(y.astype(jnp.float32) - target))

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state, losses = optimizer.init(params), []
    for i in range(steps):
        params, state, value = step(params, state, i)
        losses.append(float(value))
    return losses


def test_linen_dense_general_over_two_axes_odd_sizes_and_dropout():
    x = normal((2, 8, D), 3, jnp.float32)
    plain = LinenAttentionOut()
    params = plain.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    model = quantize_model(plain, [Rule(".*", Recipe())])
    test_mode = quantize_model(LinenAttentionOut(deterministic=True), [Rule(".*", Recipe())])
    assert _forward_quantizes(lambda p: test_mode.apply(p, x), params) == 2 * 4
    y = model.apply(params, x, rngs={"dropout": jax.random.key(2)})
    assert y.shape == (2, 8, 50257)

    def rngs(i):
        return {"dropout": jax.random.fold_in(jax.random.key(3), i), "nvfp4": jax.random.fold_in(jax.random.key(4), i)}

    target = _target(y.shape)
    _assert_trains_as_its_twin(
        _linen_train(model, params, x, target, rngs), _linen_train(plain, params, x, target, rngs)
    )


class LinenScanBlock(nn.Module):
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, _):
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)
        return x + dense(D, name="down")(jax.nn.gelu(dense(F, name="up")(x))).astype(x.dtype), None


class LinenScanStack(nn.Module):
    """Three layers by ``nn.scan`` (MaxText's and T5X's stacks): parameters on a leading axis, one path a layer."""

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            LinenScanBlock, variable_axes={"params": 0}, split_rngs={"params": True, "nvfp4": True}, length=3
        )
        return stack(self.dtype, self.param_dtype, name="layers")(x, None)[0]


@pytest.mark.parametrize(("param_dtype", "dtype"), [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32)])
def test_linen_scan_stacked_layers_and_dtypes(param_dtype, dtype):
    x = normal((4, 16, D), 4, jnp.float32)
    plain = LinenScanStack(dtype, param_dtype)
    params = plain.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params)["params"]["layers"]["up"]["kernel"] == (3, D, F)
    model = quantize_model(plain, [Rule("layers/up", Recipe()), Rule("layers/down", Recipe())], on_unmatched="raise")
    assert _forward_quantizes(lambda p: model.apply(p, x), params) == 2 * 2
    grads = jax.grad(lambda p: jnp.sum(model.apply(p, x, rngs={"nvfp4": jax.random.key(1)})))(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(param_dtype)}

    def rngs(i):
        return {"nvfp4": jax.random.fold_in(jax.random.key(5), i)}

    target = _target(x.shape)
    _assert_trains_as_its_twin(
        _linen_train(model, params, x, target, rngs), _linen_train(plain, params, x, target, rngs)
    )


# ---- Operands NVFP4 cannot take: an error naming the layer --------------------------------------------------


def test_operands_nvfp4_cannot_take_name_the_layer():
    """Complex operands (integers likewise), no contraction or one of size 0, in a layer a rule matches: an error
    naming its path and the rule that keeps it, raised before any kernel sees them."""

    class Two(nnx.Module):
        def __init__(self, rngs, **kw):
            self.blocks = nnx.List([nnx.Linear(D, D, rngs=rngs), nnx.Linear(D, D, rngs=rngs, **kw)])

        def __call__(self, x):
            return self.blocks[1](self.blocks[0](x))

    complex_model = nvfp4_nnx.quantize_model(Two(nnx.Rngs(0), param_dtype=jnp.complex64), [Rule(".*", RTN)])
    with pytest.raises(TypeError, match=r"layer at 'blocks/1'.*inputs are complex64.*Rule\('blocks/1', None\)"):
        complex_model(jnp.ones((2, D)))
    empty = nnx.Einsum("bk,kf->bf", (0, 8), kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
    nvfp4_nnx.quantize_model(empty, [Rule(".*", RTN)])
    with pytest.raises(ValueError, match=r"at '': its GEMM contracts an axis of size 0"):
        empty(jnp.ones((2, 0)))
    scale = nvfp4_nnx.quantize_model(
        nnx.Einsum("bd,d->bd", (D,), kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0)), [Rule(".*", RTN)]
    )
    with pytest.raises(ValueError, match=r"contracts no axis, so it is no GEMM"):
        scale(jnp.ones((2, D)))

    class Complex(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, param_dtype=jnp.complex64, name="proj")(x)

    x = jnp.ones((2, 4), jnp.float32)
    params = Complex().init(jax.random.key(0), x)
    with pytest.raises(TypeError, match=r"Dense at 'proj'.*inputs are complex64"):
        quantize_model(Complex(), [Rule(".*", RTN)]).apply(params, x)
