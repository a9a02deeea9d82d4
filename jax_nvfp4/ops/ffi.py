"""Loads the compiled FFI modules and registers their targets with XLA; what they were built with."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax

# The compiled modules are the package jax_nvfp4_kernels (CMakeLists.txt), installed by the wheel beside this one:
# a source checkout's jax_nvfp4/ runs with the installed kernels, or with an in-place build's.
try:
    from jax_nvfp4_kernels import _nvfp4_cpu
except ImportError as e:
    raise ImportError(
        "jax_nvfp4's compiled module jax_nvfp4_kernels._nvfp4_cpu is missing: install the package "
        "(pip install .), which builds it"
    ) from e

try:  # built only where the CUDA toolkit was found
    from jax_nvfp4_kernels import _nvfp4_cuda
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


def build_configs() -> dict[str, dict | None]:
    """Each compiled module's build settings (``ffi/build_config.h``), None where it was not built."""
    return {p: None if m is None else dict(m.build_config()) for p, m in _MODULES.items()}


def cuda_architectures() -> tuple[str, ...]:
    """The CUDA module's target architectures as CMake took them ("90": sm_90 code and compute_90 PTX;
    "100a": sm_100a and compute_100a; "-real" / "-virtual": the code or the PTX alone); () without it."""
    config = build_configs()["cuda"]
    return tuple(a for a in config["cuda_architectures"].split(",") if a) if config else ()


def runs_on(compute_capability: str, architectures: Sequence[str]) -> bool:
    """Whether a module built for ``architectures`` (CMake's spelling) runs on a GPU of compute capability
    ``compute_capability`` ("9.0"): sm_XY code runs on X.Y' for Y' >= Y (sm_XYa only on X.Y, sm_XYf on
    X.Y' of the same family); compute_XY PTX is compiled by the driver for any X.Y' >= X.Y (arch-specific
    PTX, compute_XYa, only for X.Y). An entry CMake resolves itself ("native", "all") counts as covering."""
    major, minor = (int(v) for v in compute_capability.split(".")[:2])
    device = 10 * major + minor
    for entry in architectures:
        if entry in ("native", "all", "all-major"):
            return True
        arch, _, part = entry.partition("-")
        suffix = arch[-1] if arch[-1] in "af" else ""
        number = int(arch.rstrip("af"))
        same_family = number // 10 == major and number <= device
        if suffix == "a":
            code_runs = ptx_runs = number == device
        elif suffix == "f":
            code_runs = ptx_runs = same_family
        else:
            code_runs, ptx_runs = same_family, number <= device
        if (part in ("", "real") and code_runs) or (part in ("", "virtual") and ptx_runs):
            return True
    return False


def unsupported_gpus(devices: Iterable) -> list[str]:
    """The CUDA devices among ``devices`` that the CUDA module cannot run on, as "kind (compute capability
    X.Y)"; [] without a CUDA module (the reference runs there)."""
    architectures = cuda_architectures()
    if not architectures:
        return []
    return [
        f"{d.device_kind} (compute capability {d.compute_capability})"
        for d in devices
        if getattr(d, "compute_capability", None) and not runs_on(d.compute_capability, architectures)
    ]


@functools.cache
def check_cuda_devices() -> None:
    """Raise a clear error where a local CUDA GPU's architecture is not in the CUDA module: XLA would
    otherwise fail at launch (no kernel image for the device). Run when an op first lowers for CUDA."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU here: lowered for another machine (jax.export), which loads its own build
        return
    missing = unsupported_gpus(devices)
    if missing:
        raise RuntimeError(
            f"jax_nvfp4's CUDA kernels were built for {', '.join(cuda_architectures())} (CMake's CUDA "
            f"architectures), which do not run on {'; '.join(missing)}. Build from source for it: "
            "NVFP4_CUDA=ON pip install . -C cmake.define.NVFP4_CUDA_ARCHITECTURES='<its arch, e.g. 80>' "
            "(python -m jax_nvfp4 shows what this build holds)"
        )
