"""The docs' snippets run as doctests (``pytest`` collects ``docs/*.md``, see pyproject.toml).

Like tests/conftest.py: 8 CPU devices (the sharding snippets use a mesh) and, on the CPU, XLA's LLVM
optimization off (compiling is most of a snippet's time; no printed value depends on it).
"""

import os


def _add_xla_flag(name: str, value) -> None:
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


_add_xla_flag("xla_force_host_platform_device_count", 8)
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    _add_xla_flag("xla_backend_optimization_level", 0)
