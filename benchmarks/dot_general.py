"""NVFP4 dot_general against the bf16 lax.dot_general, in one process.

A linear layer y = x W of a transformer (tokens x d_in . d_in x d_out), bf16
operands: the forward pass alone, and a training step (forward + dgrad + wgrad
via jax.grad). On CPUs and Hopper the NVFP4 GEMM is an exact emulation (the
blocks are dequantized to bf16 for a bf16 dot), so the ratio is the cost of
quantizing every operand, not a speed-up. Two bf16 baselines: the plain bf16
dot (what nn.Dense runs) and one with a float32 result. Prints a markdown table; ``--out FILE``
also writes it there.

    python -m benchmarks.dot_general [--tokens 4096] [--repeats 7] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import os

import jax
import jax.numpy as jnp
from jax import lax

import jax_nvfp4
from benchmarks.timing import Report, device_name, median_seconds

DENSE = (((1,), (0,)), ((), ()))


def bf16_f32_acc(x, w, dims):
    """bf16 operands, float32 result cast to bf16: on XLA CPU faster than a bf16-out dot."""
    return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


BASELINES = {"bf16": lax.dot_general, "bf16, f32 out": bf16_f32_acc, "NVFP4": jax_nvfp4.dot_general}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shapes", default="1024x1024,1024x4096,4096x1024", help="d_in x d_out, comma separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()

    report = Report(
        args.out,
        [
            f"# dot_general benchmark: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, {os.cpu_count()} cores, jax {jax.__version__}, {args.tokens} tokens, bf16 "
            f"operands, median of {args.repeats}; `python -m benchmarks.dot_general`.",
            "Both run in the same process. Training step = jax.grad of sum(y * dy) w.r.t. x and W.",
            "",
            "| d_in x d_out | pass | bf16 (ms) | bf16, f32 out (ms) | NVFP4 (ms) | NVFP4 / fastest bf16 |",
            "|---|---|---:|---:|---:|---:|",
        ],
    )
    for shape in args.shapes.split(","):
        d_in, d_out = map(int, shape.split("x"))
        x = jax.random.normal(jax.random.key(0), (args.tokens, d_in), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (d_in, d_out), jnp.bfloat16) * d_in**-0.5
        dy = jax.random.normal(jax.random.key(2), (args.tokens, d_out), jnp.bfloat16)
        for pass_name in ("forward", "training step"):
            times = {}
            for name, dot in BASELINES.items():
                if pass_name == "forward":
                    fn = jax.jit(lambda x, w, dy, dot=dot: dot(x, w, DENSE))
                else:
                    fn = jax.jit(jax.grad(lambda x, w, dy, dot=dot: jnp.sum(dot(x, w, DENSE) * dy), (0, 1)))
                times[name] = median_seconds(fn, x, w, dy, repeats=args.repeats)
            fastest = min(times["bf16"], times["bf16, f32 out"])
            ms = " | ".join(f"{t * 1e3:.1f}" for t in times.values())
            line = f"| {d_in}x{d_out} | {pass_name} | {ms} | {times['NVFP4'] / fastest:.2f}x |"
            report.add(line)
    report.save()


if __name__ == "__main__":
    main()
