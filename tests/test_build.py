"""The build produced the modules it should."""

from __future__ import annotations

import os

import pytest

from jax_nvfp4 import _ffi


def test_cpu_kernels_are_registered():
    for target in ("nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize"):
        assert "cpu" in _ffi.platforms_with(target)


@pytest.mark.skipif(os.environ.get("NVFP4_EXPECT_CUDA_MODULE") != "1", reason="set where nvcc is on PATH (.ci/run)")
def test_cuda_module_was_built():
    # CI sets NVFP4_CUDA=ON wherever nvcc exists: the CUDA sources must compile.
    assert _ffi.cuda_module_built()
