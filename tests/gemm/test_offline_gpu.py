"""Compiling for a GPU that is not here: the offline targets say what XLA reads, and ``impl="auto"`` is decided for
the devices a GEMM is compiled for, not for those this process sees.

The tests that compile for an offline GPU need jax's CUDA plugin (``benchmarks.offline_gpu``) and run each compile
in a fresh process (the plugin registers its compile-only targets before JAX's first array); without the plugin
they are skipped. CI installs it in a folder of its own, named by NVFP4_CUDA_PLUGIN_PATH, and sets
NVFP4_EXPECT_CUDA_PLUGIN=1, which makes them run and fail without it. The committed records
(``benchmarks/results/*-offline-*``) hold what they show at full size.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import eqns_named

import jax_nvfp4
from benchmarks.offline_gpu import CUDNN_VERSION, TARGETS, plugin_installed, target, target_of
from jax_nvfp4.linear import block_sum

ROOT = Path(__file__).resolve().parents[2]
DENSE = (((1,), (0,)), ((), ()))
# CI installs the plugin in a folder of its own, which only these tests' fresh processes see: the rest of the suite
# runs without it, as a user's does.
PLUGIN_PATH = os.environ.get("NVFP4_CUDA_PLUGIN_PATH", "")
needs_plugin = pytest.mark.skipif(
    not (plugin_installed() or PLUGIN_PATH or os.environ.get("NVFP4_EXPECT_CUDA_PLUGIN")),
    reason="jax's CUDA plugin (jax-cuda13-plugin) is not here",
)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_target_carries_the_cudnn_version_where_xla_reads_it(name):
    """XLA reads the cuDNN version only from gpu_device_info.dnn_version: a version elsewhere (the top-level
    dnn_version_info) is ignored, and the target then compiles as if cuDNN were absent."""
    t = target(name)
    info = re.search(r"gpu_device_info \{(.*)\n\}", t.config, re.S).group(1)
    assert re.search(r'^\s*dnn_version: "9\.(\d+)\.\d+"$', info, re.M), info
    assert int(re.search(r'dnn_version: "9\.(\d+)', info).group(1)) >= 10  # cuDNN's NVFP4 GEMM needs 9.10
    assert "dnn_version_info" not in t.config
    assert f"cuda_compute_capability {{ major: {t.capability[0]} minor: {t.capability[1]} }}" in info
    assert f"core_count: {t.sms}" in info and f'device_description_str: "{t.device_kind}"' in t.config
    assert target_of(t.device_kind) is t
    assert t.abstract_mesh.abstract_device.device_kind == t.device_kind
    with pytest.raises(ValueError, match="no offline GPU target 'a100'"):
        target("a100")


def test_auto_is_decided_for_the_devices_a_jit_compiles_for(monkeypatch):
    """The GEMM keeps impl="auto" through tracing and decides it while it lowers, from the compilation's devices:
    pretend host device 3 has FP4 tensor cores, and a jit whose arguments live there gets lax.scaled_dot, while
    the same function on device 0 (JAX's default) gets the emulation."""
    blackwell = jax.devices()[3]
    asked = []

    def has_fp4_tensor_cores(devices):
        asked.append(list(devices))
        return list(devices) == [blackwell]

    monkeypatch.setattr(block_sum, "has_fp4_tensor_cores", has_fp4_tensor_cores)
    x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.float32)

    def lowered(device) -> str:
        f = functools.partial(jax_nvfp4.dot_general, dimension_numbers=DENSE)  # a new function: no jit cache
        return jax.jit(f).lower(jax.device_put(x, device), jax.device_put(w, device)).as_text()

    jaxpr = jax.make_jaxpr(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE))(x, w)
    assert [e.params["impl"] for e in eqns_named(jaxpr, "nvfp4_gemm")] == ["auto"]
    assert '"xla.scaled_dot"' in lowered(blackwell)
    assert [blackwell] in asked
    asked.clear()
    assert "xla.scaled_dot" not in lowered(jax.devices()[0])
    assert asked and all(d == [jax.devices()[0]] for d in asked)


def _in_fresh_python(code: str) -> str:
    """``code`` in a fresh Python (the offline target must register before JAX's first array), its stdout."""
    path = os.pathsep.join(filter(None, [str(ROOT), PLUGIN_PATH]))
    env = dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


SCALED_MATMUL = """
import benchmarks.offline_gpu as offline
offline.CUDNN_VERSION = {version!r}
offline.prepare()
import jax, jax.numpy as jnp
with offline.compile_for("b200") as on_gpu:
    args = [on_gpu((1, 256, 256), jnp.float4_e2m1fn)] * 2 + [on_gpu((1, 256, 16), jnp.float8_e4m3fn)] * 2
    print(jax.jit(jax.nn.scaled_matmul).trace(*args).lower().compile().as_text())
"""


@needs_plugin
def test_the_blackwell_target_compiles_scaled_matmul_to_cudnns_nvfp4_gemm():
    """With the cuDNN version read, XLA calls cuDNN's block-scaled GEMM on the FP4 codes; told an older cuDNN (as a
    target whose version XLA does not read is), it expands the GEMM into a dequantize and a dot instead."""
    assert "__cudnn$blockScaledDot" in _in_fresh_python(SCALED_MATMUL.format(version=CUDNN_VERSION))
    assert "__cudnn$blockScaledDot" not in _in_fresh_python(SCALED_MATMUL.format(version="9.6.0"))


def _layer(name: str) -> str:
    argv = ["layer_breakdown", "--shape", "256,256,256", "--target", name]
    return _in_fresh_python(
        f"import sys\nsys.argv = {argv!r}\nfrom benchmarks import layer_breakdown\nlayer_breakdown.main()"
    )


@needs_plugin
def test_auto_runs_every_gemm_of_the_layer_on_fp4_tensor_cores_for_blackwell():
    """The layer's forward and backward compiled offline for the B200 with Recipe() (impl="auto"): its three GEMMs
    are kernels whose PTX runs tcgen05 MMAs of kind mxf4nvf4, nothing is dequantized, and the model puts the step
    under bf16's time. (That auto emulates on a GPU without FP4 tensor cores: the decision test above; the H100's
    compiled layer: its records, benchmarks/results/layer-breakdown-h100-offline-*.)"""
    b200 = _layer("b200")
    gemms = [row for row in b200.splitlines() if "tcgen05 mxf4nvf4" in row]
    assert len(gemms) == 3, b200
    assert re.search(r"^\| NVFP4 dequantize \| 0 \|", b200, re.M), b200
    assert re.search(r"\*\*0\.\d\dx bf16's time\*\*", b200), b200  # the model: under bf16's
