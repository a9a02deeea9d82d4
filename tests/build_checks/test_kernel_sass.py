"""The CUDA module's sm_90 machine code, read from the installed binary with cuobjdump: every wait on an
mbarrier (the pipelined kernels' ``SYNCS.PHASECHK`` try-waits) is bounded. It reads the global timer and can
trap (ffi/cuda/async_copy.cuh, kWaitLimitNs), so that a phase that never completes (a lost copy, a wrong byte
count: faults the host model cannot rule out on hardware it has never run on) fails the launch instead of hanging
the process."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import subprocess

import pytest
from helpers import cuda_tool

from jax_nvfp4.ops import ffi


@functools.cache
def sm90_functions() -> dict[str, str]:
    """The sm_90 SASS of the installed CUDA module, by (mangled) function name."""
    tool, disassembler = cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
    if tool is None or disassembler is None:
        pytest.skip(
            "cuobjdump or nvdisasm not found (the test extra has nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)"
        )
    if "90" not in {a.partition("-")[0] for a in ffi.cuda_architectures()}:
        pytest.skip("the CUDA module has no sm_90 code")
    binary = importlib.util.find_spec("jax_nvfp4_kernels._nvfp4_cuda").origin
    # cuobjdump -sass runs nvdisasm, found on PATH or through NVDISASM_PATH (its folder).
    env = {**os.environ, "NVDISASM_PATH": str(pathlib.Path(disassembler).parent)}
    done = subprocess.run([tool, "-sass", "-arch", "sm_90", binary], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    sass = done.stdout
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.skipif(not ffi.cuda_module_built(), reason="built without the CUDA module")
def test_every_mbarrier_wait_is_bounded():
    waiting = {name: code for name, code in sm90_functions().items() if "SYNCS.PHASECHK" in code}
    # The pipelined quantize and grouped quantize kernels wait on their stages' mbarriers.
    assert any("quantize_ring_kernel" in name for name in waiting), sorted(sm90_functions())
    assert any("grouped_ring_kernel" in name for name in waiting), sorted(sm90_functions())
    unbounded = [name for name, code in waiting.items() if "SR_GLOBALTIMER" not in code or "BPT.TRAP" not in code]
    assert not unbounded, unbounded
