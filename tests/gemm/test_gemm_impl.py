"""The GEMM's two block sums: ``impl="scaled_dot"`` (XLA's lax.scaled_dot) against the emulation, and what
reaches XLA when a training step is lowered for CUDA."""

from __future__ import annotations

import dataclasses
import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, dequantized_blocks, eqns_named, examples, stablehlo_functions
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from benchmarks.offline_gpu import TARGETS
from jax_nvfp4 import QuantizeSpec, Recipe
from jax_nvfp4.linear.block_sum import has_fp4_tensor_cores, native_scaled_dot, resolve_impl

OUT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _operand(rng, lead: tuple[int, ...], k: int, row_scaled: bool, e4m3_max: int) -> jax_nvfp4.NVFP4Tensor:
    """A rowwise NVFP4Tensor [*lead, k] of random codes and block scales in [1, 2).

    Each code times its scale is a multiple of 2^-4 below 12, so a product of two is a multiple of
    2^-8 below 144 and any sum of up to 2^14 of them is exact in float32: both block sums must agree
    to the bit, and so must the epilogue they share (random global or per-row amaxes).
    """
    rows = int(np.prod(lead))
    codes = np.zeros((rows, k + k % 2), np.uint8)
    codes[:, :k] = rng.integers(0, 16, (rows, k))
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(*lead, -1)
    scale = rng.integers(0x38, 0x40, (*lead, -(-k // 16))).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    amax = rng.uniform(0.5, 3000.0, lead if row_scaled else ()).astype(np.float32)
    spec = QuantizeSpec(
        row_scaled=row_scaled, four_over_six_error="mse" if e4m3_max == 256 else None, e4m3_max=e4m3_max
    )
    arrays = (jnp.asarray(data), jnp.asarray(scale), jnp.asarray(amax))
    return jax_nvfp4.NVFP4Tensor(*arrays, None, None, None, (*lead, k), jnp.dtype(jnp.bfloat16), spec)


@settings(max_examples=examples(60))
@given(
    a_lead=st.sampled_from([(5,), (2, 3), (1,), (17,)]),
    n=st.integers(1, 20),
    k=st.sampled_from([1, 15, 16, 17, 40, 64, 100]),
    row_scaled=st.tuples(st.booleans(), st.booleans()),
    e4m3_max=st.tuples(st.sampled_from([448, 256]), st.sampled_from([448, 256])),
    bias=st.booleans(),
    out_dtype=st.sampled_from(OUT_DTYPES),
    impl=st.sampled_from(["scaled_dot", "cudnn"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_scaled_dot_is_the_emulation_bit_for_bit_where_sums_are_exact(
    a_lead, n, k, row_scaled, e4m3_max, bias, out_dtype, impl, seed
):
    """Random codes and scales, per-tensor or per-row amaxes, E = 448 or 256, a bias, every output
    dtype, ragged K (zero codes pad the last block) and batch axes: the same bytes, but for the sign of
    a zero sum, which is the accumulator's (scaled_dot adds the padding's +0 products to a sum of -0s).
    ``lax.scaled_dot`` and ``jax.nn.scaled_matmul`` (impl="cudnn") alike."""
    rng = np.random.default_rng(seed)
    a = _operand(rng, a_lead, k, row_scaled[0], e4m3_max[0])
    c = _operand(rng, (n,), k, row_scaled[1], e4m3_max[1])
    b = jnp.asarray(rng.standard_normal(n), jnp.float32) if bias else None
    got = jax_nvfp4.gemm(a, c, out_dtype, b, impl=impl)
    want = jax_nvfp4.gemm(a, c, out_dtype, b, impl="emulated")
    assert got.shape == (*a_lead, n) and got.dtype == out_dtype
    assert_same_bytes(got + 0, want + 0)  # -0 + 0 = +0; every other value unchanged


@pytest.mark.parametrize("impl", ["scaled_dot", "cudnn"])
def test_scaled_dot_ignores_a_nonzero_pad_nibble(impl):
    """An odd K leaves the last byte's high nibble outside the row: whatever it holds adds nothing."""
    rng = np.random.default_rng(1)
    a, c = _operand(rng, (4,), 33, False, 448), _operand(rng, (3,), 33, False, 448)
    dirty = dataclasses.replace(a, data=a.data.at[:, -1].set(a.data[:, -1] | 0x70))
    assert_same_bytes(jax_nvfp4.gemm(dirty, c, impl=impl), jax_nvfp4.gemm(a, c, impl="emulated"))


def test_dot_general_gemms_are_the_scaled_dot_gemms():
    """With Recipe(impl="scaled_dot"), y, dx and dW are the scaled_dot GEMMs of the recipe's operands,
    including the wgrad of an x with two row axes, whose columnwise copy contracts both."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 32, 48)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((48, 40)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((2, 32, 40)), jnp.float32)
    recipe = Recipe(rht=False, stochastic_rounding=False, impl="scaled_dot")
    dims = (((2,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda x, w: jax_nvfp4.dot_general(x, w, dims, recipe=recipe), x, w)
    dx, dw = vjp(dy.astype(y.dtype))
    q, gemm = jax_nvfp4.quantize, functools.partial(jax_nvfp4.gemm, impl="scaled_dot")
    assert_same_bytes(y, gemm(q(x), q(w.T, block_2d=True), y.dtype))
    assert_same_bytes(dx, gemm(q(dy), q(w, block_2d=True), x.dtype))
    assert_same_bytes(dw, gemm(q(dy.reshape(64, 40).T), q(x.reshape(64, 48).T), w.dtype).T)


def test_auto_picks_scaled_dot_only_with_fp4_tensor_cores():
    def gpu(capability):
        return SimpleNamespace(platform="gpu", compute_capability=capability)

    assert has_fp4_tensor_cores([gpu("10.0"), gpu("12.0")])
    assert not has_fp4_tensor_cores([gpu("10.0"), gpu("9.0")])  # one Hopper among them
    assert not has_fp4_tensor_cores([gpu("gfx942")])  # ROCm
    assert not has_fp4_tensor_cores([SimpleNamespace(platform="cpu")])
    assert not has_fp4_tensor_cores([])
    if jax.default_backend() != "cpu":
        pytest.skip("the rest checks what auto does on a CPU")
    assert not native_scaled_dot()
    assert resolve_impl("auto") == "emulated" and resolve_impl("scaled_dot") == "scaled_dot"

    def lowered(recipe):
        f = functools.partial(jax_nvfp4.dot_general, dimension_numbers=(((1,), (0,)), ((), ())), recipe=recipe)
        return jax.jit(f).lower(jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.float32)).as_text()

    assert "xla.scaled_dot" not in lowered(Recipe())
    assert '"xla.scaled_dot"' in lowered(Recipe(impl="scaled_dot"))


# ---- What reaches XLA: a training step lowered for CUDA on this machine.

TRITON = "__gpu$xla.gpu.triton"
"""The custom call of a Pallas kernel lowered through Triton."""


def _train_step_for_cuda(recipe: Recipe) -> tuple[list[str], str]:
    """One SGD step of a two-layer NVFP4 MLP (linen): the impl of each GEMM it runs, and its StableHLO
    exported for CUDA."""
    flax_nn = pytest.importorskip("flax.linen")
    from jax_nvfp4.flax import NVFP4Dense

    class MLP(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            x = jax.nn.gelu(NVFP4Dense(64, recipe=recipe)(x))
            return NVFP4Dense(32, recipe=recipe)(x)

    model = MLP()
    x = jax.ShapeDtypeStruct((4, 16, 32), jnp.bfloat16)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones(x.shape, x.dtype)))["params"]

    def step(params, x, key):
        def loss(p):
            y = model.apply({"params": p}, x, rngs={"nvfp4": key})
            return jnp.mean(y.astype(jnp.float32) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    args = (params, x, jax.random.key(1))
    kernels = [jax.export.DisabledSafetyCheck.custom_call(f"nvfp4_{op}") for op in ("amax", "quantize", "dequantize")]
    kernels.append(jax.export.DisabledSafetyCheck.custom_call(TRITON))
    exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=kernels)
    gemms = [e.params["impl"] for e in eqns_named(jax.make_jaxpr(step)(*args), "nvfp4_gemm")]
    return gemms, exported(*args).mlir_module()


def test_every_gemm_of_a_cuda_training_step_is_a_scaled_dot_on_fp4_codes():
    """Six GEMMs (fprop, dgrad and wgrad of both layers; XLA drops the unused dgrad of x), each
    lowered to the composite xla.scaled_dot of f4E2M1FN codes and f8E4M3FN scales; the only dots are
    inside its decomposition (which XLA replaces with the FP4 GEMM on Blackwell), so no bf16 or
    float32 copy of a quantized operand is made outside it; the codes reach it from their bytes by a
    bitcast and reshapes only, and nothing is dequantized."""
    gemms, module = _train_step_for_cuda(Recipe(impl="scaled_dot"))
    assert gemms == ["scaled_dot"] * 6
    composites = re.findall(r'stablehlo\.composite "xla\.scaled_dot" .*? : \(([^)]*)\)', module)
    assert composites
    for operands in composites:
        types = re.findall(r"x(f4E2M1FN|f8E4M3FN)>", operands)
        assert types == ["f4E2M1FN", "f4E2M1FN", "f8E4M3FN", "f8E4M3FN"], operands
    functions = stablehlo_functions(module)
    outside = {name: body for name, body in functions.items() if not name.startswith("xla.scaled_dot")}
    assert len(outside) < len(functions)
    for name, body in outside.items():
        assert "stablehlo.dot_general" not in body, name
        assert not dequantized_blocks(body), name
        for line in body.splitlines():
            if re.search(r"-> tensor<[\dx]*f4E2M1FN>", line) or re.search(r"\(tensor<[\dx]*f4E2M1FN>\)", line):
                assert re.search(r"stablehlo\.(bitcast_convert|reshape|composite)", line), line


def test_the_emulated_cuda_training_step_dequantizes():
    """The other side: the emulation's GEMMs are bf16 dots of dequantized blocks (no composite)."""
    gemms, module = _train_step_for_cuda(Recipe(impl="emulated"))
    assert gemms == ["emulated"] * 6
    assert "xla.scaled_dot" not in module and "stablehlo.dot_general" in module


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_the_fused_cuda_training_step_reads_packed_operands():
    """impl="fused" lowered for Hopper: each of the six GEMMs is one Triton kernel reading the packed
    codes (as uint32 words, eight values a word), E4M3 bytes and the global decode scale (GEMMs of one shape share one
    lowered function), dgrad's the variant that reads W's kept 16x16-block copy transposed; no block is dequantized
    and XLA runs no dot."""
    with jax.sharding.use_abstract_mesh(TARGETS["h100"].abstract_mesh):
        gemms, module = _train_step_for_cuda(Recipe(impl="fused"))
    assert gemms == ["fused"] * 6
    calls = re.findall(rf"stablehlo\.custom_call @{re.escape(TRITON)}\((.*?)\n", module)
    assert 1 <= len(calls) <= 6
    names = {re.search(r'name = "(\w+)"', call).group(1) for call in calls}
    assert names == {"nvfp4_fused_gemm", "nvfp4_fused_gemm_transposed"}, names
    for call in calls:
        operands = re.search(r"\} : \(([^)]*)\) -> ", call).group(1)
        assert re.findall(r"tensor<[\dx]*([a-z]\w*)>", operands) == ["ui32", "ui8"] * 2 + ["f32"], operands
    assert not dequantized_blocks(module)
    assert "stablehlo.dot_general" not in module
