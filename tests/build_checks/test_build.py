"""The build produced the modules it should."""

from __future__ import annotations

import os

import pytest

from jax_nvfp4.ops import ffi

TARGETS = {"nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_grouped_amax", "nvfp4_grouped_quantize"}


def test_cpu_kernels_are_registered():
    for target in TARGETS:
        assert "cpu" in ffi.platforms_with(target)


@pytest.mark.skipif(os.environ.get("NVFP4_EXPECT_CUDA_MODULE") != "1", reason="set where nvcc is on PATH (.ci/run)")
def test_cuda_module_was_built():
    # CI sets NVFP4_CUDA=ON wherever nvcc exists: the CUDA sources must compile.
    assert ffi.cuda_module_built()


@pytest.mark.skipif(os.environ.get("NVFP4_EXPECT_CUDA_HOST_MODULE") != "1", reason="set by .ci/run and .ci/sanitize")
def test_cuda_host_model_was_built():
    # The CUDA kernels on the CPU (NVFP4_CUDA_HOST=ON): without it their tests would only skip.
    from jax_nvfp4 import _nvfp4_cuda_host

    assert set(_nvfp4_cuda_host.registrations()) == TARGETS


def test_platforms_without_a_kernel_lower_to_the_reference():
    # Exported for CUDA on this CPU-only machine: where the CUDA module has no
    # kernel for an op, the op must lower to the pure-JAX reference instead.
    import jax
    import jax.numpy as jnp

    import jax_nvfp4

    targets = ("nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize")

    def f(x):
        return jax_nvfp4.dequantize(jax_nvfp4.quantize(x, columnwise=True))

    def exported(platform: str) -> str:
        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
        exp = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)
        return exp(jax.ShapeDtypeStruct((32, 48), jnp.bfloat16)).mlir_module()

    cpu, cuda = exported("cpu"), exported("cuda")
    for target in targets:
        assert f"custom_call @{target}(" in cpu
        assert (f"custom_call @{target}(" in cuda) == ("cuda" in ffi.platforms_with(target)), target


def test_a_training_step_exports_for_cuda():
    # The whole NVFP4 forward and backward lowers for a GPU (kernels or reference).
    import jax
    import jax.numpy as jnp

    import jax_nvfp4

    def loss(x, w):
        # The full recipe (RHT, stochastic rounding): every kernel attribute lowers.
        y = jax_nvfp4.dot_general(x, w, (((1,), (0,)), ((), ())), rng_key=jax.random.key(0))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    args = (jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32, 48), jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call(f"nvfp4_{op}") for op in ("amax", "quantize", "dequantize")]
    exp = jax.export.export(jax.jit(jax.grad(loss, (0, 1))), platforms=["cuda"], disabled_checks=checks)(*args)
    assert [a.shape for a in exp.out_avals] == [(64, 32), (32, 48)]
    has_kernel = "cuda" in ffi.platforms_with("nvfp4_quantize")
    assert ("custom_call @nvfp4_quantize(" in exp.mlir_module()) == has_kernel
