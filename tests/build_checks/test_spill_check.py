"""The CI check of the CUDA kernels' register spills (.ci/spills.py): it reads ptxas's warnings
from a build log and fails on a spill it does not allow, on one over its allowance, on an
allowance no longer used, and on a log that built no CUDA kernels."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def load_spills():
    spec = importlib.util.spec_from_file_location("spills", REPO / ".ci" / "spills.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


spills = load_spills()

# ptxas's warnings, as nvcc 13.0.88 printed them for two of today's kernels.
GROUPED = (
    "_ZN5nvfp44cuda43_GLOBAL__N__a46ebcbe_10_grouped_cu_8cfce4d620grouped_tiles_kernelINS_7LoadF16E"
    "LNS1_4ModeE0EEEvPKNT_1TENS1_6ParamsEl"
)
QUANTIZE = (
    "_ZN5nvfp44cuda44_GLOBAL__N__e70ec0e4_11_quantize_cu_bbde2ca615quantize_kernelINS_7LoadF32E"
    "LNS1_4ModeE1EEEvPKNT_1TENS1_6ParamsE"
)
BUILT = "".join(
    f"[{i}/5] Building CUDA object CMakeFiles/_nvfp4_cuda.dir/ffi/cuda/{s}.o\n" for i, s in enumerate(spills.SOURCES)
)


def warning(mangled: str, stores: int, loads: int) -> str:
    return (
        f"ptxas warning : Registers are spilled to local memory in function '{mangled}', "
        f"{stores} bytes spill stores, {loads} bytes spill loads\n"
    )


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="needs binutils' c++filt")
def test_warnings_name_their_kernels_and_bytes():
    log = BUILT + warning(GROUPED, 4, 4) + "other output\n" + warning(QUANTIZE, 72, 80)
    assert spills.spilled_kernels(log) == [
        ("grouped_tiles_kernel<f16, nearest>", 8),
        ("quantize_kernel<f32, stochastic>", 152),
    ]
    # quantize_kernel<f32, stochastic> is not allowed to spill; and every other allowance is unused.
    found = spills.problems(log)
    assert "quantize_kernel<f32, stochastic> spills 152 bytes; it is not allowed to spill" in found
    assert len(found) == 1 + len(spills.ALLOWED) - 1


def test_allowances_hold_exactly_what_spills():
    allowed = {"a<bf16, nearest>": 16, "b<f32, stochastic>": 8}
    assert (
        spills.allowance_problems(
            [("a<bf16, nearest>", 16), ("a<bf16, nearest>", 4), ("b<f32, stochastic>", 8)], allowed
        )
        == []
    )
    assert spills.allowance_problems([("a<bf16, nearest>", 24), ("b<f32, stochastic>", 8)], allowed) == [
        "a<bf16, nearest> spills 24 bytes, over its allowance of 16"
    ]
    assert spills.allowance_problems([("a<bf16, nearest>", 8), ("c<f16, 4over6>", 4)], allowed) == [
        "c<f16, 4over6> spills 4 bytes; it is not allowed to spill",
        "b<f32, stochastic> no longer spills: take it out of ALLOWED",
    ]


def test_a_log_without_the_cuda_build_fails():
    assert spills.problems("") == [
        "no CUDA build of amax.cu, quantize.cu, dequantize.cu, grouped.cu in the log: nothing was checked"
    ]
    assert spills.problems(BUILT.replace("grouped.cu.o", "grouped.o")) == [
        "no CUDA build of grouped.cu in the log: nothing was checked"
    ]
