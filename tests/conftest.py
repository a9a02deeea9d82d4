"""Shared test fixtures: hypothesis profiles and input generators."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings


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

# Hypothesis profiles, chosen with NVFP4_HYPOTHESIS_PROFILE. Every example compiles the
# reference for a fresh shape (about a second on 2 cores), so the default "ci" profile, which
# plain `pytest` and CI run, draws a quarter of the examples of "thorough" (for local work before
# a change lands, and for GPU runs). "sanitize" (.ci/sanitize) draws a tenth: under ASan each
# example is several times slower, and that step is after code paths, which the fixed cases and
# a few random ones reach, while the whole suite draws the values. The fixed cases (golden files,
# option combinations, edge values) run in full under every profile.
EXAMPLE_SHARE = {"sanitize": 0.1, "ci": 0.25, "thorough": 1.0}
PROFILE = os.environ.get("NVFP4_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in EXAMPLE_SHARE:
    raise ValueError(f"NVFP4_HYPOTHESIS_PROFILE must be one of {sorted(EXAMPLE_SHARE)}, got {PROFILE!r}")


def examples(thorough: int) -> int:
    """A test's example count: ``thorough`` under the thorough profile, scaled for the active one (at least 3)."""
    return max(3, round(thorough * EXAMPLE_SHARE[PROFILE]))


for _name, _share in EXAMPLE_SHARE.items():
    settings.register_profile(
        _name,
        max_examples=max(3, round(40 * _share)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,  # a failure prints the @reproduce_failure line
    )
settings.load_profile(PROFILE)

SPECIAL_VALUES = {
    "zero": [0.0, -0.0],
    "inf": [np.inf, -np.inf],
    "nan": [np.nan],
    # float32/bfloat16 subnormals, and values whose scaled products underflow.
    "subnormal": [1e-39, -1e-39, 3e-45, -5.9e-39, 1e-40],
    "outlier": [1e30, -3e38, 6.5e4, -1e20],
    "tiny": [1e-30, -1e-30, -1e-6, 2.0**-126],
}


def columnwise_as_rowwise(t):
    """The columnwise copy of a quantized [M, N] tensor as the rowwise tensor of its [N, M] transpose."""
    import jax_nvfp4

    return jax_nvfp4.NVFP4Tensor(
        t.data_t, t.scale_t, t.amax_t, None, None, None, t.shape[::-1], t.dtype,
        spec=jax_nvfp4.QuantizeSpec(row_scaled=t.row_scaled, four_over_six_error=t.spec.four_over_six_error,
                                    e4m3_max=t.e4m3_max),
    )  # fmt: skip


def random_tensor(rng: np.random.Generator, shape, dtype, *, spread: float, specials: tuple[str, ...], frac: float):
    """Normal values times 10**U(-spread, spread), with a fraction of special values."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, size=shape)
    pool = [v for name in specials for v in SPECIAL_VALUES[name]]
    if pool:
        mask = rng.random(shape) < frac
        x = np.where(mask, rng.choice(pool, size=shape), x)
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(dtype)


def eqns_named(jaxpr, name: str) -> list:
    """Every equation of primitive ``name`` that a (closed) jaxpr runs, nested jaxprs included, one per call."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += eqns_named(sub, name)
    return found


def pytest_collection_modifyitems(config, items):
    """With NVFP4_KERNEL_CASES_ONLY=1 (.ci/sanitize), drop the cases that run only the pure-JAX reference
    (``impl`` = the reference): they run no C++, and the whole suite runs them."""
    if os.environ.get("NVFP4_KERNEL_CASES_ONLY") != "1":
        return
    from jax_nvfp4 import reference

    kept, dropped = [], []
    for item in items:
        impl = item.callspec.params.get("impl") if hasattr(item, "callspec") else None
        # The reference module (test_api), or its name (test_golden's parameter).
        (dropped if impl is reference or impl == "reference" else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
