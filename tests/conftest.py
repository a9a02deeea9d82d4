"""pytest configuration of the tests: hypothesis profiles and the NVFP4_KERNEL_CASES_ONLY hook (the XLA flags, which
the docs' doctests share, are in the repository's conftest.py). The helpers the test files share are in
tests/helpers/."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Hypothesis profiles, chosen with NVFP4_HYPOTHESIS_PROFILE. Every example compiles the
# reference for a fresh shape (about a second on 2 cores), so the default "ci" profile, which
# plain `pytest` and CI run, draws a quarter of the examples of "thorough" (for local work before
# a change lands, and for GPU runs). "sanitize" (.ci/sanitize) draws a tenth: under ASan each
# example is several times slower, and that step is after code paths, which the fixed cases and
# a few random ones reach, while the whole suite draws the values. The fixed cases (golden files,
# option combinations, edge values) run in full under every profile. A test with its own count takes
# helpers.examples(n), n being its count under "thorough", which scales it as the profile's default count.
EXAMPLE_SHARE = {"sanitize": 0.1, "ci": 0.25, "thorough": 1.0}
PROFILE = os.environ.get("NVFP4_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in EXAMPLE_SHARE:
    raise ValueError(f"NVFP4_HYPOTHESIS_PROFILE must be one of {sorted(EXAMPLE_SHARE)}, got {PROFILE!r}")

for _name, _share in EXAMPLE_SHARE.items():
    settings.register_profile(
        _name,
        max_examples=max(3, round(40 * _share)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,  # a failure prints the @reproduce_failure line
    )
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(config, items):
    """With NVFP4_KERNEL_CASES_ONLY=1 (.ci/sanitize), drop the cases that run only the pure-JAX reference
    (``impl`` = the reference): they run no C++, and the whole suite runs them."""
    from helpers import KERNEL_CASES_ONLY

    if not KERNEL_CASES_ONLY:
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
