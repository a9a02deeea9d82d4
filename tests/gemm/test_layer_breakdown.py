"""benchmarks.layer_breakdown: the kernels of one linear layer's compiled forward and backward, and their bytes."""

from __future__ import annotations

import jax
from jax import lax

import jax_nvfp4
from benchmarks.layer_breakdown import DENSE, category, compiled_step, kernels, layer_dots, shape_bytes, step_inputs
from benchmarks.profile_trace import covered_ns, instruction_seconds


def test_shape_bytes_counts_every_element_of_a_tuple():
    assert shape_bytes("(u8[1,384,256]{2,1,0}, f8e4m3fn[1,384,32]{2,1,0}, f32[1]{0})") == 384 * 256 + 384 * 32 + 4
    assert shape_bytes("bf16[8,16]{1,0}") == 256 and shape_bytes("f32[]") == 4


def test_the_recipe_layer_runs_its_quantizer_kernels_once_per_operand():
    """x, W and dy: one amax and one quantize kernel each (the copies each GEMM needs come from one pass),
    writing exactly the codes and scales of those copies; bf16's layer has neither."""
    shape, key = (64, 128, 96), jax.random.key(0)
    nvfp4 = kernels(compiled_step(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, rng_key=key), shape).as_text())
    count = {c: sum(category(k) == c for k in nvfp4) for c in ("amax", "quantize", "GEMM")}
    assert count["amax"] == 3 and count["quantize"] == 3 and count["GEMM"] >= 3, count
    quantized = sum(k.written for k in nvfp4 if category(k) == "quantize")
    m, k, n = shape
    # x and dy: rowwise and columnwise copies (a byte for 2 codes, a scale per 16); W: 16x16 blocks, its rowwise
    # copy alone (the dgrad GEMM reads it transposed).
    codes = (2 * (m * k + m * n) + k * n) / 2
    assert quantized == codes + 2 * (m * k + m * n) / 16 + k * n / 16
    bf16 = kernels(compiled_step(lambda x, w: lax.dot_general(x, w, DENSE), shape).as_text())
    assert not [k for k in bf16 if category(k) in ("amax", "quantize", "dequantize")]


def test_neither_w_nor_its_gradient_is_copied_in_bf16():
    """W is quantized as it is stored and dW made in its layout: besides the GEMMs (whose epilogue writes dW), no
    kernel writes as many bytes as a bf16 copy of W (a transpose of W, or of dW, would)."""
    shape, key = (64, 256, 256), jax.random.key(0)  # whole tiles of the fused GEMM's: no padded output to slice
    _, k, n = shape
    for impl in ("emulated", "fused"):
        recipe = jax_nvfp4.Recipe(impl=impl)
        dot = lambda x, w, recipe=recipe: jax_nvfp4.dot_general(x, w, DENSE, recipe=recipe, rng_key=key)  # noqa: E731
        found = kernels(compiled_step(dot, shape).as_text())
        copies = [(c.name, c.shape) for c in found if category(c) == "other" and c.written >= 2 * k * n]
        assert not copies, (impl, copies)


def test_dgrad_reads_the_kept_copy_of_w_as_it_is():
    """With 16x16 blocks one copy of W is quantized and kept; the dgrad GEMM reads it transposed, so no kernel
    besides the quantize writes as many bytes as W's codes (a transpose of them, two kernels before, would)."""
    shape, key = (64, 256, 256), jax.random.key(0)
    _, k, n = shape
    dot = lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, recipe=jax_nvfp4.Recipe(impl="emulated"), rng_key=key)  # noqa: E731
    found = kernels(compiled_step(dot, shape).as_text())
    copies = [(c.name, c.shape) for c in found if category(c) == "other" and c.written >= k * n // 2]
    assert not copies, copies


def test_the_moe_layer_counts_its_grouped_kernels_as_their_ops():
    """--experts: ragged_dot's layer, whose x and dy go through the grouped amax and quantize kernels: one amax and
    one quantize kernel for each of x, W and dy, and its emulated GEMMs' 6 dequantize passes."""
    import pytest

    shape, experts = (128, 128, 96), 4
    nvfp4, _ = layer_dots(jax_nvfp4.Recipe(), shape, experts)
    found = kernels(compiled_step(nvfp4, shape, experts=experts).as_text())
    count = {c: sum(category(k) == c for k in found) for c in ("amax", "quantize", "dequantize", "GEMM")}
    assert count == {"amax": 3, "quantize": 3, "dequantize": 6, "GEMM": 3}, count
    with pytest.raises(ValueError, match="split evenly"):
        layer_dots(jax_nvfp4.Recipe(), (100, 16, 16), 3)


def test_an_offline_target_names_what_it_needs(monkeypatch):
    """--target compiles with jax's CUDA plugin; where it is not installed, the error says how to get it."""
    import pytest

    from benchmarks import offline_gpu

    monkeypatch.setattr(offline_gpu, "plugin_installed", lambda: False)
    for name in offline_gpu.TARGETS:
        with pytest.raises(RuntimeError, match=f"pip install jax-cuda13-plugin=={jax.__version__}"):
            offline_gpu.devices(name)


def test_a_gemms_decode_scale_is_not_a_dequantize_pass():
    """The emulated layer dequantizes each of its six GEMM operands (a bf16 copy each); the GEMMs' global decode
    scales (one float32 a row from a one-code dequantize, ops.gemm.decode_scale) are counted apart. The fused
    impl reads the packed operands: no dequantize pass, the same three decode scales."""
    shape, key = (64, 128, 96), jax.random.key(0)
    for impl, passes in (("emulated", 6), ("fused", 0)):
        recipe = jax_nvfp4.Recipe(impl=impl)
        dot = lambda x, w, recipe=recipe: jax_nvfp4.dot_general(x, w, DENSE, recipe=recipe, rng_key=key)  # noqa: E731
        found = kernels(compiled_step(dot, shape).as_text())
        dequantize = [k for k in found if category(k) == "dequantize"]
        scales = [k for k in found if category(k) == "decode scale"]
        assert len(dequantize) == passes and len(scales) == 3, (impl, [(k.what, k.shape) for k in found])
        assert all(k.written == 2 * 4 for k in scales), scales  # f32[2, 1, 1]: a few bytes, not a pass
        if passes:  # bf16 copies of x, W and dy, each in both layouts the GEMMs read
            m, k, n = shape
            assert sorted(d.written for d in dequantize) == sorted(2 * s for s in (m * k, k * n, m * n) * 2)


def test_covered_spans_count_overlaps_once():
    assert covered_ns([(30, 40), (0, 10), (5, 20), (32, 35)]) == 30
    assert covered_ns([]) == 0


def test_a_traced_run_times_every_kernel_of_the_step():
    """--time: every instruction the compiled step runs has a time from the profiler's trace (on the CPU, host
    time), under the name the compiled HLO gives it, so the breakdown's kernels and their times join."""
    shape, key = (64, 128, 96), jax.random.key(0)
    step = compiled_step(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, rng_key=key), shape)
    seconds = instruction_seconds(step, *step_inputs(shape), runs=2)
    found = kernels(step.as_text())
    assert {k.name for k in found} <= set(seconds), sorted({k.name for k in found} - set(seconds))
    assert sum(seconds[k.name] for k in found if category(k) == "quantize") > 0
