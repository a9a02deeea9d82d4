"""What the fused GEMM's main loop costs on Hopper, counted without a GPU.

Compiles ``impl="fused"``'s Pallas kernel (``jax_nvfp4.ops.fused_gemm``) for an H100 offline
(``benchmarks.offline_gpu``: XLA and Triton as a GPU run would, without autotuning), assembles XLA's PTX with
ptxas for sm_90a and reads the SASS of the kernel's loop over the contraction: its instructions, its
warpgroup MMAs (HGMMA) and, from ptxas, registers and spills. One loop step decodes a (tile_m + tile_n) x
(2 k_bytes) slab of values and multiplies a tile_m x tile_n x 2 k_bytes block. A Hopper SM issues four warp
instructions a clock and its tensor cores do about 4096 dense float16 (or bf16) FLOPs a clock (989 TFLOPS,
132 SMs, 1.83 GHz), so the step needs at least max(issue, tensor) clocks; tensor / that is the most of the
tensor peak the kernel can reach (memory aside: it reads 4.5 bits a value). A static count: nothing runs,
and latency, shared-memory traffic and the waits between a step's MMAs are not in it.

    pip install jax-cuda13-plugin==<jax> jax-cuda13-pjrt==<jax> nvidia-cuda-nvcc nvidia-cuda-cuobjdump
    python -m benchmarks.fused_gemm_sass [--out benchmarks/results/fused-gemm-sass-h100.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ISSUE_PER_CLOCK = 4  # warp instructions an SM issues a clock (four schedulers)
TENSOR_FLOPS_PER_CLOCK = 4096  # dense bf16 FLOPs an H100 SM's tensor cores do a clock
SHAPE = (8192, 4096, 4096)  # M, K, N of the compiled GEMM: the loop's code does not depend on it


KERNELS = {
    "as stored": "the dense GEMM (fprop, wgrad)",
    "transposed": "the dense GEMM reading c transposed (dgrad of a 16x16-block weight)",
    "grouped": "the grouped token GEMM (MoE fprop)",
    "grouped, transposed": "the grouped token GEMM reading each expert transposed (MoE dgrad)",
    "segment": "the grouped segment GEMM (MoE wgrad)",
}
"""The kernels counted: their loops are the same decode and dots, around other indexing."""
GROUPS = 8  # the MoE kernels': experts, M / G tokens each (their loops do not depend on it either)


def _compile(tiles: dict, dump: str, kernel: str = "as stored") -> None:
    """In a fresh process (XLA reads its flags once): compile one of ``KERNELS`` for the offline H100, dumping PTX."""
    import jax
    import jax.numpy as jnp

    from benchmarks.offline_gpu import compile_for
    from jax_nvfp4.ops import fused_gemm, fused_ragged_gemm

    m, k, n = SHAPE
    t = fused_gemm.Tiles(**tiles)
    u8, f32, i32 = jnp.uint8, jnp.float32, jnp.int32
    transposed = kernel.endswith("transposed")
    c_shapes = [(k, n // 2), (k, n // 16)] if transposed else [(n, k // 2), (n, k // 16)]
    if kernel in ("as stored", "transposed"):
        shapes = [((1, *s), u8) for s in [(m, k // 2), (m, k // 16), *c_shapes]] + [((1,), f32)]

        def f(a, sa, c, sc, scale):
            rows = {"rows_a": m, "rows_c": n, "length": k, "out_dtype": jnp.bfloat16, "c_transposed": transposed}
            return fused_gemm.fused_gemm(a, sa, c, sc, scale, **rows, interpret=False, tiles=t)

    elif kernel.startswith("grouped"):
        shapes = [(s, u8) for s in [(m, k // 2), (m, k // 16)]] + [((GROUPS, *s), u8) for s in c_shapes]
        shapes += [((GROUPS,), i32), ((GROUPS,), f32), ((m,), f32)]

        def f(a, sa, c, sc, sizes, s1, s2):
            options = {"n": n, "length": k, "out_dtype": jnp.bfloat16, "transposed": transposed, "tiles": t}
            return fused_ragged_gemm.fused_ragged_gemm(a, sa, c, sc, sizes, s1, s2, **options, interpret=False)

    else:  # wgrad: x [M, K]'s and dy [M, N]'s grouped columnwise copies [K, Mp] and [N, Mp] -> [G, K, N]
        mp = m + 16 * (GROUPS - 1)
        shapes = [(s, u8) for s in [(k, mp // 2), (k, mp // 16), (n, mp // 2), (n, mp // 16)]]
        shapes += [((GROUPS,), i32), ((GROUPS,), f32), ((GROUPS, k), f32), ((GROUPS, n), f32)]

        def f(a, sa, c, sc, segments, s1, ra, rc):
            options = {"out_dtype": jnp.bfloat16, "tiles": t, "interpret": False}
            return fused_ragged_gemm.fused_segment_gemm(a, sa, c, sc, segments, s1, ra, rc, **options)

    with compile_for("h100") as on_h100:
        jax.jit(f).trace(*[on_h100(shape, dtype) for shape, dtype in shapes]).lower().compile()


def _loop(sass: str) -> list[str]:
    """The instructions of the outermost backward branch's body: the loop over the contraction."""
    code = [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for address, instruction in code:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", instruction)
        if target and int(target.group(1), 16) < address:
            span = (int(target.group(1), 16), address)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise RuntimeError("no loop found in the kernel's SASS")
    return [i for a, i in code if best[0] <= a <= best[1] and not i.startswith("NOP")]


@dataclasses.dataclass
class Count:
    tiles: dict
    kernel: str
    registers: int
    spills: int
    instructions: int
    hgmma: int

    @property
    def values_per_thread(self) -> float:
        t = self.tiles
        return (t["m"] + t["n"]) * 2 * t["k_bytes"] / (32 * t["num_warps"])

    @property
    def issue_clocks(self) -> float:
        return self.instructions * self.tiles["num_warps"] / ISSUE_PER_CLOCK

    @property
    def tensor_clocks(self) -> float:
        t = self.tiles
        return 2 * t["m"] * t["n"] * 2 * t["k_bytes"] / TENSOR_FLOPS_PER_CLOCK


def count(tiles: dict, kernel: str = "as stored") -> Count:
    from benchmarks.sass_budget import tool

    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_emitter_re=.*")
        code = f"from benchmarks.fused_gemm_sass import _compile; _compile({tiles!r}, {dump!r}, {kernel!r})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        # The Pallas kernel's PTX: the one whose SASS runs MMAs (the grouped kernels' programs hold XLA's too).
        for ptx in sorted(Path(dump).glob("*.ptx")):
            cubin = Path(dump) / "kernel.cubin"
            report = subprocess.run(
                [tool("ptxas"), "-arch=sm_90a", "-O3", "-v", str(ptx), "-o", str(cubin)],
                capture_output=True, text=True, check=True,
            ).stderr  # fmt: skip
            sass = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True)
            if "HGMMA" in sass.stdout:
                break
        else:
            raise RuntimeError(f"no kernel with MMAs among {kernel}'s PTX")
    loop = _loop(sass.stdout)
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return Count(
        tiles,
        kernel,
        int(re.search(r"Used (\d+) registers", report).group(1)),
        spills,
        len(loop),
        sum(i.split()[0].startswith("HGMMA") for i in loop),
    )


VARIANTS = (  # k_bytes >= 64: each of a step's eight float16 dots contracts at least 16 values
    {"m": 128, "n": 128, "k_bytes": 64, "num_warps": 4},
    {"m": 128, "n": 256, "k_bytes": 64, "num_warps": 8},
    {"m": 256, "n": 128, "k_bytes": 64, "num_warps": 8},
    {"m": 128, "n": 256, "k_bytes": 128, "num_warps": 8},
    {"m": 128, "n": 128, "k_bytes": 128, "num_warps": 4},
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--json", help="also write the counts as JSON")
    args = parser.parse_args()
    import jax

    import jax_nvfp4.ops.fused_gemm as fused_gemm

    counts = [count(v) for v in VARIANTS] + [count(v, "transposed") for v in VARIANTS[:3]]
    counts += [count(dataclasses.asdict(fused_gemm.TILES), kernel) for kernel in list(KERNELS)[2:]]
    lines = [
        "# The fused GEMM's main loop on Hopper, counted offline",
        "",
        f"{datetime.date.today()}, jax {jax.__version__}; `python -m benchmarks.fused_gemm_sass`: the kernel compiled "
        "for an H100 (sm_90a) without a GPU (XLA's Triton pipeline, no autotuning), its loop over the contraction "
        f"read from the SASS. The GPU's default tiles: {dataclasses.asdict(fused_gemm.TILES)}. Bound = tensor clocks / "
        "max(issue, tensor clocks) a step: the most of the 16-bit tensor peak the loop can reach (latency, shared "
        "memory and the waits between MMAs not counted).",
        "",
        "Kernels: " + "; ".join(f"{name}: {what}" for name, what in KERNELS.items()) + ". c read transposed: "
        "a weight's kept 16x16-block copy (packed along the output's columns) read as its transpose. The grouped "
        f"kernels at the GPU's tiles, {GROUPS} experts. The segment kernel has two loops: its whole steps, and a "
        "segment's last part step (masked loads; at most once): the larger is counted.",
        "",
        "| tiles (m x n x values a step, warps) | kernel | registers | spills (B) | loop instructions | HGMMA | "
        "values decoded a thread | instructions a value | issue clocks | tensor clocks | bound |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in counts:
        t = c.tiles
        lines.append(
            f"| {t['m']} x {t['n']} x {2 * t['k_bytes']}, {t['num_warps']} | "
            f"{c.kernel} | {c.registers} | {c.spills} | "
            f"{c.instructions} | {c.hgmma} | {c.values_per_thread:.0f} | {c.instructions / c.values_per_thread:.1f} | "
            f"{c.issue_clocks:.0f} | {c.tensor_clocks:.0f} | "
            f"{c.tensor_clocks / max(c.issue_clocks, c.tensor_clocks):.0%} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(c) for c in counts], indent=1) + "\n")


if __name__ == "__main__":
    main()
