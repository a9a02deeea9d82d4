"""build_info() and ``python -m jax_nvfp4`` report the truth: checked against the installed metadata, the
modules that import, the compiled program's custom calls and the CUDA module's own binary."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from helpers import cuda_tool

import jax_nvfp4
from jax_nvfp4.build_info import MODULE_ROLES, OPS
from jax_nvfp4.ops import ffi

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_version_has_one_value():
    # __version__ is the one place (pyproject.toml reads it): the metadata, every module and the changelog agree.
    version = jax_nvfp4.__version__
    assert importlib.metadata.version("jax_nvfp4") == version
    modules = jax_nvfp4.build_info()["modules"]
    assert {name: m["version"] for name, m in modules.items() if m} == dict.fromkeys(
        (name for name, m in modules.items() if m), version
    )
    newest = re.search(r"^## \[?(\d[^\]\s]*)", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert newest and newest.group(1) == version


def test_modules_are_those_that_import():
    modules = jax_nvfp4.build_info()["modules"]
    assert modules["cpu"] is not None
    assert (modules["cuda"] is not None) == ffi.cuda_module_built()
    host_built = importlib.util.find_spec("jax_nvfp4_kernels._nvfp4_cuda_host") is not None
    assert (modules["cuda_host"] is not None) == host_built
    if os.environ.get("NVFP4_EXPECT_CUDA_MODULE") == "1":
        assert modules["cuda"] is not None
    if os.environ.get("NVFP4_EXPECT_CUDA_HOST_MODULE") == "1":
        assert modules["cuda_host"] is not None
    for config in filter(None, modules.values()):
        assert re.fullmatch(r"\d+\.\d+\.\d+\S*", config["jaxlib"]), config
        assert re.fullmatch(r"\d+\.\d+", config["xla_ffi_api"]), config
        assert config["compiler"].split()[0] in ("gcc", "clang"), config


def test_what_runs_each_op_is_what_the_program_calls():
    # "kernel" exactly where the compiled program calls the op's FFI target, "reference" where it does not,
    # on the platform jit compiles for: build_info lists the default backend's ("cpu", or "cuda" on a GPU machine).
    (entry,) = jax_nvfp4.build_info()["devices"].values()
    assert set(entry["ops"]) == set(OPS)

    def f(x):
        return jax_nvfp4.dequantize(jax_nvfp4.quantize(x, columnwise=True))

    hlo = jax.jit(f).lower(jnp.ones((32, 64), jnp.bfloat16)).as_text()
    for op in ("nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize"):
        assert (f"@{op}(" in hlo) == (entry["ops"][op] == "kernel"), op


def _listed(tool: str, flag: str, binary: str) -> set[str]:
    out = subprocess.run([tool, flag, binary], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"\.(sm_\d+[af]?)\.(?:cubin|ptx)", out))


@pytest.mark.skipif(not ffi.cuda_module_built(), reason="built without the CUDA module")
def test_cuda_architectures_are_those_in_the_binary():
    tool = cuda_tool("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump: the test extra has it)")
    binary = importlib.util.find_spec("jax_nvfp4_kernels._nvfp4_cuda").origin
    code, ptx = set(), set()
    for entry in ffi.cuda_architectures():  # CMake's spelling: "90" is both, "90-real" code, "90-virtual" PTX
        arch, _, part = entry.partition("-")
        if part in ("", "real"):
            code.add("sm_" + arch)
        if part in ("", "virtual"):
            ptx.add("sm_" + arch)
    assert _listed(tool, "--list-elf", binary) == code
    assert _listed(tool, "--list-ptx", binary) == ptx


@pytest.mark.parametrize(
    ("capability", "architectures", "runs"),
    [
        ("9.0", ("90", "100a", "120a"), True),  # sm_90 code
        ("10.0", ("90", "100a", "120a"), True),  # sm_100a code
        ("10.3", ("90", "100a", "120a"), True),  # compute_90 PTX, compiled by the driver
        ("8.0", ("90", "100a", "120a"), False),  # older than every target
        ("8.9", ("90-real",), False),
        ("9.0", ("90-virtual",), True),
        ("11.0", ("90-real", "100a-real"), False),  # sm_90 code runs on 9.x only, sm_100a on 10.0 only
        ("10.3", ("100a",), False),  # arch-specific code and PTX: 10.0 only
        ("10.3", ("100f",), True),  # family code: 10.x from 10.0
        ("12.1", ("120a-real", "100f-real"), False),
        ("8.6", ("80",), True),
    ],
)
def test_which_gpus_a_build_runs_on(capability, architectures, runs):
    assert ffi.runs_on(capability, architectures) == runs


def test_a_gpu_the_build_lacks_gets_an_error_naming_it(monkeypatch):
    a100 = types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0", platform="gpu")
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0", platform="gpu")
    monkeypatch.setattr(ffi, "cuda_architectures", lambda: ("90", "100a", "120a"))
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [h100, a100])
    assert ffi.unsupported_gpus([h100, a100]) == ["NVIDIA A100-SXM4-80GB (compute capability 8.0)"]
    ffi.check_cuda_devices.cache_clear()
    try:
        named = r"built for 90, 100a, 120a .* NVIDIA A100-SXM4-80GB \(compute capability 8\.0\)"
        with pytest.raises(RuntimeError, match=named):
            ffi.check_cuda_devices()
        monkeypatch.setattr(jax, "local_devices", lambda backend=None: [h100])
        ffi.check_cuda_devices.cache_clear()
        ffi.check_cuda_devices()  # every GPU covered: no error
    finally:
        ffi.check_cuda_devices.cache_clear()


def test_python_m_jax_nvfp4_prints_build_info():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(*args: str) -> str:
        command = [sys.executable, "-m", "jax_nvfp4", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout

    printed = json.loads(run("--json"))
    assert printed["version"] == jax_nvfp4.__version__
    assert printed["modules"] == jax_nvfp4.build_info()["modules"]
    text = run()
    assert text.startswith(f"jax_nvfp4 {jax_nvfp4.__version__} ")
    assert re.search(r"^  cpu: \d+ x cpu; GEMM impl='auto': emulated$", text, re.MULTILINE)
    assert re.search(r"^    nvfp4_quantize +kernel$", text, re.MULTILINE)
    for name, config in printed["modules"].items():  # each module's line says what it is, or why it may be absent
        role, absent = MODULE_ROLES[name]
        assert f"  {name:<10} " + (f"not built: {absent}" if config is None else f"{role}: ") in text
