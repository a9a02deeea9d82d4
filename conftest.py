"""pytest configuration shared by the tests (tests/) and the docs' doctests (docs/*.md): XLA's flags, which XLA
reads once, when jax starts its backends, so they are set here, before any test imports jax."""

from __future__ import annotations

import os


def _add_xla_flag(name: str, value) -> None:
    """Appends --name=value to XLA_FLAGS unless the environment already sets it (XLA reads them once, when jax
    starts its backends)."""
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


def _gpu_plugin_installed() -> bool:
    from importlib import metadata

    return any((d.metadata["Name"] or "").startswith("jax-cuda") for d in metadata.distributions())


# The sharding tests use 8 CPU devices.
_add_xla_flag("xla_force_host_platform_device_count", 8)
# On the CPU, compiling is most of the suite's time (the reference is bit-level integer emulation, thousands
# of ops a quantize), and LLVM's optimization of the compiled code is a large share of it: the suite turns it
# off, about a quarter less time in all. The results checked do not depend on it (the reference computes in
# integers, the kernels are our C++, the GEMMs library calls), and the suite passes at XLA's default too:
# XLA_FLAGS=--xla_backend_optimization_level=3 pytest. GPU runs keep the default.
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and not _gpu_plugin_installed():
    _add_xla_flag("xla_backend_optimization_level", 0)
