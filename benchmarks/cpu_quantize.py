"""CPU kernels against the jitted pure-JAX reference, in one process.

The headline case is the issue's: quantize a bf16 4096x4096 tensor with 1x16
blocks into the rowwise and columnwise copies (amax pass included). Also
rowwise only, 16x16 blocks, dequantize, and the training recipe's options on
the headline case: the Random Hadamard Transform of the columnwise copy (amax
from a fused pass, or estimated), stochastic rounding, both, 4over6 (MSE, MSE
with fast math, MAE), per-token (row-scaled) global scales, alone and with
4over6; for those, the time as a multiple of the plain headline case too. The
baseline is a memcpy of the input's bytes (numpy ``copyto`` into a preallocated
array, one thread), timed in turns with the headline case; the headline's
"x memcpy" is their ratio of medians. Prints a markdown table of median times
and the reference / kernel ratio; ``--out FILE`` also writes it there.

    python -m benchmarks.cpu_quantize [--size 4096] [--repeats 7] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from benchmarks.timing import Report, device_name, median_seconds
from jax_nvfp4 import reference


def interleaved_medians(fns, repeats: int) -> list[float]:
    """Median wall time of each function, the calls taken in turns (one warm-up call each)."""
    for fn in fns:
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    t = jax_nvfp4.quantize(x, columnwise=True)
    key = jax.random.key(1)
    cases = {
        "quantize 1x16, rowwise+columnwise": (lambda m, x: m.quantize(x, columnwise=True), x),
        "... + RHT": (lambda m, x: m.quantize(x, columnwise=True, rht=True), x),
        "... + RHT, amax estimated": (lambda m, x: m.quantize(x, columnwise=True, rht=True, rht_amax_factor=2.0), x),
        "... + stochastic rounding": (lambda m, x: m.quantize(x, columnwise=True, rng_key=key), x),
        "... + RHT + stochastic rounding": (
            lambda m, x: m.quantize(x, columnwise=True, rht=True, rng_key=key),
            x,
        ),
        "... + 4over6 MSE": (lambda m, x: m.quantize(x, columnwise=True, four_over_six_error="mse", e4m3_max=256), x),
        "... + 4over6 MSE, fast math": (
            lambda m, x: m.quantize(x, columnwise=True, four_over_six_error="mse", four_over_six_fast_math=True),
            x,
        ),
        "... + 4over6 MAE": (lambda m, x: m.quantize(x, columnwise=True, four_over_six_error="mae"), x),
        "... row-scaled (per-token)": (lambda m, x: m.quantize(x, columnwise=True, row_scaled=True), x),
        "... row-scaled + 4over6 MSE": (
            lambda m, x: m.quantize(x, columnwise=True, row_scaled=True, four_over_six_error="mse"),
            x,
        ),
        "quantize 1x16, rowwise": (lambda m, x: m.quantize(x), x),
        "quantize 16x16, rowwise+columnwise": (lambda m, x: m.quantize(x, columnwise=True, block_2d=True), x),
        "dequantize to bf16": (lambda m, t: m.dequantize(t, jnp.bfloat16), t),
    }
    report = Report(
        args.out,
        [
            f"# CPU benchmark: {device_name()}",
            "",
            f"{datetime.date.today()}, {os.cpu_count()} cores, jax {jax.__version__}, "
            f"bf16 {args.size}x{args.size}, median of {args.repeats}; `python -m benchmarks.cpu_quantize`.",
            "Both run in the same process; the reference is the jitted pure-JAX spec.",
            "",
            "| case | C++ kernel (ms) | vs the first case | x memcpy | JAX reference (ms) | speed-up |",
            "|---|---:|---:|---:|---:|---:|",
        ],
    )
    host = np.asarray(x)
    copy = np.empty_like(host)
    headline = jax.jit(lambda a: jax_nvfp4.quantize(a, columnwise=True))
    t_copy, t_headline = interleaved_medians(
        [lambda: np.copyto(copy, host), lambda: headline(x)], repeats=max(args.repeats, 15)
    )
    report.add(
        f"| memcpy of the input ({host.nbytes >> 20} MiB, numpy copyto) | {t_copy * 1e3:.1f} | - | 1.00x | - | - |"
    )
    first = None
    for name, (op, arg) in cases.items():
        kernel = jax.jit(lambda a, op=op: op(jax_nvfp4, a))
        ref = jax.jit(lambda a, op=op: op(reference, a))
        same = jax.tree.map(lambda a, b: bool((a == b).all()), kernel(arg), ref(arg))
        assert all(jax.tree.leaves(same)), f"{name}: kernel and reference disagree"
        t_kernel = median_seconds(kernel, arg, repeats=args.repeats)
        t_ref = median_seconds(ref, arg, repeats=args.repeats)
        first = first or t_kernel
        versus = f"{t_kernel / first:.2f}x" if name.startswith("...") else "-"
        memcpy = f"{t_headline / t_copy:.2f}x" if first is t_kernel else "-"
        line = f"| {name} | {t_kernel * 1e3:.1f} | {versus} | {memcpy} | {t_ref * 1e3:.1f} | {t_ref / t_kernel:.1f}x |"
        report.add(line)
    report.save()


if __name__ == "__main__":
    main()
