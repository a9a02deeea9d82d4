"""Loads the compiled FFI modules and registers their targets with XLA."""

from __future__ import annotations

import functools

import jax

try:
    from jax_nvfp4 import _nvfp4_cpu
except ImportError as e:  # e.g. `python -m pytest` in a source checkout imports ./jax_nvfp4
    raise ImportError(
        "jax_nvfp4's compiled module _nvfp4_cpu is missing: install the package (pip install .) "
        "and import it from outside the source tree"
    ) from e

try:  # built only where the CUDA toolkit was found
    from jax_nvfp4 import _nvfp4_cuda
except ImportError:
    _nvfp4_cuda = None

_MODULES = {"cpu": _nvfp4_cpu, "cuda": _nvfp4_cuda}


@functools.cache
def _targets(platform: str) -> frozenset[str]:
    module = _MODULES[platform]
    if module is None:
        return frozenset()
    regs = module.registrations()
    for name, capsule in regs.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform.upper() if platform == "cuda" else platform)
    return frozenset(regs)


def platforms_with(target: str) -> list[str]:
    """The platforms that have a compiled kernel for FFI target ``target``."""
    return [p for p in _MODULES if target in _targets(p)]


def cuda_module_built() -> bool:
    return _nvfp4_cuda is not None
