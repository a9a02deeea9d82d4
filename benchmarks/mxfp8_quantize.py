"""MXFP8's quantization by XLA's own ops (``jax_nvfp4.mxfp8``: a max, integer ops on the amax, a multiply and
XLA's float8 convert) against a memcpy of the same bytes and the NVFP4 kernel, in one process: does MXFP8 need a
kernel of its own?

Cases on a bf16 [size, size] tensor: a memcpy of its bytes (numpy ``copyto`` into a preallocated array, one
thread); MXFP8 along the rows (the forward GEMM's copy) and along both axes (a training step's two copies of x:
the rows, and the columns for the weight gradient, in x's own layout), each jitted; and the NVFP4 quantize
kernel's rowwise + columnwise copies (``jax_nvfp4.quantize``, amax pass included). Calls taken in turns, median
of ``--repeats``. Prints a markdown table; ``--out FILE`` also writes it.

    python -m benchmarks.mxfp8_quantize [--size 4096] [--repeats 9] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from benchmarks.cpu_quantize import interleaved_medians
from benchmarks.timing import Report, device_name
from jax_nvfp4 import mxfp8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    host = np.asarray(x)
    copy = np.empty_like(host)
    rows = jax.jit(mxfp8.quantize)
    both = jax.jit(lambda x: (mxfp8.quantize(x), mxfp8.quantize(x, axis=0)))
    nvfp4 = jax.jit(lambda x: jax_nvfp4.quantize(x, columnwise=True))
    cases = {
        "memcpy of the input (numpy copyto, one thread)": lambda: np.copyto(copy, host),
        "MXFP8 along the rows (XLA ops)": lambda: rows(x),
        "MXFP8 along the rows and the columns (XLA ops)": lambda: both(x),
        "NVFP4 kernel, rowwise + columnwise (amax pass included)": lambda: nvfp4(x),
    }
    times = interleaved_medians(list(cases.values()), args.repeats)
    memcpy = times[0]
    report = Report(
        args.out,
        [
            f"# MXFP8 quantize by XLA ops: {device_name()}",
            "",
            f"{datetime.date.today()}, {jax.device_count()} {jax.devices()[0].platform} device(s), jax "
            f"{jax.__version__}, bf16 {args.size}x{args.size}, median of {args.repeats} (calls in turns); "
            "`python -m benchmarks.mxfp8_quantize`.",
            "",
            "| case | ms | x memcpy |",
            "|---|---:|---:|",
        ],
    )
    for name, t in zip(cases, times, strict=True):
        report.add(f"| {name} | {t * 1e3:.1f} | {t / memcpy:.2f}x |")
    report.save()


if __name__ == "__main__":
    main()
