"""Shared helpers of the benchmark scripts: median wall time and the machine's name."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

import jax


def median_seconds(fn, *args, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def queued_seconds(fn, *args, calls: int, rounds: int = 3) -> float:
    """Seconds a call of ``fn(*args)`` takes when ``calls`` calls are queued and waited for once.

    What a training step gets: the device runs the calls back to back while the host dispatches the
    next ones, so the time per call is the kernels' (not the dispatch's) once they take longer than
    dispatching. The best of ``rounds`` rounds, after one warm-up (compile) call.
    """
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)  # an earlier call's buffers are freed in stream order, not waited for
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def commit() -> str:
    """The checkout's commit (short), marked where jax_nvfp4/ has uncommitted changes; "?" outside git."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--", "../jax_nvfp4")
        return git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes under jax_nvfp4/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def device_name() -> str:
    """The accelerator's name, or the CPU model on a CPU backend."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return device.device_kind
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Report:
    """Markdown lines printed as they come, and written to ``path`` (if given) at the end."""

    def __init__(self, path: str | None, header: list[str]) -> None:
        self.path, self.lines = path, []
        for line in header:
            self.add(line)

    def add(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")
