"""CPU quantize: the C++ FFI kernel against the jitted pure-JAX reference.

bf16 4096x4096, 1x16 blocks, rowwise + columnwise copies, both run in this
process on this machine; prints the median times and their ratio.

    python benchmarks/cpu_quantize.py [--size 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

import jax_nvfp4
from jax_nvfp4 import reference


def median_seconds(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    opts = {"rowwise": True, "columnwise": True}
    kernel = jax.jit(lambda x: jax_nvfp4.quantize(x, **opts))
    ref = jax.jit(lambda x: reference.quantize(x, **opts))
    same = jax.tree.map(lambda a, b: bool((a == b).all()), kernel(x), ref(x))
    assert all(jax.tree.leaves(same)), "kernel and reference disagree"

    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}")
    print(f"bf16 {args.size}x{args.size}, 1x16 blocks, rowwise+columnwise, median of {args.repeats}")
    t_kernel = median_seconds(kernel, x, args.repeats)
    t_ref = median_seconds(ref, x, args.repeats)
    gbs = args.size * args.size * 3.125 / t_kernel / 1e9  # input read once + both copies written
    print(f"  C++ kernel      {t_kernel * 1e3:9.1f} ms  ({gbs:.2f} GB/s of input+outputs)")
    print(f"  JAX reference   {t_ref * 1e3:9.1f} ms")
    print(f"  speed-up        {t_ref / t_kernel:9.1f}x")


if __name__ == "__main__":
    main()
