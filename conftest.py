"""pytest configuration shared by the tests (tests/) and the docs' doctests (docs/*.md): XLA's flags, which XLA
reads once, when jax starts its backends, so they are set here, before any test imports jax."""

from __future__ import annotations

import os

import pytest


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
# of ops a quantize), so the suite compiles for speed of compiling, unless XLA_FLAGS already sets the optimization
# level (then XLA's own defaults stand, as in CI's Python 3.11 subset: XLA_FLAGS=--xla_backend_optimization_level=3):
# - LLVM's optimization of the compiled code off: about a quarter less time in all;
# - on jax 0.11, XLA's older elemental fusion emitters instead of the MLIR fusion pipeline, whose per-fusion
#   passes were the largest share of a compile: two of the costliest test files took 11% less (docs/testing.md).
#   jax 0.12's XLA has no older emitters and ignores the option (CI's Python 3.12 run resolves jax 0.12: no
#   change there); jax 0.10's accepts it (not measured).
# The results checked do not depend on either (the reference computes in integers, the kernels are our C++, the
# GEMMs library calls; a float op gives IEEE results under both emitters), and the suite passes at XLA's
# defaults too. GPU runs keep the defaults.
if (
    os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
    and not _gpu_plugin_installed()
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
):
    _add_xla_flag("xla_backend_optimization_level", 0)
    _add_xla_flag("xla_backend_extra_options", "xla_cpu_disable_new_fusion_emitters")


# ---- Where the suite's time goes: `pytest --time-report=N` prints, after the run, the N test files and the
# test groups (tests/<group>/) that took longest, each with its share spent in jax's compiler (tracing,
# lowering to MLIR, XLA's backend compile: jax.monitoring's duration events), summed over the workers.
# .ci/run asks for it; docs/testing.md keeps the last quiet run's table.

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]  # in this process, since it started
_times: dict[str, list[float]] = {}  # file: [seconds, compile seconds, tests] (on the controller)


def pytest_addoption(parser):
    parser.addoption(
        "--time-report",
        type=int,
        default=0,
        metavar="N",
        help="after the run, the N slowest test files and every test group, with jax's compile share",
    )


def pytest_configure(config):
    import jax

    def on_duration(name: str, secs: float, **_) -> None:
        if name in _COMPILE_EVENTS:
            _compile_seconds[0] += secs

    jax.monitoring.register_event_duration_secs_listener(on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the compile seconds since the last one (xdist sends them to the controller)."""
    outcome = yield
    mark, item._compile_mark = item._compile_mark, _compile_seconds[0]
    outcome.get_result().user_properties.append(("compile_s", _compile_seconds[0] - mark))


def pytest_runtest_protocol(item, nextitem):
    item._compile_mark = _compile_seconds[0]  # before the test's setup


def pytest_runtest_logreport(report):
    entry = _times.setdefault(report.nodeid.split("::")[0], [0.0, 0.0, 0])
    entry[0] += report.duration
    entry[1] += dict(report.user_properties).get("compile_s", 0.0)
    entry[2] += report.when == "call"


def pytest_terminal_summary(terminalreporter, config):
    rows = config.getoption("--time-report")
    if not rows or not _times or hasattr(config, "workerinput"):
        return
    groups: dict[str, list[float]] = {}
    for path, (secs, comp, tests) in _times.items():
        parts = path.split("/")
        group = "/".join(parts[:2]) if parts[0] == "tests" and len(parts) > 2 else parts[0]
        g = groups.setdefault(group, [0.0, 0.0, 0])
        g[0], g[1], g[2] = g[0] + secs, g[1] + comp, g[2] + tests
    total = sum(v[0] for v in _times.values())
    compiling = sum(v[1] for v in _times.values())
    write = terminalreporter.write_line
    terminalreporter.section("time report (seconds summed over the workers; compile: jax's tracing, lowering, XLA)")

    def table(title: str, items: dict[str, list[float]], limit: int) -> None:
        write(f"{'seconds':>9} {'compile':>8} {'tests':>6}  {title}")
        for name, (secs, comp, tests) in sorted(items.items(), key=lambda kv: -kv[1][0])[:limit]:
            write(f"{secs:9.1f} {100 * comp / max(secs, 1e-9):7.0f}% {tests:6d}  {name}")

    table("test group", groups, len(groups))
    write("")
    table(f"test file (the {rows} slowest of {len(_times)})", _times, rows)
    write(f"{total:9.1f} {100 * compiling / max(total, 1e-9):7.0f}% {sum(int(v[2]) for v in _times.values()):6d}  all")
