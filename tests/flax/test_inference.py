"""Inference with quantized weights: QuantizedWeight in dot_general, quantize_weights (linen, NNX), and
checkpoints of quantized trees (orbax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_bytes, eqns_named, normal

import jax_nvfp4
from jax_nvfp4 import Recipe

flax_nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
from jax_nvfp4.flax import NVFP4Dense, NVFP4DenseGeneral  # noqa: E402
from jax_nvfp4.flax import nnx as nvfp4_nnx  # noqa: E402
from jax_nvfp4.flax.linen.layers import quantize_weights  # noqa: E402


@pytest.mark.parametrize(
    "recipe",
    [
        Recipe(),
        Recipe(weight_block_2d=False, row_scaled_activations=True),
        Recipe(four_over_six=jax_nvfp4.FourOverSix("all"), stochastic_rounding=False),
        Recipe(impl="scaled_dot"),
    ],
    ids=["default", "1x16-per-token", "4over6", "scaled_dot"],
)
def test_a_quantized_weight_gives_the_training_forward(recipe):
    """dot_general with quantize_weight(w) as rhs: the forward's bytes, w quantized once."""
    x, w = normal((2, 32, 48), 0, jnp.bfloat16), normal((48, 4, 10), 1, jnp.float32)
    dims = (((2,), (0,)), ((), ()))
    want = jax_nvfp4.dot_general(x, w, dims, recipe=recipe)
    qw = jax_nvfp4.quantize_weight(w, recipe)
    assert_same_bytes(jax_nvfp4.dot_general(x, qw, dims, recipe=recipe), want)
    # Two contracted axes: x [2, 32, 6, 8] . w [6, 8, 40].
    x2, w2 = normal((2, 32, 6, 8), 2, jnp.bfloat16), normal((6, 8, 40), 3, jnp.float32)
    dims2 = (((2, 3), (0, 1)), ((), ()))
    got = jax_nvfp4.dot_general(x2, jax_nvfp4.quantize_weight(w2, recipe, contract_ndim=2), dims2, recipe=recipe)
    assert_same_bytes(got, jax_nvfp4.dot_general(x2, w2, dims2, recipe=recipe))


def test_a_quantized_weight_is_0_5625_bytes_a_value():
    qw = jax_nvfp4.quantize_weight(normal((256, 128), 0, jnp.float32))
    assert qw.tensor.data_t is None and qw.tensor.scale_t is None  # the rowwise copy only
    nbytes = sum(a.nbytes for a in jax.tree.leaves(qw))
    assert nbytes == 256 * 128 * 0.5625 + 4  # codes, E4M3 scales, one float32 amax


@pytest.mark.parametrize("block_2d", [True, False], ids=["16x16", "1x16"])
def test_dequantize_weight_decodes_the_stored_w_transposed(block_2d):
    """dequantize_weight gives the kernel's shape back, with the values of the reference's W^T quantization."""
    w = normal((3, 16, 40), 0, jnp.float32)  # two contracted axes: K = 48, N = 40
    qw = jax_nvfp4.quantize_weight(w, Recipe(weight_block_2d=block_2d), contract_ndim=2)
    ref = jax_nvfp4.reference
    want = ref.dequantize(ref.quantize(w.reshape(48, 40).T, block_2d=block_2d)).T.reshape(w.shape)
    got = jax_nvfp4.dequantize_weight(qw)
    assert got.shape == w.shape
    assert_same_bytes(got, want)
    assert jax_nvfp4.dequantize_weight(qw, jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="takes a QuantizedWeight"):
        jax_nvfp4.dequantize_weight(w)


def test_quantized_weight_errors():
    w = normal((48, 40), 0, jnp.float32)
    qw = jax_nvfp4.quantize_weight(w)
    with pytest.raises(ValueError, match="contracts its first 1 axes"):
        jax_nvfp4.dot_general(normal((16, 40), 1, jnp.bfloat16), qw, (((1,), (1,)), ((), ())))
    with pytest.raises(ValueError, match="contract_ndim"):
        jax_nvfp4.quantize_weight(w, contract_ndim=2)
    with pytest.raises(TypeError, match="float32 kernel"):
        jax_nvfp4.quantize_weight(w.astype(jnp.int32))


class _LinenModel(flax_nn.Module):
    """Plain and NVFP4 layers side by side, as a user's model would have them."""

    @flax_nn.compact
    def __call__(self, x):
        x = flax_nn.Dense(32, name="embed")(x)  # stays in bf16
        h = NVFP4DenseGeneral((2, 16), name="qkv")(x)
        y = NVFP4DenseGeneral(32, axis=(-2, -1), name="out")(h)
        y = NVFP4Dense(48, recipe=Recipe(four_over_six=jax_nvfp4.FourOverSix("weights")), name="mlp")(jax.nn.gelu(y))
        return flax_nn.Dense(8, name="head")(y)


def test_linen_quantize_weights_applies_the_stored_weights():
    model, x = _LinenModel(), normal((2, 16, 24), 0, jnp.bfloat16)
    params = model.init(jax.random.key(0), x)["params"]
    qparams = quantize_weights(params, model=model, inputs=(x[:1],))
    for name in ("qkv", "out", "mlp"):
        assert isinstance(qparams[name]["kernel"], jax_nvfp4.QuantizedWeight), name
        assert qparams[name]["kernel"].shape == params[name]["kernel"].shape
    for name in ("embed", "head"):  # not NVFP4 layers: untouched
        assert_same_bytes(qparams[name]["kernel"], params[name]["kernel"])
    assert qparams["mlp"]["kernel"].tensor.spec.four_over_six_error == "mse"  # the layer's own recipe
    # Applied as stored, the model gives the training forward's bytes; the weights are not quantized again.
    assert_same_bytes(model.apply({"params": qparams}, x), model.apply({"params": params}, x))
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(qparams)
    assert len(eqns_named(jaxpr, "nvfp4_quantize")) == 3  # the three layers' inputs, no weight


def test_nnx_quantize_weights_applies_the_stored_weights():
    rngs = nnx.Rngs(0, nvfp4=1)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(24, 32, dot_general=nvfp4_nnx.NVFP4DotGeneral(rngs=rngs), rngs=rngs)
            general = nvfp4_nnx.NVFP4DotGeneral(rngs=rngs)
            self.b = nnx.LinearGeneral((2, 16), 8, axis=(-2, -1), dot_general=general, rngs=rngs)
            self.head = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(self.b(self.a(x).reshape(*x.shape[:-1], 2, 16)))

    model, x = Model(rngs), normal((2, 16, 24), 0, jnp.bfloat16)
    want = model(x)
    head = model.head.kernel[...]
    assert nvfp4_nnx.quantize_weights(model) is model
    assert isinstance(model.a.kernel[...], jax_nvfp4.QuantizedWeight)
    assert model.b.kernel[...].contract_ndim == 2 and model.head.kernel[...] is head
    assert_same_bytes(model(x), want)
    assert_same_bytes(nnx.jit(lambda m, x: m(x))(model, x), want)


def test_orbax_round_trip_and_a_bf16_checkpoint_into_the_quantized_model(tmp_path):
    """Save and restore a quantized tree byte for byte with its metadata; restore a bf16 checkpoint
    (orbax, as a user saves one) and quantize it for the model."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from jax_nvfp4 import checkpoint

    model, x = _LinenModel(), normal((2, 16, 24), 0, jnp.bfloat16)
    params = model.init(jax.random.key(0), x)["params"]
    qparams = quantize_weights(params, model=model, inputs=(x[:1],))
    checkpoint.save(tmp_path / "quantized", qparams)
    restored = checkpoint.restore(tmp_path / "quantized")
    assert jax.tree.structure(restored) == jax.tree.structure(qparams)  # shapes, dtypes and specs included
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(qparams), strict=True):
        assert_same_bytes(got, want)
    assert_same_bytes(model.apply({"params": restored}, x), model.apply({"params": qparams}, x))

    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    with ocp.StandardCheckpointer() as saver:
        saver.save(tmp_path / "bf16", bf16)
    with ocp.StandardCheckpointer() as loader:
        loaded = loader.restore(tmp_path / "bf16")
    served = quantize_weights(loaded, model=model, inputs=(x[:1],))
    assert_same_bytes(model.apply({"params": served}, x), model.apply({"params": bf16}, x))


def test_a_16x16_tensor_is_saved_with_one_copy_and_restored_with_both(tmp_path, monkeypatch):
    """Both copies of a 16x16-block tensor restore byte for byte from its rowwise copy alone (the columnwise
    copy is not written); 1x16 tensors keep both copies; a checkpoint written with both copies still restores."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from jax_nvfp4 import checkpoint

    x = normal((3, 40, 56), 1, jnp.bfloat16)
    tree = {
        "w": jax_nvfp4.quantize(x, block_2d=True, columnwise=True),
        "x": jax_nvfp4.quantize(x, columnwise=True),
    }
    checkpoint.save(tmp_path / "one", tree)
    restored = checkpoint.restore(tmp_path / "one")
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), strict=True):
        assert_same_bytes(got, want)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    stored = {m["path"][0]: m["tensor"].get("columnwise") for m in _saved_metadata(tmp_path / "one")}
    assert stored == {"w": "transposed", "x": None}
    with ocp.StandardCheckpointer() as reader:
        written = reader.restore(tmp_path / "one" / "arrays")
    assert set(written["w"]) == {"data", "scale", "amax"} and "data_t" in written["x"]

    # A checkpoint written with both copies (as before this format): the writer told they differ.
    assert checkpoint._transposes(tree["w"]) and not checkpoint._transposes(tree["x"])
    monkeypatch.setattr(checkpoint, "_transposes", lambda t: False)
    checkpoint.save(tmp_path / "both", tree)
    assert all(m["tensor"].get("columnwise") is None for m in _saved_metadata(tmp_path / "both"))
    for got, want in zip(jax.tree.leaves(checkpoint.restore(tmp_path / "both")), jax.tree.leaves(tree), strict=True):
        assert_same_bytes(got, want)


def _saved_metadata(directory) -> list[dict]:
    import json
    import pathlib

    return json.loads((pathlib.Path(directory) / "nvfp4" / "metadata").read_text())["quantized"]
