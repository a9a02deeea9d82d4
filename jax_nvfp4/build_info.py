"""What this installation of jax_nvfp4 holds and what it will run: ``build_info()`` and its report.

``python -m jax_nvfp4`` prints the report (``--json``: the dict). The compiled modules report their own
build settings (CMake's, compiled in: ``ffi/build_config.h``), so what is printed is what was built.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import jax
import jaxlib.version

from jax_nvfp4.linear.block_sum import has_fp4_tensor_cores
from jax_nvfp4.ops import ffi

# The FFI targets of the package's ops (one kernel each where a module has it, the reference elsewhere).
OPS = ("nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_grouped_amax", "nvfp4_grouped_quantize")
KERNEL, REFERENCE = "kernel", "reference"


def _module_platform(device) -> str:
    """The compiled module's platform for ``device``: "cpu", "cuda", or its own name (e.g. "rocm")."""
    if device.platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return device.platform


def _host_model_config() -> dict | None:
    """The test-only CUDA host model's build settings (``NVFP4_CUDA_HOST=ON``), None where not built."""
    if importlib.util.find_spec("jax_nvfp4_kernels._nvfp4_cuda_host") is None:
        return None
    return dict(importlib.import_module("jax_nvfp4_kernels._nvfp4_cuda_host").build_config())


def _devices() -> dict[str, dict]:
    """Per platform of JAX's devices: the devices, what runs each op there, and the GEMM ``impl="auto"``."""
    by_platform: dict[str, list] = {}
    for device in jax.devices():
        by_platform.setdefault(_module_platform(device), []).append(device)
    report = {}
    for platform, devices in by_platform.items():
        missing = ffi.unsupported_gpus(devices) if platform == "cuda" else []
        ops = {}
        for op in OPS:
            if platform not in ffi.platforms_with(op):
                ops[op] = REFERENCE
            elif missing:
                ops[op] = "error: the CUDA module lacks " + "; ".join(missing)
            else:
                ops[op] = KERNEL
        sm = (lambda d: f" (sm {d.compute_capability})") if platform == "cuda" else (lambda d: "")
        report[platform] = {
            "devices": [d.device_kind + sm(d) for d in devices],
            "ops": ops,
            "gemm": "scaled_dot" if has_fp4_tensor_cores(devices) else "emulated",
        }
    return report


def build_info() -> dict:
    """What this installation was built with and what each op runs on the current devices.

    Returns a JSON-ready dict:
      version: jax_nvfp4's version; jax, jaxlib: the installed ones.
      modules: per compiled module ("cpu", "cuda", and "cuda_host", the CUDA kernels on the CPU that the
        tests run), None where not built, else its build settings: version, jaxlib (whose XLA FFI
        headers it was compiled against), xla_ffi_api, compiler, cpu_arch (-march; "" the compiler's
        default), sanitizers; the CUDA module also cuda_architectures (CMake's list: "90" is sm_90 code
        plus compute_90 PTX, which later GPUs compile at load time), cuda_compiler and cuda_runtime
        ("static": no CUDA toolkit needed at run time).
      devices: per platform of ``jax.devices()`` ("cpu", "cuda", ...): devices (their kinds), ops (per
        FFI op: "kernel", "reference" where no module has one, so the pure-JAX spec runs, or an
        "error: ..." where the CUDA module lacks the GPU's architecture) and gemm (what
        ``impl="auto"`` picks: "scaled_dot" on FP4 tensor cores, else "emulated").
    """
    import jax_nvfp4  # the package's __init__ imports this module

    return {
        "version": jax_nvfp4.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "modules": {**ffi.build_configs(), "cuda_host": _host_model_config()},
        "devices": _devices(),
    }


# What each compiled module is, and what to do where it is not built: one line each in the report.
MODULE_ROLES = {
    "cpu": ("the CPU kernels", "the pure-JAX reference runs each op instead (slower, the same bytes)"),
    "cuda": (
        "the GPU kernels",
        "only a GPU needs it; a source install builds it where it finds nvcc and a GPU (NVFP4_CUDA=ON: always)",
    ),
    "cuda_host": (
        "the CUDA kernels run on the CPU by a host model, for the tests only",
        "only the test suite uses it (NVFP4_CUDA_HOST=ON builds it)",
    ),
}


def _module_line(name: str, config: dict | None) -> str:
    role, absent = MODULE_ROLES.get(name, (name, ""))
    if config is None:
        return f"  {name:<10} not built: {absent}" if absent else f"  {name:<10} not built"
    parts = [f"built against jaxlib {config['jaxlib']} (XLA FFI API {config['xla_ffi_api']})", config["compiler"]]
    parts.append(f"-march={config['cpu_arch']}" if config["cpu_arch"] else "the compiler's default -march")
    if "cuda_architectures" in config:
        archs = config["cuda_architectures"].split(",")
        runtime = f"{config['cuda_runtime']} CUDA runtime"
        parts[:0] = [f"CUDA architectures {', '.join(archs)}", config["cuda_compiler"], runtime]
    if config["sanitizers"]:
        parts.append("ASan + UBSan")
    return f"  {name:<10} {role}: {'; '.join(parts)}"


def report(info: dict | None = None) -> str:
    """``build_info()`` as readable lines."""
    info = build_info() if info is None else info
    lines = [f"jax_nvfp4 {info['version']} (installed: jax {info['jax']}, jaxlib {info['jaxlib']})"]
    lines.append("compiled modules (the kernels this installation carries; how each was built):")
    lines += [_module_line(name, config) for name, config in info["modules"].items()]
    lines.append(
        "devices (what jax sees here; per op, what runs it: 'kernel' a compiled module's, 'reference' the pure-JAX"
        " spec; the GEMM that Recipe(impl='auto') picks: 'scaled_dot' on FP4 tensor cores, else 'emulated', the"
        " dot of the dequantized operands):"
    )
    for platform, entry in info["devices"].items():
        kinds = sorted(set(entry["devices"]))
        lines.append(f"  {platform}: {len(entry['devices'])} x {', '.join(kinds)}; GEMM impl='auto': {entry['gemm']}")
        for op, runs in entry["ops"].items():
            lines.append(f"    {op:<24} {runs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m jax_nvfp4 [--json]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jax_nvfp4", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print build_info() as JSON")
    args = parser.parse_args(argv)
    print(json.dumps(build_info(), indent=2) if args.json else report())
