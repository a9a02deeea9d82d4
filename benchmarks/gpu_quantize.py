"""GPU quantize bandwidth against a device-to-device copy, in one process.

Every figure is the time per call of many calls queued and waited for once
(`benchmarks.timing.queued_seconds`: what a training step gets, no per-call
dispatch or wait in it), and the baseline is a real device-to-device copy of the
same tensor in the same process: a jitted `jnp.copy` (XLA's copy) and, where
torch is installed, `torch.Tensor.clone`; the faster one is "the copy". Bytes =
the input read once plus every output written once, so 100% means the op runs
at copy speed. The first table lists each variant at each size (bf16 inputs),
with the targets of issue 48 and, at 16384^2, the figures measured before the
pipelined kernels (H200, wheel of 83e5bc4, 2026-11-28). The later tables time
the recipe's options as multiples of the plain quantize.

    python -m benchmarks.gpu_quantize [--sizes 4096,16384] [--calls 50] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os

import jax
import jax.numpy as jnp

import jax_nvfp4
from benchmarks.timing import Report, device_name, queued_seconds
from jax_nvfp4.core.formats import num_blocks, packed_size
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.ops import grouped

# Issue 48's "before": bf16 16384^2 on one H200, wheel of 83e5bc4 (jax 0.11.2), ms per call queued.
BEFORE_16384 = {
    "row+col 1x16, own amax": 1.102,
    "row+col 1x16, amax given": 0.974,
    "row only 1x16, amax given": 0.730,
    "row+col 16x16, amax given": 0.809,
    "+ stochastic rounding": 1.076,
    "+ RHT on the columnwise copy, own amax": 1.416,
    "4over6 MSE fast math": 4.559,
    "amax alone": 0.132,
    "dequantize rowwise to bf16": 0.308,
}
# Issue 48's targets: the share of the copy (">= x%") or a multiple of the plain amax-given quantize.
TARGETS = {
    "row+col 1x16, own amax": ">= 65%",
    "row+col 1x16, amax given": ">= 80%",
    "+ stochastic rounding": "<= 1.1x plain",
    "+ RHT on the columnwise copy, own amax": "<= 1.25x plain",
    "per-token scales": "<= 1.3x plain",
    "4over6 MSE fast math": "<= 2x plain",
    "dequantize rowwise to bf16": ">= 80%",
}


def output_bytes(m: int, n: int, rowwise: bool, columnwise: bool) -> int:
    rows = m * (packed_size(n) + num_blocks(n)) if rowwise else 0
    cols = n * (packed_size(m) + num_blocks(m)) if columnwise else 0
    return rows + cols


def copy_seconds(x: jax.Array, calls: int) -> dict[str, float]:
    """Seconds a device-to-device copy of x takes: XLA's, and torch's where torch (with the device) is there."""
    out = {"jnp.copy": queued_seconds(jax.jit(jnp.copy), x, calls=calls)}
    try:
        import torch
    except ImportError:
        return out
    if x.devices().pop().platform == "gpu" and torch.cuda.is_available():
        t = torch.empty(x.nbytes, dtype=torch.uint8, device="cuda")
        t.clone()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                t.clone()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / calls)
        out["torch clone"] = best
        del t
    return out


def table_ops(x: jax.Array) -> list[tuple[str, object, tuple, int]]:
    """(name, function, arguments, bytes moved) of each op the first table times."""
    m, n = x.shape
    amax = jax_nvfp4.amax(x)
    key = jax.random.key(1)
    both = output_bytes(m, n, True, True) + x.nbytes
    rows = jax.block_until_ready(jax_nvfp4.quantize(x, amax=amax))
    q = jax_nvfp4.quantize
    return [
        ("row+col 1x16, own amax", lambda x: q(x, columnwise=True), (x,), both),
        ("row+col 1x16, amax given", lambda x, a: q(x, amax=a, columnwise=True), (x, amax), both),
        ("row only 1x16, amax given", lambda x, a: q(x, amax=a), (x, amax), output_bytes(m, n, True, False) + x.nbytes),
        ("row+col 16x16, amax given", lambda x, a: q(x, amax=a, columnwise=True, block_2d=True), (x, amax), both),
        (  # the recipe's weight quantize (linear/dot_general.py: W as stored, W^T's copy)
            "col only 16x16, amax given",
            lambda x, a: q(x, amax=a, rowwise=False, columnwise=True, block_2d=True),
            (x, amax),
            output_bytes(m, n, False, True) + x.nbytes,
        ),
        ("+ stochastic rounding", lambda x, a, k: q(x, amax=a, columnwise=True, rng_key=k), (x, amax, key), both),
        ("+ RHT on the columnwise copy, own amax", lambda x: q(x, columnwise=True, rht=True), (x,), both),
        ("per-token scales", lambda x: q(x, columnwise=True, row_scaled=True), (x,), both),
        (
            "4over6 MSE fast math",
            lambda x, a: q(
                x, amax=a, columnwise=True, four_over_six_error="mse", four_over_six_fast_math=True, e4m3_max=256
            ),
            (x, amax),
            both,
        ),
        # Since 6aabbd9 XLA's reduction on a GPU (ops.amax: XLA fuses it into producers), the kernel's before.
        ("amax alone", jax_nvfp4.amax, (x,), x.nbytes),
        (
            "dequantize rowwise to bf16",
            lambda t: jax_nvfp4.dequantize(t, jnp.bfloat16),
            (rows,),
            output_bytes(m, n, True, False) + x.nbytes,
        ),
    ]


RING_OPS = (
    "row+col 1x16, amax given",
    "row only 1x16, amax given",
    "row+col 16x16, amax given",
    "col only 16x16, amax given",
    "+ stochastic rounding",
    "+ RHT on the columnwise copy, own amax",
    "per-token scales",
    "4over6 MSE fast math",
)
GROUPS = 8  # the grouped quantize's: x's rows as the tokens of 8 experts, equal shares


def grouped_op(x: jax.Array) -> tuple[str, object, tuple, int]:
    """(name, function, arguments, bytes moved) of the grouped quantize of a mixture of experts' tokens
    (``jax_nvfp4.ops.grouped``, both copies, amaxes given): x's rows in GROUPS groups."""
    m, n = x.shape
    tokens = x[None]
    sizes = jnp.full((1, GROUPS), m // GROUPS, jnp.int32)
    amax, amax_t = grouped.grouped_amax(tokens, sizes)
    seeds = (jnp.array([7, 9], jnp.uint32), jnp.zeros((GROUPS, 2), jnp.uint32))
    blocks = num_blocks(m) + GROUPS - 1  # the grouped copy's blocks a column
    moved = x.nbytes + output_bytes(m, n, True, False) + n * blocks * (8 + 1)
    fn = functools.partial(grouped.grouped_quantize, spec=QuantizeSpec(columnwise=True))
    return f"grouped quantize (MoE, {GROUPS} groups), amax given", fn, (tokens, sizes, amax, amax_t, *seeds), moved


def float32_weight_op(x: jax.Array) -> tuple[str, object, tuple, int]:
    """(name, function, arguments, bytes moved) of the recipe's weight quantize of a float32 master weight (x as
    float32: its columnwise 16x16 copy, amax given), whose ring stages hold the values themselves."""
    m, n = x.shape
    w = x.astype(jnp.float32)

    def fn(w, a):
        return jax_nvfp4.quantize(w, amax=a, rowwise=False, columnwise=True, block_2d=True)

    return (
        "col only 16x16 of float32, amax given",
        fn,
        (w, jax_nvfp4.amax(w)),
        output_bytes(m, n, False, True) + w.nbytes,
    )


def load_table(report: Report, x: jax.Array, copy_bw: float, calls: int) -> None:
    """The direct kernels against the pipelined ones (``NVFP4_QUANTIZE_LOAD``, read by the handlers on every
    call) on the ops they apply to: the quantize's and the grouped quantize's. ``ring`` fills the quantize's
    stages by a tensor copy a tile, ``ring-rows`` by a bulk copy a row (the grouped quantize's: a copy a row
    either way)."""
    report.add(
        "| op | direct ms (% of the copy) | ring ms (% of the copy) | ring-rows ms (% of the copy) "
        "| ring / direct | ring-rows / direct |"
    )
    report.add("|---|---:|---:|---:|---:|---:|")
    before = os.environ.get("NVFP4_QUANTIZE_LOAD")
    try:
        ops = [op for op in table_ops(x) if op[0] in RING_OPS] + [float32_weight_op(x), grouped_op(x)]
        for name, fn, fn_args, moved in ops:
            times = {}
            for load in ("direct", "ring", "ring-rows"):
                os.environ["NVFP4_QUANTIZE_LOAD"] = load
                times[load] = queued_seconds(jax.jit(fn), *fn_args, calls=calls)
            cells = " | ".join(f"{t * 1e3:.3f} ({100 * moved / t / copy_bw:.0f}%)" for t in times.values())
            ratios = " | ".join(f"{times[load] / times['direct']:.2f}x" for load in ("ring", "ring-rows"))
            report.add(f"| {name} | {cells} | {ratios} |")
    finally:
        if before is None:
            os.environ.pop("NVFP4_QUANTIZE_LOAD", None)
        else:
            os.environ["NVFP4_QUANTIZE_LOAD"] = before
    report.add("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,16384")
    parser.add_argument("--calls", type=int, default=50, help="calls queued per timing round")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    report = Report(
        args.out,
        [
            f"# GPU quantize benchmark: {device_name()}",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, bf16 inputs, {args.calls} calls queued per timing "
            "(best of 3 rounds); `python -m benchmarks.gpu_quantize`. % = (input + outputs) bytes / time as a share "
            "of the faster device-to-device copy of the same tensor in this process; x = a multiple of the plain "
            "rowwise + columnwise quantize (amax given).",
            "",
        ],
    )
    try:
        tables(report, args)
    finally:
        report.save()  # the tables that ran, should a later one fail


def tables(report: Report, args: argparse.Namespace) -> None:
    """Every table of the report, in order."""
    copy_bws = {}  # size -> the copy's bytes a second
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        copies = copy_seconds(x, args.calls)
        copy_s = min(copies.values())
        copy_bw = 2 * x.nbytes / copy_s
        described = ", ".join(f"{k} {2 * x.nbytes / s / 1e9:.0f} GB/s" for k, s in copies.items())
        report.add(f"## {size}x{size}: copy {described}")
        report.add("")
        before = size == 16384
        report.add("| op | MB moved | ms | % of the copy | x plain | target |" + (" before ms (%) |" if before else ""))
        report.add("|---|---:|---:|---:|---:|---|" + ("---:|" if before else ""))
        plain_s = None
        for name, fn, fn_args, moved in table_ops(x):
            s = queued_seconds(jax.jit(fn), *fn_args, calls=args.calls)
            if name == "row+col 1x16, amax given":
                plain_s = s
            ratio = f"{s / plain_s:.2f}x" if plain_s else "-"
            row = (
                f"| {name} | {moved / 1e6:.1f} | {s * 1e3:.3f} | {100 * moved / s / copy_bw:.0f}% | {ratio} "
                f"| {TARGETS.get(name, '')} |"
            )
            if before:
                was = BEFORE_16384.get(name)
                row += f" {was:.3f} ({100 * moved / (was / 1e3) / copy_bw:.0f}%) |" if was else " - |"
            report.add(row)
        report.add("")
        copy_bws[size] = copy_bw
    report.add("| size | producer + quantize (own amax pass) ms | producer + JAX amax (fusable) + kernel ms | saved |")
    report.add("|---|---:|---:|---:|")
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)

        def own_pass(x):
            return jax_nvfp4.quantize(x * 2, columnwise=True)

        def fused(x):
            y = x * 2
            return jax_nvfp4.quantize(y, amax=jnp.max(jnp.abs(y)).astype(jnp.float32), columnwise=True)

        own_s = queued_seconds(jax.jit(own_pass), x, calls=args.calls)
        fused_s = queued_seconds(jax.jit(fused), x, calls=args.calls)
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
        plain_s = queued_seconds(jax.jit(q), x, calls=args.calls)
        ratios = [queued_seconds(jax.jit(fn), x, key, calls=args.calls) / plain_s for fn in variants]
        report.add(f"| {size}x{size} | {plain_s * 1e3:.3f} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    four_over_six_table(report, args)
    # The pipelined kernels last: should one fail on its first GPU run (a bounded mbarrier wait traps: the
    # launch fails, and the process's later GPU work with it), every table above is in already.
    report.add("")
    for size in map(int, args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        report.add(f"## {size}x{size}: the direct kernels against the pipelined ones")
        report.add("")
        load_table(report, x, copy_bws[size], args.calls)


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
            plain_s = queued_seconds(jax.jit(q), x, calls=args.calls)
            ratios = [queued_seconds(jax.jit(fn), x, calls=args.calls) / plain_s for fn in variants]
            amax = jax_nvfp4.amax(x)
            kernel_plain, kernel_fast = (
                queued_seconds(jax.jit(lambda x, a, f=f: f(x, amax=a)), x, amax, calls=args.calls)
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
                ratios += [queued_seconds(jax.jit(fn), x, calls=args.calls) / plain_s for fn in (per_token, both)]
            cells = " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios)
            report.add(f"| {size}x{size} | {'16x16' if block_2d else '1x16'} | {plain_s * 1e3:.3f} | {cells} |")


if __name__ == "__main__":
    main()
