"""What the quantizer's primitives lower to on a GPU, read from programs exported for CUDA on this machine
(the CUDA module must be built: the wheel CI tests is)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jax_nvfp4
from jax_nvfp4.ops import ffi

pytestmark = pytest.mark.skipif(not ffi.cuda_module_built(), reason="the CUDA lowering needs the CUDA module")

KERNELS = [jax.export.DisabledSafetyCheck.custom_call(f"nvfp4_{op}") for op in ("amax", "quantize")]


def _cuda_module(f, *shapes) -> str:
    return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=KERNELS)(*shapes).mlir_module()


def test_an_amax_without_the_transform_is_an_xla_reduction_on_a_gpu():
    """The plain amax (per tensor or per row) lowers to XLA's reduction, which XLA fuses into the op that
    produces x (here the gelu: one fusion, checked offline for sm_90 in docs/benchmarks.md); the amax of the
    transform of x^T stays the kernel. The quantize is the kernel either way."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)

    def quantized(rht: bool, per_row: bool = False):
        def f(h):
            return jax_nvfp4.quantize(jax.nn.gelu(h), columnwise=True, rht=rht, row_scaled=per_row)

        return _cuda_module(f, x)

    for module in (quantized(rht=False), quantized(rht=False, per_row=True)):
        assert "@nvfp4_amax" not in module and "stablehlo.reduce" in module
        assert "@nvfp4_quantize" in module
    with_rht = quantized(rht=True)
    assert len(re.findall(r"stablehlo\.custom_call @nvfp4_amax\(", with_rht)) == 1
