"""benchmarks.roofline: each kernel's dot and MMA read from what XLA compiled, and the model's bound."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from benchmarks import roofline
from benchmarks.layer_breakdown import minimum_outside_gemms
from benchmarks.offline_gpu import TARGETS

FP4_MMA = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X"


def test_a_dots_flops_come_from_its_result_and_contraction():
    """A compiled x [64, 128] . W [128, 32] (float32: XLA's CPU compiler widens bf16 dots in some versions): one
    kernel holds the dot, 2 x 64 x 32 x 128 FLOPs on f32."""
    x, w = jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 32), jnp.float32)
    hlo = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(x, w).compile().as_text()
    found = roofline.dots(hlo)
    assert list(found.values()) == [roofline.Dot(2.0 * 64 * 32 * 128, "f32")], found


def test_the_model_takes_the_slower_of_memory_and_the_mmas_rate():
    """max(bytes / bandwidth, FLOPs / peak), the peak the MMA's that the PTX names where it names one: FP4 codes
    widened for an f16 MMA run at bf16's rate, and without FP4 tensor cores (Hopper) FP4 runs at bf16's too."""
    b200, h100 = TARGETS["b200"], TARGETS["h100"]
    dot = roofline.Dot(2.0 * 8192 * 4096 * 4096, "f4e2m1fn")
    assert roofline.seconds(b200, 1e6, dot) == pytest.approx(dot.flops / 9.0e15)
    assert roofline.seconds(b200, 1e9, dot) == pytest.approx(1e9 / 8.0e12)  # memory-bound
    assert roofline.seconds(b200, 0, dot, {FP4_MMA}) == pytest.approx(dot.flops / 9.0e15)
    f16 = {"tcgen05.mma.cta_group::1.kind::f16"}
    assert roofline.seconds(b200, 0, dot, f16) == pytest.approx(dot.flops / 2.25e15)
    assert roofline.seconds(h100, 0, dot) == pytest.approx(dot.flops / 989.4e12)
    assert roofline.seconds(b200, 2e6, None) == pytest.approx(2e6 / 8.0e12)  # no dot: its bytes alone


def test_mmas_are_joined_to_every_instruction_that_shares_a_kernel(tmp_path):
    """XLA emits one kernel for identical fusions, named after the first (fusion.1 -> fusion_1): the thunk sequence
    says which kernel each instruction launches, so fusion.2 runs fusion_1's MMA too; a kernel without MMAs (a
    transpose) has none."""
    (tmp_path / "module_0001.jit_step.1.ptx").write_text(
        f".visible .entry fusion_1(\n.param .u64 p\n)\n{{\n{FP4_MMA} [%r1], ...;\n}}\n"
    )
    (tmp_path / "module_0001.jit_step.ptx").write_text(".visible .entry loop_transpose_fusion(\n)\n{\nret;\n}\n")
    (tmp_path / "module_0001.jit_step.thunk_sequence.txt").write_text(
        "001: kCustomKernel [source         | next=002 (1) ] loop_transpose_fusion grid: [8, 1, 1]\n"
        "017: kCustomKernel [prev=016 (1)   | next=018 (1) ] fusion_1 grid: [64, 1, 1]\n"
        "026: kCustomKernel [prev=025 (1)   | next=027 (1) ] fusion_1 grid: [64, 1, 1]\n"
    )
    entries = [("loop_transpose_fusion", 1), ("fusion.1", 17), ("fusion.2", 26)]
    (tmp_path / "module_0001.jit_step.thunk_metadata.txt").write_text(
        "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n    thunk_id: {i}\n  }}\n}}\n'
                for n, i in entries)
    )  # fmt: skip
    assert roofline.mma_instructions(tmp_path) == {"fusion.1": {FP4_MMA}, "fusion.2": {FP4_MMA}}


def test_the_fewest_bytes_outside_the_gemms():
    """x, W and dy read once in bf16, and the five quantized copies the GEMMs read (x and dy both ways, W once in
    16x16 blocks) written once at 9/16 of a byte a value; W counts each expert's."""
    m, k, n = 64, 128, 32
    assert minimum_outside_gemms((m, k, n)) == 2 * (m * k + k * n + m * n) + 9 / 16 * (2 * m * k + k * n + 2 * m * n)
    assert minimum_outside_gemms((m, k, n), experts=4) - minimum_outside_gemms((m, k, n)) == (2 + 9 / 16) * 3 * k * n


def test_every_target_has_its_published_peaks():
    for t in TARGETS.values():
        assert (
            t.hbm_bytes_per_s > 1e12
            and t.bf16_flops > 5e14
            and t.fp8_flops == pytest.approx(2 * t.bf16_flops, rel=1e-3)
        )
        assert t.fp4_flops == (2 * t.fp8_flops if t.capability[0] >= 10 else 0.0), t.name
        assert t.source and dataclasses.replace(t).config == t.config
