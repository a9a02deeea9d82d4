"""Holds the CUDA kernels' register spills to their allowances, from a build log.

CMakeLists.txt builds the CUDA module with ptxas's --warn-on-spills: every kernel that spills
registers to local memory is a warning line in the build's output, once per architecture that
spills it. `.ci/run` keeps the wheel build's output and runs this on it. It fails when

- a kernel spills that ALLOWED does not list, or more bytes than ALLOWED gives it;
- a kernel ALLOWED lists no longer spills at all (take it out: the list is a record);
- the log shows no CUDA module built (a check that saw no kernels would pass vacuously).

ALLOWED is what nvcc 13.0.88 gives today (2026-12-01), each kernel's largest spill over sm_90,
sm_100a and sm_120a (stores + loads). Why each is left: docs/kernels.md, "Registers and spills".

    python .ci/spills.py BUILD_LOG
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# Kernel (short name: spilled_kernels) -> the most bytes (stores + loads) one architecture's build
# of it may spill.
ALLOWED = {
    # At 255 registers on sm_100a and sm_120a (the E2M1 convert path; 168 on sm_90). Until 2026-12-01
    # bf16's spilled 160 (direct) and 192 (ring) on sm_120a, and f32's 48.
    "quantize_kernel<bf16, nearest>": 8,  # sm_120a
    "quantize_ring_kernel<bf16, nearest>": 24,  # sm_120a
    "quantize_ring_kernel<f16, nearest>": 8,  # sm_120a
    "quantize_kernel<f32, nearest>": 32,  # sm_100a, sm_120a
    # 4over6 on the ring (since 2026-12-01): 255 registers, a word over (its direct kernel spills none).
    "quantize_ring_kernel<bf16, 4over6>": 8,  # sm_100a, sm_120a
    "quantize_ring_kernel<f16, 4over6>": 8,  # sm_100a, sm_120a
    # ptxas's own choice of 128 registers (4 blocks a multiprocessor) or 80 over a few bytes.
    "quantize_kernel<f16, stochastic>": 8,  # sm_90 (232 registers, 2 blocks, before 2026-11-30; 28 to 2026-12-01)
    "quantize_kernel<bf16, stochastic>": 8,  # sm_90 (208 registers before)
    "grouped_ring_kernel<f16, stochastic>": 16,  # sm_90, sm_100a
    "grouped_ring_kernel<bf16, stochastic>": 16,  # sm_90
    "grouped_ring_kernel<f32, stochastic>": 16,  # sm_90
    "grouped_tiles_kernel<f16, nearest>": 8,  # sm_100a
    "grouped_tiles_kernel<f32, nearest>": 16,  # sm_100a
}

# The CUDA sources whose objects a log of the module's build names.
SOURCES = ("amax.cu", "quantize.cu", "dequantize.cu", "grouped.cu")

WARNING = re.compile(
    r"Registers are spilled to local memory in function '(\w+)', "
    r"(\d+) bytes spill stores, (\d+) bytes spill loads"
)
DTYPES = {"LoadBF16": "bf16", "LoadF16": "f16", "LoadF32": "f32"}
MODES = {"0": "nearest", "1": "stochastic", "2": "4over6"}


def short_name(demangled: str) -> str:
    """`void nvfp4::cuda::(anon)::quantize_kernel<nvfp4::LoadBF16, (...::Mode)0>(...)` ->
    `quantize_kernel<bf16, nearest>`."""
    name = re.sub(r"[\w:]*\(anonymous namespace\)::", "", demangled.removeprefix("void "))
    name = name.split(">(", 1)[0] + ">" if ">(" in name else name.split("(", 1)[0]
    name = re.sub(r"nvfp4::(cuda::)?", "", name)
    name = re.sub(r"\(Mode\)(\d)", lambda m: MODES[m.group(1)], name)
    for load, dtype in DTYPES.items():
        name = name.replace(load, dtype)
    return name


def spilled_kernels(log: str) -> list[tuple[str, int]]:
    """Every spill warning of the log: (short kernel name, bytes stored + loaded)."""
    found = WARNING.findall(log)
    if not found:
        return []
    demangled = subprocess.run(
        ["c++filt"], input="\n".join(f[0] for f in found), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [(short_name(d), int(s) + int(ld)) for d, (_, s, ld) in zip(demangled, found, strict=True)]


def allowance_problems(spills: list[tuple[str, int]], allowed: dict[str, int] = ALLOWED) -> list[str]:
    """What spills (spilled_kernels) break of the allowances (empty: they hold them)."""
    out = []
    for name, spilled in spills:
        if name not in allowed:
            out.append(f"{name} spills {spilled} bytes; it is not allowed to spill")
        elif spilled > allowed[name]:
            out.append(f"{name} spills {spilled} bytes, over its allowance of {allowed[name]}")
    seen = {name for name, _ in spills}
    out += [f"{name} no longer spills: take it out of ALLOWED" for name in allowed if name not in seen]
    return out


def problems(log: str) -> list[str]:
    """What the build log breaks: the CUDA sources not built, or the allowances."""
    missing = [s for s in SOURCES if not re.search(rf"Building CUDA object \S*{re.escape(s)}\.o", log)]
    if missing:
        return [f"no CUDA build of {', '.join(missing)} in the log: nothing was checked"]
    return allowance_problems(spilled_kernels(log))


def main(path: str) -> int:
    log = Path(path).read_text(errors="replace")
    for name, spilled in spilled_kernels(log):
        print(f"spill: {name}: {spilled} bytes (allowed {ALLOWED.get(name, 0)})")
    found = problems(log)
    for p in found:
        print(f"spills: {p}", file=sys.stderr)
    print("spills: " + ("FAILED" if found else "every kernel within its allowance"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
