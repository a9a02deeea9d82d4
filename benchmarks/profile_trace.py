"""Each compiled instruction's time, from a ``jax.profiler`` trace: what ``benchmarks.layer_breakdown --time``
puts beside its kernels' bytes.

The trace is read with ``jax.profiler.ProfileData`` (part of jax: no TensorBoard). On a GPU the device planes'
``XLA Ops`` lines hold one event per instruction run (custom calls, fusions, GEMMs), named as the compiled HLO
names them, timed on the device; on the CPU the host's XLA threads hold the same (an instruction that several
threads run records an event on each), timed on the host. An instruction's time is the span its events cover,
overlaps counted once. Not yet run on a GPU: the GPU reading follows the trace layout of jax's profiler,
unchecked here.
"""

from __future__ import annotations

import collections
import pathlib
import tempfile
from collections.abc import Callable

import jax


def _timed_lines(data) -> list:
    """The lines of the trace whose events are compiled instructions' runs."""
    device = [p for p in data.planes if p.name.startswith("/device:")]
    if device:
        return [line for plane in device for line in plane.lines if line.name == "XLA Ops"]
    host = [p for p in data.planes if p.name == "/host:CPU"]
    # XLA's CPU threads: its executor's and its thread pool's (named tf_XLAExecute, tf_XLAPjRtCpuClient,
    # tf_XLAEigen by jax version), not the Python thread's dispatch.
    return [line for plane in host for line in plane.lines if line.name.startswith("tf_XLA")]


def covered_ns(spans: list[tuple[int, int]]) -> int:
    """Nanoseconds that a set of [start, end) spans covers, overlaps once."""
    covered, reached = 0, None
    for start, end in sorted(spans):
        if reached is None or start > reached:
            covered, reached = covered + end - start, end
        elif end > reached:
            covered, reached = covered + end - reached, end
    return covered


def instruction_seconds(fn: Callable, *args, runs: int = 5) -> dict[str, float]:
    """Seconds a run of ``fn(*args)`` (a compiled or jitted function) spends in each instruction, by the
    instruction's name in the compiled HLO: the mean over ``runs`` traced runs, after one untraced run."""
    from jax.profiler import ProfileData  # jax >= 0.11 (benchmarks only: the library does not need it)

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(runs):
                out = fn(*args)
            jax.block_until_ready(out)
        (path,) = pathlib.Path(directory).glob("**/*.xplane.pb")
        data = ProfileData.from_file(str(path))
    spans: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for line in _timed_lines(data):
        for event in line.events:
            spans[event.name].append((event.start_ns, event.end_ns))
    return {name: covered_ns(s) * 1e-9 / runs for name, s in spans.items()}
