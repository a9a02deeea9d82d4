"""Training as several JAX processes (``--processes``): how a process joins the job (``jax.distributed``), and a
launcher that runs a command as N processes on this machine, the way a cluster runs one per host.

Every process runs the same program on a mesh over the devices of all of them (``jax.devices()``); each holds
and computes its own devices' shards, and the collectives between processes are gloo's on CPU (NCCL's on GPUs).
``launch`` gives each of N local processes its share of the CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count``), a process id and the coordinator's address (process 0,
on 127.0.0.1), runs them together and fails as soon as one of them does.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

LOCALHOST = "127.0.0.1"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


class ProcessesError(RuntimeError):
    """A launched process exited with an error, or the processes ran past their time (the others are killed)."""


def join(processes: int | None = None, process_id: int | None = None, coordinator: str | None = None) -> None:
    """Join the job as process ``process_id`` of ``processes`` at ``coordinator`` (HOST:PORT of process 0's
    coordinator service); ``coordinator="auto"``: ``jax.distributed.initialize()`` finds all three in the
    cluster's environment (SLURM, Open MPI, Kubernetes, Cloud TPU). Call it before anything uses jax's devices."""
    import jax

    # The CPU's collectives between processes (gloo: jax 0.12's default, set in case another version's differs);
    # GPUs use NCCL's.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=process_id)


def free_port() -> int:
    """A TCP port nobody listens on now, for the coordinator."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def with_device_count(xla_flags: str, devices: int) -> str:
    """``xla_flags`` (XLA_FLAGS) asking for ``devices`` CPU devices, any other count it names replaced."""
    kept = re.sub(rf"\s*{DEVICE_COUNT_FLAG}=\S*", "", xla_flags).strip()
    return f"{kept} {DEVICE_COUNT_FLAG}={devices}".strip()


def launch(
    command: Callable[[int, str], Sequence[str]],
    processes: int,
    local_devices: int,
    *,
    timeout: float | None = None,
    show_first: bool = False,
) -> list[str]:
    """Run ``command(process_id, coordinator)`` as ``processes`` processes on this machine's CPU, each with
    ``local_devices`` devices, and wait for all of them; return each one's output (stdout and stderr).

    ``show_first``: process 0 writes to this process's stdout and stderr as it runs (its returned output is
    empty); the others' output is kept. If one exits with an error, or ``timeout`` seconds pass, the others are
    killed (a process whose peer died would wait in a collective) and ``ProcessesError`` says which, with the
    output of each."""
    coordinator = f"{LOCALHOST}:{free_port()}"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": with_device_count(os.environ.get("XLA_FLAGS", ""), local_devices),
        "PYTHONUNBUFFERED": "1",
    }
    with tempfile.TemporaryDirectory(prefix="nvfp4-processes-") as logs:
        files, children = [], []
        try:
            for i in range(processes):
                shown = show_first and i == 0
                files.append(None if shown else open(os.path.join(logs, f"{i}.log"), "w+"))  # noqa: SIM115
                out = {} if shown else {"stdout": files[-1], "stderr": subprocess.STDOUT}
                children.append(subprocess.Popen(list(command(i, coordinator)), env=env, **out))
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                codes = [c.poll() for c in children]
                failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
                if failed is None and deadline is not None and time.monotonic() > deadline:
                    failed = "timeout"
                if failed is not None or all(code == 0 for code in codes):
                    break
                time.sleep(0.1)
        finally:
            for c in children:  # only what is still running: the failure case, or an interrupt
                if c.poll() is None:
                    c.send_signal(signal.SIGTERM)
            for c in children:
                try:
                    c.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    c.kill()
                    c.wait()
        outputs = []
        for f in files:
            if f is None:
                outputs.append("")
            else:
                f.seek(0)
                outputs.append(f.read())
                f.close()
    if failed is not None:
        what = (
            f"ran past {timeout:.0f} s"
            if failed == "timeout"
            else f"process {failed} exited with status {children[failed].returncode}"
        )
        shown = "\n".join(
            f"--- process {i} (status {c.returncode}):\n{out}"
            for i, (c, out) in enumerate(zip(children, outputs, strict=True))
            if out
        )
        raise ProcessesError(f"{processes} processes: {what}; the others were stopped\n{shown}")
    return outputs


def rerun_as_processes(argv: Sequence[str], processes: int, local_devices: int) -> int:
    """``python -m examples.train_lm ARGV`` as ``processes`` local processes (``--process-id I --coordinator``
    added), process 0's output shown as it runs; the exit status (non-zero, with the failing process's output on
    stderr, if one fails)."""

    def command(i: int, coordinator: str) -> list[str]:
        return [sys.executable, "-m", "examples.train_lm", *argv, "--process-id", str(i), "--coordinator", coordinator]

    print(
        f"launching {processes} processes of {local_devices} CPU devices each (gloo collectives; "
        f"process 0's output below)",
        flush=True,
    )
    try:
        launch(command, processes, local_devices, show_first=True)
    except ProcessesError as e:
        print(e, file=sys.stderr)
        return 1
    return 0
