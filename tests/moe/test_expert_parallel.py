"""Expert parallelism for the capacity-dispatch MoE (``jax_nvfp4.moe.expert_parallel``) on 8 CPU devices.

The sharded layer is compared with ``reference_mlp``: the unsharded capacity layer's batched
``jax_nvfp4.dot_general``s on the global buffer with the same per-shard routing and capacity (shard s's
slots of expert e at rows [s R, (s+1) R)). ``Recipe(stochastic_rounding=False)``: with stochastic rounding
each shard draws its own random bits.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import CPUS, needs_8_cpus, quantized_shapes, raw_bytes
from jax.sharding import AxisType

import jax_nvfp4
from jax_nvfp4.flax.linen import moe
from jax_nvfp4.flax.nnx import moe as nnx_moe
from jax_nvfp4.moe import expert_parallel as ep
from jax_nvfp4.sharding.hlo import collectives

pytestmark = needs_8_cpus

T, D, H, E = 128, 32, 64, 8
RECIPE = jax_nvfp4.Recipe(stochastic_rounding=False)
GELU = functools.partial(jax.nn.gelu, approximate=False)


def _expert_mesh(shape, names):
    return jax.make_mesh(shape, names, devices=CPUS[:8], axis_types=(AxisType.Auto,) * len(names))


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((E, D, H)) * 0.2, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, H, D)) * 0.2, jnp.float32)
    return x, logits, up, down


_WEIGHTS = jnp.cos(jnp.arange(T * D, dtype=jnp.float32)).reshape(T, D)


def _grads(mesh, data_axes, top_k, capacity_factor, recipe=RECIPE):
    """(y, dropped, (dx, dup, ddown)) of the sharded layer and of the reference, and the compiled sharded step."""
    x, logits, up, down = _inputs()
    kw = dict(top_k=top_k, recipe=recipe, keys=(None, None), activation=GELU, capacity_factor=capacity_factor)

    def sharded(x, up, down):
        y, dropped, _ = ep.expert_parallel_mlp(
            x, logits, up, down, expert_axis="expert", data_axes=data_axes, mesh=mesh, **kw
        )
        return jnp.sum(y * _WEIGHTS), (y, dropped)

    def reference(x, up, down):
        y, dropped = ep.reference_mlp(x, logits, up, down, shards=8, **kw)
        return jnp.sum(y * _WEIGHTS), (y, dropped)

    step = jax.jit(jax.grad(sharded, argnums=(0, 1, 2), has_aux=True))
    compiled = step.lower(x, up, down).compile()
    got = compiled(x, up, down)
    want = jax.jit(jax.grad(reference, argnums=(0, 1, 2), has_aux=True))(x, up, down)
    return got, want, compiled.as_text()


@pytest.fixture(scope="module")
def expert8():
    """Mesh expert=8, top_k=1 (every gate exactly 1: no float32 routing ops whose rounding XLA may compile
    differently for the shard's shape), capacity factor 1: pairs are dropped."""
    return _grads(_expert_mesh((8,), ("expert",)), (), top_k=1, capacity_factor=1.0)


def test_equals_unsharded_bit_for_bit(expert8):
    ((dx, dup, ddown), (y, dropped)), ((rdx, rdup, rddown), (ry, rdropped)), _ = expert8
    assert int(dropped) == int(rdropped) > 0
    for name, got, want in (("y", y, ry), ("dx", dx, rdx), ("d up", dup, rdup), ("d down", ddown, rddown)):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(raw_bytes(got), raw_bytes(want), err_msg=name)


def test_under_jax_checkpoint_each_shards_weights_are_quantized_once():
    """jax.checkpoint recomputes the layer in the backward pass, the activations' quantizes with it but not the
    expert weights' (W [E/D, K, N] = [1, 32, 64] and [1, 64, 32] a shard: saved under every policy), and the
    gradients are the same bytes."""
    mesh = _expert_mesh((8,), ("expert",))
    x, logits, up, down = _inputs()
    kw = dict(top_k=1, recipe=RECIPE, keys=(None, None), activation=GELU, capacity_factor=1.0)

    def loss(x, up, down):
        y = ep.expert_parallel_mlp(x, logits, up, down, expert_axis="expert", data_axes=(), mesh=mesh, **kw)[0]
        return jnp.sum(y * _WEIGHTS)

    grads, weights = [], []
    for layer in (loss, jax.checkpoint(loss)):
        step = jax.grad(layer, argnums=(0, 1, 2))
        shapes = quantized_shapes(jax.make_jaxpr(step)(x, up, down))
        weights.append(sorted(s for s in shapes if s in ((1, D, H), (1, H, D))))
        grads.append(jax.jit(step)(x, up, down))
    assert weights == [[(1, D, H), (1, H, D)]] * 2, weights
    for got, want in zip(grads[1], grads[0], strict=True):
        np.testing.assert_array_equal(raw_bytes(got), raw_bytes(want))


def test_data_axis_top2():
    """Mesh expert=4 x data=2, top_k=2. y: float32 tolerance (the gates' softmax, float32, is compiled for
    the shards' shapes and may round an ulp apart). The kernels' gradients sum the two data shards in float32
    (psum) instead of one GEMM's accumulation: float32 order, then one bfloat16 rounding (one bf16 ulp)."""
    ((dx, dup, ddown), (y, dropped)), ((rdx, rdup, rddown), (ry, rdropped)), _ = _grads(
        _expert_mesh((2, 4), ("data", "expert")), ("data",), top_k=2, capacity_factor=1.0
    )
    assert int(dropped) == int(rdropped) > 0
    np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)
    for name, got, want in (("dx", dx, rdx), ("d up", dup, rdup), ("d down", ddown, rddown)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6 * np.abs(want).max(), err_msg=name)


def test_all_to_alls_move_codes(expert8):
    """The compiled step's all-to-alls (the CPU backend splits each into one piece per peer, 8 here). Per shard:
    R = 16 slots an expert, E/D = 1 expert, D R = 128 slots, d = 32, h = 64.

    forward (jvp): the buffer's rowwise codes u8 [1, 16, 16] and scales u8 [1, 16, 2] (1x16 blocks along d),
      its columnwise codes u8 [1, 32, 8] and scales u8 [1, 32, 1] (blocks along the slots): uint8 only;
      the filled slot counts s32 [1, 1]; the second GEMM's output [1, 16, 32] back, bfloat16 in the program,
      which the CPU backend widens to f32.
    backward (transpose): dy of the second GEMM, quantized at the tokens, the same four u8 arrays; the first
      GEMM's dx [1, 16, 32] back (bfloat16, f32 on CPU).
    """
    *_, text = expert8
    found = collections.Counter(
        ("backward" if "transpose" in c.op_name else "forward", c.dtype, c.shape)
        for c in collectives(text)
        if c.op == "all-to-all"
    )
    codes = {(1, 16, 16): 8, (1, 16, 2): 8, (1, 32, 8): 8, (1, 32, 1): 8}
    want = collections.Counter(
        {("forward", "u8", s): n for s, n in codes.items()}
        | {("backward", "u8", s): n for s, n in codes.items()}
        | {("forward", "s32", (1, 1)): 8, ("forward", "f32", (1, 16, 32)): 8, ("backward", "f32", (1, 16, 32)): 8}
    )
    assert found == want
    # The values the forward exchange sends the experts are never wider than u8 (no bf16 / f32 slots).
    assert not any(
        c.op == "all-to-all" and c.dtype in ("bf16", "f32") and c.shape[-1] == D // 2 for c in collectives(text)
    )


def test_layers_linen_and_nnx():
    """``MoEMLP(dispatch="capacity", expert_axis="expert")`` under ``jax.set_mesh``: linen == the reference ==
    NNX with the same parameters (forward)."""
    mesh = _expert_mesh((8,), ("expert",))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 32, D)), jnp.bfloat16)
    layer = moe.MoEMLP(E, H, top_k=1, recipe=RECIPE, dispatch="capacity", capacity_factor=1.0, expert_axis="expert")
    rng = np.random.default_rng(2)
    _, _, up, down = _inputs()
    params = {"router": {"kernel": jnp.asarray(rng.standard_normal((D, E)), jnp.float32)}, "up": up, "down": down}
    with jax.set_mesh(mesh):
        y, state = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=["intermediates", "losses"]))(params, x)
    tokens = x.reshape(-1, D)
    logits = tokens.astype(jnp.float32) @ params["router"]["kernel"]
    want, dropped = jax.jit(
        functools.partial(
            ep.reference_mlp, shards=8, top_k=1, recipe=RECIPE, keys=(None, None), activation=GELU, capacity_factor=1.0
        )
    )(tokens, logits, params["up"], params["down"])
    np.testing.assert_array_equal(raw_bytes(y), raw_bytes(want.astype(jnp.bfloat16).reshape(x.shape)))
    assert int(state["intermediates"]["dropped"][0]) == int(dropped)

    model = nnx_moe.MoEMLP(
        D,
        H,
        E,
        top_k=1,
        recipe=RECIPE,
        dispatch="capacity",
        capacity_factor=1.0,
        expert_axis="expert",
        rngs=nnx.Rngs(0),
    )
    model.router.kernel[...] = params["router"]["kernel"]
    model.up[...], model.down[...] = params["up"], params["down"]
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_array_equal(raw_bytes(got), raw_bytes(y))
    assert int(model.dropped[...]) == int(dropped)


def test_bad_configs():
    x, logits, up, down = _inputs()
    kw = dict(top_k=1, recipe=RECIPE, keys=(None, None), activation=GELU, capacity_factor=1.0)
    mesh = _expert_mesh((2, 4), ("data", "expert"))
    with pytest.raises(ValueError, match=r"num_experts=6 must be a multiple of the size of mesh axis 'expert' \(4\)"):
        ep.expert_parallel_mlp(x, logits[:, :6], up[:6], down[:6], expert_axis="expert", mesh=mesh, **kw)
    with pytest.raises(ValueError, match=r"the tokens \(100\) must be a multiple of the token shards \(8"):
        ep.expert_parallel_mlp(
            x[:100], logits[:100], up, down, expert_axis="expert", data_axes=("data",), mesh=mesh, **kw
        )
    with pytest.raises(ValueError, match="mesh axis 'experts' is not in the mesh's axes"):
        ep.expert_parallel_mlp(x, logits, up, down, expert_axis="experts", mesh=mesh, **kw)
    with pytest.raises(ValueError, match="must be distinct"):
        ep.expert_parallel_mlp(x, logits, up, down, expert_axis="expert", data_axes=("expert",), mesh=mesh, **kw)
    with pytest.raises(ValueError, match="needs a mesh"):
        ep.expert_parallel_mlp(x, logits, up, down, expert_axis="expert", **kw)
    with pytest.raises(ValueError, match="row_scaled"):
        row_scaled = dict(kw, recipe=jax_nvfp4.Recipe(stochastic_rounding=False, row_scaled_activations=True))
        ep.expert_parallel_mlp(x, logits, up, down, expert_axis="expert", mesh=mesh, **row_scaled)
    with pytest.raises(ValueError, match="needs dispatch='capacity'"):
        moe.MoEMLP(E, H, expert_axis="expert").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="needs dispatch='capacity'"):
        nnx_moe.MoEMLP(D, H, E, expert_axis="expert", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="expert_axis must be a mesh axis name"):
        nnx_moe.MoEMLP(D, H, E, dispatch="capacity", expert_axis=1, rngs=nnx.Rngs(0))
