"""Sharding on 8 CPU devices: partitioned primitives, quantized all-gather, sharded training.

Meshes (8,), (2, 4) and (4, 2). Quantization is deterministic, so sharded
results are compared with unsharded ones byte for byte; only the float32
reductions of a sharded GEMM may round in another order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, assert_same_tensor, dequantized_blocks, needs_8_cpus, raw_bytes
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4.sharding.hlo import collectives

pytestmark = needs_8_cpus

MESHES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("x", "y")), "4x2": ((4, 2), ("x", "y"))}


def _mesh(name: str) -> jax.sharding.Mesh:
    shape, axes = MESHES[name]
    return jax.make_mesh(shape, axes, devices=CPUS[:8], axis_types=(AxisType.Auto,) * len(axes))


def _random(shape, dtype=jnp.bfloat16, seed=0) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, shape)
    return jnp.asarray(x, dtype)


def _ops(compiled_text: str) -> set[str]:
    return {c.op for c in collectives(compiled_text)}


# (mesh, input shape, spec, block_2d). The 3D cases shard an inner leading axis
# (batch and sequence): each shard's rows are then not a contiguous run of the
# flat columnwise copy [N, M/2], which XLA assembles by moving its packed bytes.
QUANTIZE_CASES = [
    ("8", (256, 128), P("x", None), False),
    ("8", (128, 256), P(None, "x"), True),
    ("2x4", (128, 512), P("x", "y"), True),
    ("2x4", (4, 64, 256), P("x", "y", None), False),
    ("4x2", (128, 64), P("x", "y"), False),
    ("4x2", (8, 128, 64), P(None, "x", "y"), True),
]


@pytest.mark.parametrize("mesh_name,shape,spec,block_2d", QUANTIZE_CASES)
def test_sharded_quantize_is_the_unsharded_bytes_with_no_gather(mesh_name, shape, spec, block_2d):
    mesh = _mesh(mesh_name)
    x = _random(shape)
    quantize = functools.partial(jax_nvfp4.quantize, columnwise=True, block_2d=block_2d)
    want = quantize(x)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(quantize)
    got = f(xs)
    assert_same_tensor(got, want)
    assert got.data.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape))  # codes stay with their values
    # Local kernels: the input never moves; the amax is an all-reduce of one float32 as int32 bits.
    found = collectives(f.lower(xs).compile().as_text())
    assert [c[:4] for c in found if c.op == "all-reduce"] == [("all-reduce", "s32", (1,), 4)]
    moved = [c for c in found if c.op != "all-reduce"]
    if len(shape) == 2:
        assert not moved, moved
    else:  # only the columnwise copy's codes (u8) and scales (E4M3, widened to f16 by XLA on CPU)
        assert {c.dtype for c in moved} <= {"u8", "f16"} and sum(c.nbytes for c in moved) < x.size // 2, moved
    np.testing.assert_array_equal(jax.jit(jax_nvfp4.dequantize)(got), jax_nvfp4.dequantize(want))


def test_shards_that_would_split_a_block_are_gathered_first():
    mesh = _mesh("8")
    x = _random((64, 8 * 24))  # 24 columns a shard: not whole 16-value blocks
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    f = jax.jit(jax_nvfp4.quantize)
    assert_same_tensor(f(xs), jax_nvfp4.quantize(x))
    assert "all-gather" in _ops(f.lower(xs).compile().as_text())


def test_a_tensor_with_a_ragged_last_block_dequantizes_on_a_mesh():
    # Its column factors need replication: Shardy wants them listed in the order they appear in the rule.
    mesh = _mesh("8")
    x = _random((64, 40))
    ts = jax.jit(jax_nvfp4.quantize)(jax.device_put(x, NamedSharding(mesh, P("x", None))))
    np.testing.assert_array_equal(jax.jit(jax_nvfp4.dequantize)(ts), jax_nvfp4.dequantize(jax_nvfp4.quantize(x)))


@pytest.mark.parametrize("special", [np.nan, np.inf, 0.0])
def test_sharded_amax_keeps_specials(special):
    mesh = _mesh("2x4")
    x = _random((64, 128), jnp.float32).at[40, 100].set(special)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
    np.testing.assert_array_equal(raw_bytes(jax.jit(jax_nvfp4.amax)(xs)), raw_bytes(jax_nvfp4.amax(x)))
    assert_same_tensor(jax.jit(jax_nvfp4.quantize)(xs), jax_nvfp4.quantize(x))


def test_amax_mesh_axes_scopes_the_reduction():
    """Reduced over "x" only: each "y" shard is quantized with the amax of its own columns."""
    mesh = _mesh("2x4")
    x = _random((64, 256), jnp.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
    got = jax.jit(functools.partial(jax_nvfp4.quantize, amax_mesh_axes=("x",)))(xs)
    for j in range(4):
        cols = slice(64 * j, 64 * (j + 1))
        want = jax_nvfp4.quantize(x[:, cols])
        np.testing.assert_array_equal(raw_bytes(got.data[:, 32 * j : 32 * (j + 1)]), raw_bytes(want.data))
        np.testing.assert_array_equal(raw_bytes(got.scale[:, 4 * j : 4 * (j + 1)]), raw_bytes(want.scale))
    # The default (all sharded axes) is the unsharded quantization.
    assert_same_tensor(jax.jit(jax_nvfp4.quantize)(xs), jax_nvfp4.quantize(x))
    with pytest.raises(ValueError, match="amax_mesh_axes"):
        jax_nvfp4.quantize(x, amax=1.0, amax_mesh_axes=("x",))
    with pytest.raises(TypeError, match="mesh axis names"):
        jax_nvfp4.amax(x, amax_mesh_axes=(0,))


def test_recipe_amax_mesh_axes_scopes_dot_general():
    """Recipe(amax_mesh_axes=()): no amax reduction, so each data shard's rows are quantized with their own amax
    and give what dot_general gives on those rows alone; the default reduces and gives the unsharded result."""
    mesh = _mesh("8")
    x, w = _random((64, 128), jnp.float32), _random((128, 32), jnp.float32, seed=1)
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    dims = (((1,), (0,)), ((), ()))
    local = jax_nvfp4.Recipe(amax_mesh_axes=())
    got = jax.jit(lambda x, w: jax_nvfp4.dot_general(x, w, dims, recipe=local))(xs, w)
    for i in range(8):
        rows = slice(8 * i, 8 * (i + 1))
        want = jax_nvfp4.dot_general(x[rows], w, dims)
        np.testing.assert_array_equal(raw_bytes(got[rows]), raw_bytes(want))
    default = jax.jit(lambda x, w: jax_nvfp4.dot_general(x, w, dims))(xs, w)
    np.testing.assert_array_equal(raw_bytes(default), raw_bytes(jax_nvfp4.dot_general(x, w, dims)))
    assert jax_nvfp4.Recipe(amax_mesh_axes=["fsdp", "seq"]).amax_mesh_axes == ("fsdp", "seq")
    with pytest.raises(TypeError, match="mesh axis names"):
        jax_nvfp4.Recipe(amax_mesh_axes=(1,))


# (mesh, gathered mesh axes, input shape, in_spec, axis, tiled)
GATHER_CASES = [
    ("8", "x", (256, 64), P("x", None), 0, True),
    ("8", "x", (2, 8 * 16, 32), P(None, "x", None), 1, True),  # sequence axis: shards interleave in M
    ("2x4", "y", (64, 128), P("x", "y"), 1, True),  # the last (blocked) axis
    ("2x4", ("x", "y"), (8 * 32, 48), P(("x", "y"), None), 0, False),
    ("4x2", "x", (4, 64, 32), P("x", None, "y"), 0, True),
]


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("mesh_name,axis_name,shape,spec,axis,tiled", GATHER_CASES)
def test_all_gather_is_quantize_of_the_gathered_tensor(mesh_name, axis_name, shape, spec, axis, tiled, block_2d):
    mesh = _mesh(mesh_name)
    x = _random(shape)

    def gather(x):
        amax = lax.pmax(jax_nvfp4.amax(x), mesh.axis_names)  # one amax, as in the unsharded tensor
        t = jax_nvfp4.quantize(x, columnwise=True, block_2d=block_2d, amax=amax)
        g = jax_nvfp4.all_gather(t, axis_name, axis=axis, tiled=tiled)
        return g.data, g.scale, g.data_t, g.scale_t, g.amax, jax.numpy.asarray(g.shape)

    gathered_spec = list(spec)
    gathered_spec[axis] = None
    if not tiled:
        gathered_spec.insert(axis, None)
    f = jax.jit(
        jax.shard_map(
            gather,
            mesh=mesh,
            in_specs=spec,
            out_specs=(P(*gathered_spec), P(*gathered_spec), P(), P(), P(), P()),
            check_vma=False,
        )
    )
    data, scale, data_t, scale_t, amax, _ = f(x)
    # Along the mesh axes not gathered, each shard holds its own part; compare the gathered axis.
    sub = x
    for dim, names in enumerate(spec):
        gathered = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        names = () if names is None else names if isinstance(names, tuple) else (names,)
        if names and not set(names) <= set(gathered):
            sub = lax.slice_in_dim(sub, 0, shape[dim] // mesh.shape[names[0]], axis=dim)
    want = jax_nvfp4.quantize(sub, columnwise=True, block_2d=block_2d, amax=jax_nvfp4.amax(x))
    if not tiled:
        data, scale = (a.reshape(*sub.shape[:-1], -1) for a in (data, scale))
    np.testing.assert_array_equal(raw_bytes(amax), raw_bytes(want.amax))
    for got, name in ((data, "data"), (scale, "scale"), (data_t, "data_t"), (scale_t, "scale_t")):
        expected = getattr(want, name)  # the first shard along the axes not gathered
        np.testing.assert_array_equal(raw_bytes(got[tuple(slice(0, n) for n in expected.shape)]), raw_bytes(expected))
    # The collective moves the packed bytes, not bf16 values.
    found = [c for c in collectives(f.lower(x).compile().as_text()) if c.op == "all-gather"]
    assert found and all(c.dtype == "u8" for c in found), found


def test_all_gather_errors_and_disagreeing_amax():
    mesh = _mesh("8")
    x = _random((8 * 8, 32))

    def gather(x, **kw):
        return jax_nvfp4.all_gather(jax_nvfp4.quantize(x, columnwise=True), "x", **kw).amax

    run = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("x", None), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="multiple of 16"):  # 8 rows a shard split the columnwise blocks
        jax.jit(run(gather))(x)
    with pytest.raises(ValueError, match="tiled=True"):
        jax.jit(run(functools.partial(gather, axis=1, tiled=False)))(x)
    # Each shard quantized with its own amax: the gathered tensor says NaN instead of lying.
    rows = _random((8 * 16, 32))
    own = jax.jit(run(lambda x: jax_nvfp4.all_gather(jax_nvfp4.quantize(x), "x").amax))(rows)
    assert np.isnan(np.asarray(own))


def _mlp_loss(dot_general, mesh, params, x):
    """Two dense layers with tensor-parallel hidden units; tokens over (data) x (fsdp)."""
    w1, w2 = params
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    h = dot_general(x, w1.astype(jnp.bfloat16), dims, preferred_element_type=jnp.bfloat16)
    stream, tokens = MLP_TOKENS[mesh.axis_names]
    hidden = "t" if "t" in mesh.axis_names else None
    h = jax.nn.gelu(lax.with_sharding_constraint(h, NamedSharding(mesh, P(*tokens, hidden))))
    y = dot_general(h, w2.astype(jnp.bfloat16), dims, preferred_element_type=jnp.bfloat16)
    y = lax.with_sharding_constraint(y, NamedSharding(mesh, P(*stream, None)))
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


# Per mesh: how the [batch, seq] tokens are sharded in the residual stream and in the hidden
# layer; hidden units go to "t" (tensor parallel), W's other axis to "f" (FSDP). On (f, t) the
# stream is also sequence-parallel: its sequence axis is sharded over "t".
MLP_MESHES = {"8": ((8,), ("d",)), "2x4": ((2, 4), ("f", "t")), "4x2": ((4, 2), ("d", "t"))}
MLP_TOKENS = {
    ("d",): (("d", None), ("d", None)),
    ("f", "t"): (("f", "t"), ("f", None)),
    ("d", "t"): (("d", None), ("d", None)),
}


def _mlp_problem(mesh):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((8, 64, 128)), jnp.bfloat16)  # 16-token sequence shards
    w1 = jnp.asarray(rng.standard_normal((128, 256)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((256, 128)) * 0.1, jnp.float32)
    axes = mesh.axis_names
    fsdp = "f" if "f" in axes else None
    tensor = "t" if "t" in axes else None
    specs = ((P(fsdp, tensor), P(tensor, fsdp)), P(*MLP_TOKENS[axes][0], None))
    return ((w1, w2), x), specs


# "full": NVIDIA's recipe, stochastic rounding of dy included (each shard draws at its place in the whole dy);
# "rht": without stochastic rounding.
# "options": per-token scales for x and dy (row amaxes reduced over the shards of a row) and 4over6 everywhere.
# "scaled_dot": the GEMMs' block sums by lax.scaled_dot, on each shard's codes.
# "mxfp8": both layers in MXFP8 (jax_nvfp4.MXFP8: XLA's own ops, which it partitions itself).
STEP_RECIPES = {
    "mxfp8": jax_nvfp4.MXFP8(),
    "full": jax_nvfp4.Recipe(),
    "rht": jax_nvfp4.Recipe(stochastic_rounding=False),
    "scaled_dot": jax_nvfp4.Recipe(stochastic_rounding=False, impl="scaled_dot"),
    "options": jax_nvfp4.Recipe(
        stochastic_rounding=False,
        row_scaled_activations=True,
        row_scaled_gradients=True,
        four_over_six=jax_nvfp4.FourOverSix("all"),
    ),
}


@pytest.mark.parametrize(
    "mesh_name,recipe",
    [(mesh, "rht") for mesh in MLP_MESHES]
    + [("2x4", "full"), ("8", "full"), ("2x4", "options"), ("8", "options"), ("2x4", "scaled_dot")]
    + [("2x4", "mxfp8")],
)
def test_sharded_training_step_equals_unsharded(mesh_name, recipe):
    shape, names = MLP_MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, devices=CPUS[:8], axis_types=(AxisType.Auto,) * len(names))
    (params, x), (param_specs, x_spec) = _mlp_problem(mesh)
    recipe = STEP_RECIPES[recipe]
    key = jax.random.key(11) if recipe.needs_rng_key else None  # both layers' dy: one key serves the test
    dot = functools.partial(jax_nvfp4.dot_general, recipe=recipe, rng_key=key)
    step = jax.value_and_grad(functools.partial(_mlp_loss, dot, mesh))
    # The same program on one device (its sharding constraints on a mesh of one device each axis).
    one = jax.make_mesh((1,) * len(names), names, devices=CPUS[:1], axis_types=(AxisType.Auto,) * len(names))
    want_loss, want_grads = jax.jit(jax.value_and_grad(functools.partial(_mlp_loss, dot, one)))(params, x)
    named = functools.partial(NamedSharding, mesh)
    sharded = jax.jit(step, out_shardings=(named(P()), jax.tree.map(named, param_specs)))
    args = (jax.tree.map(jax.device_put, params, jax.tree.map(named, param_specs)), jax.device_put(x, named(x_spec)))
    loss, grads = sharded(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        # Only float32 sums split over shards may round differently, and a bf16 gradient then by one unit in its
        # last place (2^-8 to 2^-7 of it).
        np.testing.assert_allclose(g, w, rtol=2**-7, atol=1e-5 * float(jnp.max(jnp.abs(w))))
    if isinstance(recipe, jax_nvfp4.MXFP8):
        return  # what moves is XLA's choice there
    compiled = sharded.lower(*args).compile().as_text()
    # Each shard's GEMMs sum their blocks as the recipe says: scaled_dot on FP4 codes, or dequantized blocks.
    scaled_dot = recipe.impl == "scaled_dot"
    assert ("f4e2m1fn" in compiled, bool(dequantized_blocks(compiled))) == (scaled_dot, not scaled_dot)
    found = collectives(compiled)
    gathers = [c for c in found if c.op == "all-gather"]
    codes = [c for c in gathers if c.dtype == "u8"]  # packed codes and E4M3 scales
    # Besides them, per-token amaxes travel with their rows: 4 bytes a row (a row of 128 values: 72 bytes).
    row_amaxes = [c for c in gathers if c.dtype == "f32" and recipe.row_scaled_activations]
    assert len(codes) + len(row_amaxes) == len(gathers), gathers
    assert sum(c.nbytes for c in row_amaxes) <= sum(c.nbytes for c in codes) / 8


def test_fsdp_all_gather_bytes_against_bf16():
    """One FSDP layer: the weight is gathered as 4-bit codes + scales, 28% of a bf16 gather."""
    mesh = jax.make_mesh((8,), ("f",), devices=CPUS[:8], axis_types=(AxisType.Auto,))
    x = jax.device_put(_random((64, 128)), NamedSharding(mesh, P("f", None)))
    w = jax.device_put(_random((128, 512), seed=1), NamedSharding(mesh, P("f", None)))
    dims = (((1,), (0,)), ((), ()))

    def gathered(dot_general):
        def layer(x, w):
            with jax.named_scope("fsdp_layer"):
                return dot_general(x, w, dims, preferred_element_type=jnp.bfloat16)

        return [c for c in collectives(jax.jit(layer).lower(x, w).compile().as_text()) if c.op == "all-gather"]

    nvfp4, bf16 = gathered(jax_nvfp4.dot_general), gathered(lax.dot_general)
    assert all("/fsdp_layer/" in c.op_name for c in nvfp4), nvfp4  # each names the op it came from
    assert {c.dtype for c in nvfp4} == {"u8"}
    assert sum(c.nbytes for c in nvfp4) == 512 * 128 // 2 + 512 * 128 // 16  # codes + scales of W
    # XLA on CPU widens a bf16 all-gather to f32; the bytes a bf16 gather moves are 2 a value.
    assert sum(c.nbytes // {"bf16": 2, "f32": 4}[c.dtype] * 2 for c in bf16) == 512 * 128 * 2


@pytest.mark.parametrize("weight_block_2d", [True, False])
def test_fsdp_training_step_gathers_the_weight_once(weight_block_2d):
    """Forward and backward of one FSDP layer: a 16x16-block weight's one quantized copy is gathered once (the
    backward pass transposes the gathered bytes); 1x16 blocks gather both of its copies. Gradients as unsharded."""
    mesh = jax.make_mesh((8,), ("f",), devices=CPUS[:8], axis_types=(AxisType.Auto,))
    x, w, ct = _random((256, 128)), _random((128, 512), seed=1), _random((256, 512), seed=2)  # whole 16-token blocks
    dims = (((1,), (0,)), ((), ()))
    recipe = jax_nvfp4.Recipe(weight_block_2d=weight_block_2d)
    dot = functools.partial(jax_nvfp4.dot_general, recipe=recipe, rng_key=jax.random.key(3))

    def loss(x, w):
        return jnp.sum(dot(x, w, dims).astype(jnp.float32) * ct)

    step = jax.jit(jax.grad(loss, (0, 1)))
    sharded = [jax.device_put(a, NamedSharding(mesh, P("f", None))) for a in (x, w)]
    gathers = [c for c in collectives(step.lower(*sharded).compile().as_text()) if c.op == "all-gather"]
    assert {c.dtype for c in gathers} == {"u8"}, gathers
    one_copy = 512 * 128 // 2 + 512 * 128 // 16  # codes + scales of W
    assert sum(c.nbytes for c in gathers) == one_copy * (1 if weight_block_2d else 2)
    for got, want in zip(step(*sharded), step(x, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_flax_dense_general_with_axes_under_a_global_mesh():
    """Flax initializes DenseGeneral's kernel flat and reshapes it; under ``jax.set_mesh`` the layer must not
    constrain the flat value to the kernel's three axes (google/flax#3676). Sharded == unsharded, bitwise."""
    import flax.linen as nn

    from jax_nvfp4.flax import NVFP4DenseGeneral

    layer = NVFP4DenseGeneral((4, 16), kernel_axes=("embed", "heads", "kv"), bias_axes=("heads", "kv"))
    x = _random((8, 32, 64), jnp.float32)
    want = layer.apply(nn.unbox(layer.init(jax.random.key(0), x)), x)
    with jax.set_mesh(_mesh("2x4")), nn.logical_axis_rules((("heads", "y"), ("embed", None), ("kv", None))):
        variables = jax.jit(layer.init)(jax.random.key(0), x)
        assert type(variables["params"]["kernel"]) is nn.LogicallyPartitioned  # Flax's own box, not ours
        got = jax.jit(layer.apply)(variables, x)
    assert got.sharding.spec == P(None, None, "y")  # the heads, as the kernel's constraint puts them
    np.testing.assert_array_equal(raw_bytes(got), raw_bytes(want))
