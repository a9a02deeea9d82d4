"""The build produced the modules it should."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4
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
    from jax_nvfp4_kernels import _nvfp4_cuda_host

    assert set(_nvfp4_cuda_host.registrations()) == TARGETS


def test_platforms_without_a_kernel_lower_to_the_reference():
    # Exported for CUDA on this CPU-only machine: where the CUDA module has no
    # kernel for an op, the op must lower to the pure-JAX reference instead.
    import jax
    import jax.numpy as jnp

    import jax_nvfp4

    targets = ("nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize")

    def f(x):  # with the transform: without it, the amax is XLA's reduction on a GPU (test_gpu_lowering.py)
        return jax_nvfp4.dequantize(jax_nvfp4.quantize(x, columnwise=True, rht=True))

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


# ---- The layout: the Python package at the repository's root (jax_nvfp4/), the compiled modules in a top-level
# package of their own (jax_nvfp4_kernels), which only a build makes. pytest runs the checkout's jax_nvfp4/ (the
# root is on its path) with the installed kernels; outside the checkout, the installed wheel runs whole.
REPO = pathlib.Path(__file__).resolve().parents[2]
_IMPORT_AND_QUANTIZE = (
    "import jax.numpy as jnp, numpy as np, jax_nvfp4, jax_nvfp4_kernels\n"
    "t = jax_nvfp4.quantize(jnp.linspace(-7, 7, 96, dtype=jnp.bfloat16).reshape(3, 32), columnwise=True)\n"
    "print(jax_nvfp4.__file__, jax_nvfp4_kernels.__file__, *(np.asarray(a).tobytes().hex() for a in "
    "(t.data, t.scale, t.data_t, t.scale_t)))"
)


def _import_and_quantize(cwd: pathlib.Path) -> list[str]:
    """A fresh Python's ``python -c`` in ``cwd``, without PYTHONPATH: the files it imports, the copies' bytes."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_AND_QUANTIZE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_the_checkout_imports_its_own_package_with_built_kernels():
    # The package sits at the root; what the suite runs is the checkout's, not a copy of it elsewhere.
    assert pathlib.Path(jax_nvfp4.__file__).resolve() == REPO / "jax_nvfp4" / "__init__.py"
    assert not (REPO / "src").exists()
    package, kernels, *_ = _import_and_quantize(REPO)  # python -c from the root, as python -m examples...
    assert pathlib.Path(package).resolve() == REPO / "jax_nvfp4" / "__init__.py"
    # The kernels are a build's (installed, or an in-place build's folder, which git ignores), never tracked.
    assert pathlib.Path(kernels).name == "__init__.py"
    assert "/jax_nvfp4_kernels/" in (REPO / ".gitignore").read_text().split()
    if (REPO / ".git").exists() and shutil.which("git"):  # CI's smoke subset runs with no git on PATH
        tracked = subprocess.run(["git", "ls-files", "jax_nvfp4_kernels"], cwd=REPO, capture_output=True, text=True)
        assert tracked.returncode == 0 and tracked.stdout == ""


def test_the_installed_wheel_runs_from_outside_the_checkout(tmp_path):
    try:
        dist = importlib.metadata.distribution("jax_nvfp4")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("jax_nvfp4 is not installed (the kernels are an in-place build)")
    package, kernels, *copies = _import_and_quantize(tmp_path)
    assert REPO not in pathlib.Path(package).resolve().parents, package
    assert pathlib.Path(kernels).resolve().parent.parent == pathlib.Path(package).resolve().parent.parent
    # The same bytes as the checkout's package gives here.
    t = jax_nvfp4.quantize(jnp.linspace(-7, 7, 96, dtype=jnp.bfloat16).reshape(3, 32), columnwise=True)
    assert copies == [np.asarray(a).tobytes().hex() for a in (t.data, t.scale, t.data_t, t.scale_t)]
    # And the wheel ships the checkout's Python, file for file: what the suite tested is what it installs.
    shipped = {str(f): f for f in dist.files or () if f.parts[0] == "jax_nvfp4" and f.suffix == ".py"}
    tracked = {str(p.relative_to(REPO)): p for p in (REPO / "jax_nvfp4").rglob("*.py")}
    assert sorted(shipped) == sorted(tracked), "reinstall: the installed jax_nvfp4 is not this checkout's"
    assert [name for name, f in shipped.items() if f.read_binary() != tracked[name].read_bytes()] == []
