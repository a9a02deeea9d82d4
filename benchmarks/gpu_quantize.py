"""GPU quantize bandwidth against the device-to-device copy, in one process.

bf16 inputs from 1024^2 to 16384^2; rowwise-only and rowwise+columnwise, 1x16
and 16x16 blocks. The floor is the input read once plus every output written
once (rowwise+columnwise 1x16 from bf16: 3.125 bytes a value). Reports, as % of
the copy bandwidth measured in the same run: (a) the quantize kernel alone
(amax given) and (b) the whole `quantize` with its amax pass (which reads the
input a second time); and the speed-up of (b) over the jitted pure-JAX reference.
Another table measures the design's answer to that extra read: when the tensor
comes out of another op (here y = 2x), an amax computed in JAX (max |y|) can be
fused by XLA into that op, so only the quantize kernel reads y again.
The last table times the recipe's options on the rowwise+columnwise 1x16
quantize (amax passes included), each as a multiple of the plain one: the
Random Hadamard Transform on the columnwise copy (its amax from a fused RHT
pass, or estimated from the plain amax: one pass fewer), stochastic rounding of
both copies, and both. Targets: RHT at most 1.25x, stochastic rounding 1.2x.
The 4over6 table does the same for 4over6 adaptive block scaling (MSE and MAE,
exact and fast-math errors; 1x16 and 16x16 blocks, each against the plain
quantize with the same blocks) and per-token (row-scaled) global scales, and
times the fast-math quantize kernel alone (amax given) against the plain
kernel too. Target: fast math at most 1.5x plain.

    python -m benchmarks.gpu_quantize [--sizes 1024,4096,8192,16384] [--repeats 20] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools

import jax
import jax.numpy as jnp

import jax_nvfp4
from benchmarks.timing import Report, device_name, median_seconds
from jax_nvfp4 import reference
from jax_nvfp4.core.formats import num_blocks, packed_size


def output_bytes(m: int, n: int, rowwise: bool, columnwise: bool) -> int:
    rows = m * (packed_size(n) + num_blocks(n)) if rowwise else 0
    cols = n * (packed_size(m) + num_blocks(m)) if columnwise else 0
    return rows + cols


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--reference-max", type=int, default=8192, help="largest size timed for the reference")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    report = Report(
        args.out,
        [
            f"# GPU quantize benchmark: {device_name()}",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, bf16 inputs, median of {args.repeats}; "
            "`python -m benchmarks.gpu_quantize`. Bandwidth = (input + outputs) bytes / time;",
            "copy = a jitted negation (reads and writes each element once) in the same process.",
            "",
            "| size | copies | blocks | copy GB/s | (a) kernel, amax given | (b) with amax pass | (b) vs reference |",
            "|---|---|---|---:|---:|---:|---:|",
        ],
    )
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        copy_s = median_seconds(jax.jit(lambda x: -x), x, repeats=args.repeats)
        copy_bw = 2 * x.nbytes / copy_s
        amax = jax_nvfp4.amax(x)
        for rowwise, columnwise in ((True, False), (True, True)):
            for block_2d in (False, True):
                opts = {"rowwise": rowwise, "columnwise": columnwise, "block_2d": block_2d}
                moved = x.nbytes + output_bytes(size, size, rowwise, columnwise)
                kernel_s = median_seconds(
                    jax.jit(lambda x, a, o=opts: jax_nvfp4.quantize(x, amax=a, **o)), x, amax, repeats=args.repeats
                )
                whole_s = median_seconds(jax.jit(lambda x, o=opts: jax_nvfp4.quantize(x, **o)), x, repeats=args.repeats)
                versus = "-"
                if size <= args.reference_max:
                    ref_s = median_seconds(jax.jit(lambda x, o=opts: reference.quantize(x, **o)), x, repeats=3)
                    versus = f"{ref_s / whole_s:.1f}x"
                kind = "row+col" if columnwise else "row"
                report.add(
                    f"| {size}x{size} | {kind} | {'16x16' if block_2d else '1x16'} | {copy_bw / 1e9:.0f} "
                    f"| {100 * moved / kernel_s / copy_bw:.0f}% | {100 * moved / whole_s / copy_bw:.0f}% | {versus} |"
                )
    report.add("")
    report.add("| size | producer + quantize (own amax pass) ms | producer + JAX amax (fusable) + kernel ms | saved |")
    report.add("|---|---:|---:|---:|")
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)

        def own_pass(x):
            return jax_nvfp4.quantize(x * 2, columnwise=True)

        def fused(x):
            y = x * 2
            return jax_nvfp4.quantize(y, amax=jnp.max(jnp.abs(y)).astype(jnp.float32), columnwise=True)

        own_s = median_seconds(jax.jit(own_pass), x, repeats=args.repeats)
        fused_s = median_seconds(jax.jit(fused), x, repeats=args.repeats)
        report.add(f"| {size}x{size} | {own_s * 1e3:.3f} | {fused_s * 1e3:.3f} | {100 * (1 - fused_s / own_s):.0f}% |")
    report.add("")
    report.add("| size | plain ms | RHT (fused amax) | RHT (amax estimate) | stochastic rounding | RHT + SR |")
    report.add("|---|---:|---:|---:|---:|---:|")
    q = functools.partial(jax_nvfp4.quantize, columnwise=True)
    variants = (  # (x, key) -> quantized; the key is an argument, not a constant folded into the program
        lambda x, k: q(x, rht=True),
        lambda x, k: q(x, rht=True, rht_amax_factor=2.0),
        lambda x, k: q(x, rng_key=k),
        lambda x, k: q(x, rht=True, rng_key=k),
    )
    key = jax.random.key(1)
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        plain_s = median_seconds(jax.jit(q), x, repeats=args.repeats)
        ratios = [median_seconds(jax.jit(fn), x, key, repeats=args.repeats) / plain_s for fn in variants]
        report.add(f"| {size}x{size} | {plain_s * 1e3:.3f} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    four_over_six_table(report, args)
    report.save()


def four_over_six_table(report: Report, args: argparse.Namespace) -> None:
    """4over6 and per-token scales as multiples of the plain rowwise+columnwise quantize with the same blocks."""
    report.add("")
    report.add(
        "| size | blocks | plain ms | 4o6 MSE | 4o6 MSE fast | 4o6 MAE | 4o6 MAE fast | kernel alone: MSE fast "
        "| per-token | per-token + 4o6 MSE fast |"
    )
    report.add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        for block_2d in (False, True):
            q = functools.partial(jax_nvfp4.quantize, columnwise=True, block_2d=block_2d)
            variants = [
                functools.partial(q, four_over_six_error=mode, four_over_six_fast_math=fast, e4m3_max=256)
                for mode in ("mse", "mae")
                for fast in (False, True)
            ]
            plain_s = median_seconds(jax.jit(q), x, repeats=args.repeats)
            ratios = [median_seconds(jax.jit(fn), x, repeats=args.repeats) / plain_s for fn in variants]
            amax = jax_nvfp4.amax(x)
            kernel_plain, kernel_fast = (
                median_seconds(jax.jit(lambda x, a, f=f: f(x, amax=a)), x, amax, repeats=args.repeats)
                for f in (q, variants[1])
            )
            ratios.append(kernel_fast / kernel_plain)
            if block_2d:  # per-token scales have 1x16 blocks only
                ratios += [None, None]
            else:
                per_token = functools.partial(q, row_scaled=True)
                both = functools.partial(
                    per_token, four_over_six_error="mse", four_over_six_fast_math=True, e4m3_max=256
                )
                ratios += [median_seconds(jax.jit(fn), x, repeats=args.repeats) / plain_s for fn in (per_token, both)]
            cells = " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios)
            report.add(f"| {size}x{size} | {'16x16' if block_2d else '1x16'} | {plain_s * 1e3:.3f} | {cells} |")


if __name__ == "__main__":
    main()
