"""Profiler counters of the CUDA quantize and dequantize kernels without a GPU: the CUDA host model runs the
kernels on the CPU and counts what a profiler would (ffi/cuda/host/trace.h, tests/helpers/counters.py): bytes read and
written against the minimum, 32-byte sectors of global accesses against the fewest their bytes fill,
shared-memory wavefronts against the fewest (bank conflicts), and the code index each copy takes.

One bf16 N(0, 1) tensor of whole 64 x 256 tiles per spec, on the sm_90 and sm_100a code paths and the
pipelined kernel (NVFP4_QUANTIZE_LOAD=ring: a tensor copy a tile; ring-rows: a bulk copy a row); the same tensor
as float32 for a few specs (its values in shared memory: copied there by the direct kernel, read from the stage by
the ring); then the dequantize of its rowwise copy to
each output dtype, and the grouped quantize of its rows in two groups (both loads). Needs the host model's module
(`NVFP4_CUDA_HOST=ON pip install .`); the tests hold these figures to budgets
(tests/cuda/test_cuda_host_counters.py).

    python -m benchmarks.host_counters [--shape 256,1024] [--out benchmarks/results/host-counters.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from benchmarks.timing import Report
from jax_nvfp4.core.spec import QuantizeSpec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the host model's test helpers: its backend and the counters

from helpers import random_normal  # noqa: E402
from helpers.counters import (  # noqa: E402
    Launch,
    dequantize_launches,
    grouped_quantize_launches,
    quantize_launches,
    quantized_bytes,
)

SPECS = {
    "row+col 1x16": dict(columnwise=True),
    "row only": dict(),
    "row+col 16x16": dict(columnwise=True, block_2d=True),
    "stochastic rounding": dict(columnwise=True, rng_key=jax.random.key(1)),
    "RHT columnwise": dict(columnwise=True, rht=True),
    "per-token scales": dict(columnwise=True, row_scaled=True),
    "4over6 MSE fast": dict(columnwise=True, four_over_six_error="mse", four_over_six_fast_math=True, e4m3_max=256),
}
FLOAT32_SPECS = ("row+col 1x16", "row+col 16x16", "stochastic rounding")
VARIANTS = (("sm_90", 90, "direct"), ("sm_100a", 100, "direct"), ("sm_90", 90, "ring"), ("sm_90", 90, "ring-rows"))


def quantize_launch(x, sm: int, load: str, options) -> Launch | None:
    """The quantize kernel's traced launch, or None where the variant does not apply to the spec."""
    os.environ["NVFP4_QUANTIZE_LOAD"] = load
    _, launches = quantize_launches(x, sm, **options)
    (launch,) = [t for t in launches if "quantize" in t.kernel]
    if load.startswith("ring") and "ring" not in launch.kernel:
        return None
    return launch


def ratio(sites) -> str:
    total = Launch.total(sites)
    return f"{total.transactions / total.ideal:.2f}" if total.ideal else "-"


def row(name: str, variant: str, launch: Launch, x, options) -> str:
    loads = launch.select("global", "load")
    inputs = [s for s in loads if s.size >= 8]  # the input's (amaxes and seeds are 4-byte loads)
    stores = launch.select("global", "store")
    data_stores = [s for s in stores if s.size == 16 and s.bytes >= Launch.total(stores).bytes / 8]
    lookups = launch.select("shared", "load", file="e2m1_lut.cuh")
    staging = launch.select("shared", file="quantize.cu")
    per_lookup = f"{Launch.total(lookups).per_request:.2f}" if lookups else "-"
    index = "; ".join(
        f"{p.split(' index: ')[0]} {p.split(': ', 1)[1]}"
        for p in sorted(launch.paths)
        if p.startswith(("rowwise index", "columnwise index")) and not p.endswith("none")
    )
    return (
        f"| {name} | {variant} | {Launch.total(inputs).bytes / x.nbytes:.2f} | {ratio(inputs)} "
        f"| {Launch.total(stores).bytes / quantized_bytes(x, **options):.2f} | {ratio(data_stores)} | {ratio(stores)} "
        f"| {per_lookup} | {ratio(staging)} | {index} |"
    )


def dequantize_rows(report: Report, x) -> None:
    """The dequantize kernel's counters: its rowwise copy of x to each output dtype."""
    report.add("")
    report.add(
        "Dequantize of the rowwise copy (whole 16-value blocks). Read: code bytes over the codes (each once); "
        "written: over the output; sectors over the fewest."
    )
    report.add("")
    report.add("| output | read / codes | code-load sectors | scale-load sectors | written / output | store sectors |")
    report.add("|---|---:|---:|---:|---:|---:|")
    t = jax_nvfp4.quantize(x)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        out, launches = dequantize_launches(t, dtype)
        (launch,) = [k for k in launches if "dequantize" in k.kernel]
        loads = launch.select("global", "load")
        codes = [s for s in loads if s.size > 1]
        scales = [s for s in loads if s.size == 1]
        stores = launch.select("global", "store")
        report.add(
            f"| {jnp.dtype(dtype).name} | {Launch.total(codes).bytes / t.data.nbytes:.2f} | {ratio(codes)} "
            f"| {ratio(scales)} | {Launch.total(stores).bytes / out.nbytes:.2f} | {ratio(stores)} |"
        )


def grouped_rows(report: Report, x) -> None:
    """The grouped quantize's counters: x's rows as one entry in two groups, both copies."""
    report.add("")
    report.add(
        "Grouped quantize (a mixture of experts' token rows, two groups), both copies from one read of the input: "
        "grouped_tiles_kernel writes the grouped (columnwise) copy and the groups' rows' rowwise copy (the rows in no "
        "group are grouped_rows_kernel's, which reads nothing; here every row is in a group), its values by element "
        "loads; grouped_ring_kernel (NVFP4_QUANTIZE_LOAD=ring) the same from bulk copies into a ring of stages. "
        "Sectors and wavefronts over the fewest."
    )
    report.add("")
    report.add(
        "| kernel | read / input | load sectors | rowwise code stores | rowwise scale stores | grouped code stores "
        "| grouped scale stores | shared wavefronts |"
    )
    report.add("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows, cols = x.shape
    sizes = np.array([[rows // 3, rows - rows // 3]], np.int32)
    blocks = cols * (-(-rows // 16) + sizes.shape[1] - 1)  # the grouped copy's 1x16 blocks
    for kernel, load in (("grouped_tiles_kernel", "direct"), ("grouped_ring_kernel", "ring")):
        os.environ["NVFP4_QUANTIZE_LOAD"] = load
        try:
            _, launches = grouped_quantize_launches(x[None], sizes, QuantizeSpec(columnwise=True))
        finally:
            os.environ.pop("NVFP4_QUANTIZE_LOAD", None)
        (launch,) = [k for k in launches if kernel in k.kernel]
        loads = launch.select("global", "load")
        stores = launch.select("global", "store")
        # The copies' stores told apart by their bytes: the grouped copy's are its blocks' (8 code bytes, a scale).
        grouped_codes = [s for s in stores if s.size == 8 and s.bytes == 8 * blocks]
        grouped_scales = [s for s in stores if s.size == 1 and s.bytes == blocks]
        row_codes = [s for s in stores if s.size == 8 and s not in grouped_codes]
        row_scales = [s for s in stores if s.size == 1 and s not in grouped_scales]
        report.add(
            f"| {kernel} | {Launch.total(loads).bytes / x.nbytes:.2f} | {ratio(loads)} | {ratio(row_codes)} "
            f"| {ratio(row_scales)} | {ratio(grouped_codes)} | {ratio(grouped_scales)} "
            f"| {ratio(launch.select('shared'))} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="256,1024")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    shape = tuple(map(int, args.shape.split(",")))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    report = Report(
        args.out,
        [
            "# Quantize, dequantize and grouped quantize kernel counters from the CUDA host model (no GPU)",
            "",
            f"{datetime.date.today()}, commit {commit.stdout.strip() or '?'}, jax {jax.__version__}; "
            f"`python -m benchmarks.host_counters --shape {args.shape}`: bf16 N(0, 1) {shape[0]}x{shape[1]} "
            "(the float32 rows: the same values as float32), "
            "amaxes computed (their kernels not counted). "
            "Read/written: global bytes over the input / the outputs (1.00: each byte once). "
            "Sectors and wavefronts: over the fewest the same bytes need (1.00: coalesced, conflict-free). "
            "Table lookups: wavefronts per warp-wide lookup of the E2M1 code tables (1 is conflict-free).",
            "",
            "| spec | kernel | read / input | load sectors | written / outputs | code-store sectors | all store "
            "sectors | table lookup wavefronts | staging wavefronts | code index (e2m1_lut.cuh) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ],
    )
    x = random_normal(shape, 0)
    runs = [(name, x, options) for name, options in SPECS.items()]
    runs += [(f"{name}, float32", x.astype(jnp.float32), SPECS[name]) for name in FLOAT32_SPECS]
    try:
        for name, tensor, options in runs:
            for arch, sm, load in VARIANTS:
                launch = quantize_launch(tensor, sm, load, options)
                if launch is not None:
                    report.add(row(name, f"{arch} {load}", launch, tensor, options))
    finally:
        os.environ.pop("NVFP4_QUANTIZE_LOAD", None)
    dequantize_rows(report, x)
    grouped_rows(report, x)
    report.save()


if __name__ == "__main__":
    main()
