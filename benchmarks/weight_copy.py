"""A 16x16-block weight's one quantized copy: the time of making the other by transposing its bytes.

Issue 51 quantizes W rowwise alone in the forward pass and transposes the bytes for dgrad, where the
quantize made both copies. This times, in one process on the same W (bf16, 16x16 blocks), the quantize
of one copy and of both, and the transpose of the packed codes and scales, each as queued calls, with a
copy of the same packed bytes as the memory-speed baseline.

    python -m benchmarks.weight_copy [--shapes 4096x4096,8192x8192] [--out results.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime

import jax
import jax.numpy as jnp

from benchmarks.timing import Report, device_name, queued_seconds
from jax_nvfp4.core.pipeline import quantize_batch
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.core.transpose import with_columnwise_copy
from jax_nvfp4.ops import KERNELS


def times(n: int, k: int, calls: int) -> dict[str, float]:
    """Seconds a call of each step takes on W^T [1, N, K]."""
    w = jax.random.normal(jax.random.key(0), (1, n, k), jnp.float32).astype(jnp.bfloat16)
    one = QuantizeSpec(rowwise=True, columnwise=False, block_2d=True)
    both = dataclasses.replace(one, columnwise=True)
    rows = jax.jit(lambda w: quantize_batch(KERNELS, w, one))(w)
    transpose = jax.jit(
        lambda data, scale, amax: with_columnwise_copy(dataclasses.replace(rows, data=data, scale=scale, amax=amax))
    )
    steps = {
        "quantize, rowwise copy alone": (jax.jit(lambda w: quantize_batch(KERNELS, w, one)), (w,)),
        "quantize, both copies": (jax.jit(lambda w: quantize_batch(KERNELS, w, both)), (w,)),
        "transpose the rowwise bytes": (transpose, (rows.data, rows.scale, rows.amax)),
        "copy of those bytes (baseline)": (jax.jit(lambda d, s: (d ^ jnp.uint8(1), s)), (rows.data, rows.scale)),
    }
    return {name: queued_seconds(fn, *args, calls=calls) for name, (fn, args) in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,8192x8192", help="N x K of W^T, comma-separated")
    parser.add_argument("--calls", type=int, default=10, help="queued calls per timing")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    report = Report(
        args.out,
        [
            f"# A 16x16-block weight's one copy: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, "
            f"`python -m benchmarks.weight_copy --shapes {args.shapes}`; bf16 W^T [N, K], {args.calls} queued "
            "calls a timing, the best of 3.",
            "The forward pass made both copies; it now makes the rowwise one and the backward pass transposes it.",
            "",
            "| N x K | step | ms | x the byte copy |",
            "|---|---|---:|---:|",
        ],
    )
    for shape in args.shapes.split(","):
        n, k = (int(d) for d in shape.split("x"))
        t = times(n, k, args.calls)
        base = t["copy of those bytes (baseline)"]
        for name, seconds in t.items():
            report.add(f"| {n} x {k} | {name} | {1e3 * seconds:.3f} | {seconds / base:.2f} |")
        new = t["quantize, rowwise copy alone"] + t["transpose the rowwise bytes"]
        report.add(
            f"| {n} x {k} | **one copy + transpose, against both copies** | {1e3 * new:.3f} | "
            f"{new / t['quantize, both copies']:.2f} of both |"
        )
    report.save()


if __name__ == "__main__":
    main()
