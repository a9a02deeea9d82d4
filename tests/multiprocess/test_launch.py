"""The example's launcher of local processes (``examples.lm.distributed``, behind ``--processes``): each process
gets its id, the coordinator and its share of the CPU devices; one that fails stops the others and shows its
output; a hang fails after the timeout. Plain Python children: a fraction of a second each."""

from __future__ import annotations

import sys
import time

import pytest

from examples.lm import distributed


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_process_gets_its_id_the_coordinator_and_its_devices():
    code = "import os, sys; print(sys.argv[1], sys.argv[2], os.environ['XLA_FLAGS'], os.environ['JAX_PLATFORMS'])"
    outputs = distributed.launch(lambda i, coordinator: [*_python(code), str(i), coordinator], 3, 4, timeout=60)
    lines = [out.split() for out in outputs]
    assert [line[0] for line in lines] == ["0", "1", "2"]
    assert len({line[1] for line in lines}) == 1 and lines[0][1].startswith("127.0.0.1:")
    # The device count replaces the one in XLA_FLAGS (tests/conftest.py asks for 8); other flags stay.
    for line in lines:
        assert line[2:].count("--xla_force_host_platform_device_count=4") == 1 and line[-1] == "cpu", line
        assert not any(flag.startswith("--xla_force_host_platform_device_count=8") for flag in line), line


def test_with_device_count_replaces_the_count():
    flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
    assert distributed.with_device_count(flags, 4) == (
        "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4"
    )
    assert distributed.with_device_count("", 2) == "--xla_force_host_platform_device_count=2"


def test_a_failing_process_stops_the_others_and_shows_its_output():
    # Process 1 fails at once; process 0 would wait for a minute (as one whose peer died waits in a collective).
    def command(i: int, coordinator: str) -> list[str]:
        if i == 1:
            return _python("import sys; print('process one says why'); sys.exit(3)")
        return _python("import time; print('waiting', flush=True); time.sleep(60)")

    start = time.monotonic()
    with pytest.raises(distributed.ProcessesError, match="process 1 exited with status 3") as failure:
        distributed.launch(command, 2, 1, timeout=120)
    assert time.monotonic() - start < 30
    assert "process one says why" in str(failure.value) and "waiting" in str(failure.value)


def test_processes_that_hang_fail_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(distributed.ProcessesError, match="ran past 2 s"):
        distributed.launch(lambda i, coordinator: _python("import time; time.sleep(60)"), 2, 1, timeout=2)
    assert time.monotonic() - start < 30
