"""What ships: release wheels hold the product only (no test-only host model, tests, benchmarks or build files),
and a source install leaves nothing in the checkout."""

from __future__ import annotations

import os
import pathlib
import re
import tomllib
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_release_wheels_are_built_without_the_host_model():
    """cibuildwheel (the release build) leaves NVFP4_CUDA_HOST at its default, which is OFF in both places that
    set one; CI builds the host model into the wheel it tests only (.ci/run)."""
    release_env = PYPROJECT["tool"]["cibuildwheel"]["linux"]["environment"]
    assert release_env.get("NVFP4_CUDA_HOST", "OFF") == "OFF"
    assert PYPROJECT["tool"]["scikit-build"]["cmake"]["define"]["NVFP4_CUDA_HOST"]["default"] == "OFF"
    assert re.search(r"option\(NVFP4_CUDA_HOST \"[^\"]*\" OFF\)", (REPO / "CMakeLists.txt").read_text())


def test_a_source_install_builds_outside_the_checkout():
    """No build-dir: scikit-build-core builds in a temporary folder (.ci/run checks that no build/ is left)."""
    assert "build-dir" not in PYPROJECT["tool"]["scikit-build"]


def _release_wheel() -> pathlib.Path | None:
    path = os.environ.get("NVFP4_RELEASE_WHEEL")
    if path is None and os.environ.get("NVFP4_EXPECT_RELEASE_WHEEL"):
        pytest.fail("NVFP4_EXPECT_RELEASE_WHEEL is set but NVFP4_RELEASE_WHEEL names no wheel")
    return None if path is None else pathlib.Path(path)


def test_a_wheel_built_with_the_release_settings_holds_the_product_only():
    """The wheel CI builds with the release settings (.ci/run's second run): the package and its compiled CPU
    module, and nothing else of the repository."""
    wheel = _release_wheel()
    if wheel is None:
        pytest.skip("NVFP4_RELEASE_WHEEL (a wheel built with the release settings) is not set")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"jax_nvfp4", "jax_nvfp4_kernels"}, top
    assert "jax_nvfp4/__init__.py" in names
    assert any(re.fullmatch(r"jax_nvfp4_kernels/_nvfp4_cpu\..*\.so", n) for n in names), names
    assert not [n for n in names if "_nvfp4_cuda_host" in n], "the test-only host model is in the wheel"
