"""jax_nvfp4 beside Qwix, the JAX library a user would otherwise pick for NVFP4: time and round-trip error.

Both quantize the same bf16 inputs in one process, in the same layout: 1x16 blocks along the last axis (the
reduction axis of a GEMM's operand), one E4M3 block scale per block, E2M1 values, round to nearest.

- jax_nvfp4: ``jax_nvfp4.quantize(x)`` (the default ``QuantizeSpec``: rowwise=True, columnwise=False, 1x16
  blocks, no RHT, no stochastic rounding) and ``jax_nvfp4.dequantize(t, dtype)``. NVFP4 as NVIDIA defines it:
  the E4M3 block scales are relative to an FP32 global scale from the tensor's amax (6 * 448 / amax).
- Qwix (``pip install ".[peers]"``): ``qwix.quantize(x, "nvfp4", channelwise_axes=(0, ..., ndim - 2),
  tiled_axes={ndim - 1: 16})`` (calibration "absmax", its default) and ``qwix.dequantize(q)``. Each block's
  scale is absmax / 6 rounded to E4M3 (kept in the input's dtype) and is the block's whole scale: there is no
  global scale, so block maxima outside about [0.09, 2688] (E4M3's normal range 2^-6..448, times 6) lose
  precision, below about 0.006 (half E4M3's smallest subnormal, times 6) the block decodes to zeros, and above
  2688 the block saturates. ``channelwise_axes`` gives every row its own scales (without it Qwix shares one
  scale per 16 columns across all rows).

Timing: each library's quantize, and quantize + dequantize back to bf16, each jitted, with a memcpy of the
input (numpy ``copyto``, one thread) as the baseline, the calls taken in turns (``interleaved_medians``, one
warm-up call each), median of ``--repeats``.

Errors (dequantized to float32: jax_nvfp4's ``dequantize(t, jnp.float32)``, Qwix's ``dequantize`` of the
QArray with its scales cast to float32; measured in float64 on the host), ``error_metrics``:

- rel. RMS error: ||x^ - x|| / ||x||;
- blocks zeroed: share of the 1x16 blocks holding a nonzero input that decode to all zeros;
- block max cut: share of those blocks whose largest decoded magnitude is below 0.9x their largest input
  magnitude (a saturated or underflowed block scale; round to nearest keeps it within 6.25% otherwise);
- max error / amax: max |x^ - x| over max |x|.

Cases: standard normal (ordinary), and scaled (tiny 1e-6, huge 1e6; weights with std 0.02; gradients with amax
about 5e-4, as the example's dy in benchmarks/results/nvfp4-diagnostics-*), activations with outlier channels,
rows of mixed magnitude (where jax_nvfp4's per-tensor scale is the limit; its per-token scales are shown too),
and a sweep of the standard normal times 10^k for k from -36 to 37, every 0.5 (every 0.125 from -5 to 6; bf16
has float32's exponent range, so bf16 inputs cover it), plotted.

    python -m benchmarks.peers [--size 4096] [--repeats 9] [--out benchmarks/results/peers-cpu-amd-epyc-2core.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from collections.abc import Callable
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4

BLOCK = 16
CUT = 0.9  # a block's decoded max below CUT x its input max counts as cut
METRICS = ("rel. RMS error", "blocks zeroed", "block max cut", "max error / amax")


def error_metrics(x, y) -> dict[str, float]:
    """Round-trip error of ``y`` (the dequantized ``x``) against ``x``, both [..., N] with N a multiple of 16.

    Computed in float64 on the host, so that any float32 magnitude squares without overflow or underflow. The
    keys are ``METRICS``, each a fraction: ||y - x|| / ||x||; the share of 1x16 blocks (along the last axis)
    holding a nonzero input that decode to all zeros; the share of those blocks whose largest |y| is below
    ``CUT`` x their largest |x|; max |y - x| / max |x|. Non-finite outputs count as errors (the metrics become
    inf or nan).
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.shape != y.shape or x.shape[-1] % BLOCK:
        raise ValueError(f"need equal shapes [..., 16 k], got {x.shape} and {y.shape}")
    err = y - x
    x_blocks = np.abs(x).reshape(-1, BLOCK).max(axis=1)
    y_blocks = np.abs(y).reshape(-1, BLOCK).max(axis=1)
    nonzero = x_blocks > 0
    if not nonzero.any():
        raise ValueError("the input is all zeros")
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "rel. RMS error": float(np.sqrt(np.sum(err * err) / np.sum(x * x))),
            "blocks zeroed": float(np.mean(y_blocks[nonzero] == 0)),
            "block max cut": float(np.mean(~(y_blocks[nonzero] >= CUT * x_blocks[nonzero]))),
            "max error / amax": float(np.max(np.abs(err)) / np.max(np.abs(x))),
        }


def ours_quantize(x, **options):
    """jax_nvfp4's quantization of ``x`` in 1x16 blocks along the last axis (rowwise copy only)."""
    return jax_nvfp4.quantize(x, rowwise=True, columnwise=False, **options)


def ours_roundtrip(x, dtype=jnp.float32, **options):
    """x -> NVFP4 -> ``dtype`` with jax_nvfp4."""
    return jax_nvfp4.dequantize(ours_quantize(x, **options), dtype)


def qwix_quantize(x):
    """Qwix's nvfp4 QArray of ``x``: 1x16 blocks along the last axis, every other axis channelwise."""
    import qwix

    return qwix.quantize(x, "nvfp4", channelwise_axes=tuple(range(x.ndim - 1)), tiled_axes={x.ndim - 1: BLOCK})


def qwix_roundtrip(x, dtype=None):
    """x -> Qwix nvfp4 -> ``dtype`` (None: the input's dtype, which Qwix keeps its scales in)."""
    import qwix

    q = qwix_quantize(x)
    return qwix.dequantize(q if dtype is None else q.astype(dtype))


def cases(key, rows: int, cols: int) -> dict[str, np.ndarray]:
    """The error table's inputs, bf16 [rows, cols] (host arrays), by name."""
    k_normal, k_channels, k_rows = jax.random.split(key, 3)
    z = np.asarray(jax.random.normal(k_normal, (rows, cols), jnp.float32))
    outliers = np.ones(cols, np.float32)
    channels = np.asarray(jax.random.choice(k_channels, cols, (max(cols // 200, 1),), replace=False))
    row_scale = 10.0 ** np.asarray(jax.random.uniform(k_rows, (rows, 1), jnp.float32, -4.0, 4.0))

    def outlier_channels(factor):
        o = outliers.copy()
        o[channels] = factor
        return z * o

    found = {
        "ordinary: N(0, 1)": z,
        "weights: N(0, 0.02^2)": z * 0.02,
        "gradients: N(0, 1) x 1e-4 (amax ~5e-4)": z * 1e-4,
        "tiny: N(0, 1) x 1e-6": z * 1e-6,
        "huge: N(0, 1) x 1e6": z * 1e6,
        f"outlier channels: N(0, 1), {len(channels)} of {cols} channels x 100": outlier_channels(100.0),
        f"outlier channels: N(0, 1), {len(channels)} of {cols} channels x 1000": outlier_channels(1000.0),
        "mixed rows: N(0, 1) x 10^u per row, u ~ U(-4, 4)": z * row_scale,
    }
    return {name: x.astype(jnp.bfloat16) for name, x in found.items()}


def sweep_exponents() -> np.ndarray:
    """The magnitudes of the sweep, as powers of ten (standard normal x 10^k): -36..37 in steps of 0.5, and
    -5..6 in steps of 0.125 (where Qwix's range ends)."""
    return np.union1d(np.arange(-36.0, 37.25, 0.5), np.arange(-5.0, 6.0625, 0.125))


# The sweep's rows in the record (the plot has every k).
TABLE_K = (-36, -35.5, -35, -30, -24, -18, -12, -6, -4, -3, -2.5, -2, -1.5, -1, 0, 1, 2, 3, 3.5, 4, 6, 12, 18, 24, 30)
TABLE_K += (36, 37)
ZOOM = (-5.0, 6.0)


def sweep(z: np.ndarray, exponents, methods: dict[str, Callable]) -> dict[str, list[dict[str, float]]]:
    """error_metrics of each method's round trip of bf16(z x 10^k) for each k."""
    found = {name: [] for name in methods}
    for k in exponents:
        x = (z.astype(np.float64) * 10.0**k).astype(jnp.bfloat16)
        for name, fn in methods.items():
            found[name].append(error_metrics(x, fn(x)))
    return found


def plot_sweep(path: str, exponents, results: dict[str, list[dict[str, float]]], title: str) -> None:
    """Relative RMS error (top) and the shares of blocks zeroed and cut (bottom) against k, over the whole
    sweep (left) and ``ZOOM`` (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex="col", gridspec_kw={"width_ratios": (3, 2)})
    styles = {"jax_nvfp4": ("C0", "-"), "Qwix": ("C3", "--")}
    zoom = (exponents >= ZOOM[0]) & (exponents <= ZOOM[1])
    for col, keep in enumerate((np.ones_like(zoom), zoom)):
        top, bottom = axes[0, col], axes[1, col]
        k = exponents[keep]
        for name, rows in results.items():
            color, line = styles.get(name, ("C2", ":"))
            rows = [r for r, kept in zip(rows, keep, strict=True) if kept]
            top.plot(k, [r["rel. RMS error"] for r in rows], line, color=color, label=name)
            bottom.plot(k, [100 * r["blocks zeroed"] for r in rows], line, color=color, label=f"{name}: zeroed")
            bottom.plot(
                k, [100 * r["block max cut"] for r in rows], line, color=color, alpha=0.45, lw=3,
                label=f"{name}: max cut >10%",
            )  # fmt: skip
        top.set_yscale("log")
        top.grid(True, which="both", alpha=0.3)
        bottom.grid(True, alpha=0.3)
        bottom.set_xlabel("k: the input is N(0, 1) x 10^k")
    axes[0, 0].set_ylabel("relative RMS error")
    axes[1, 0].set_ylabel("share of 1x16 blocks (%)")
    axes[0, 0].set_title("every magnitude")
    axes[0, 1].set_title(f"k from {ZOOM[0]:g} to {ZOOM[1]:g}")
    axes[0, 0].legend()
    axes[1, 1].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if np.isfinite(v) else str(v)


def _pct(v: float) -> str:
    return f"{100 * v:.3g}%" if np.isfinite(v) else str(v)


def main() -> None:
    from benchmarks.cpu_quantize import interleaved_medians
    from benchmarks.timing import Report, device_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="timing: bf16 [size, size] (and [size/4, size/4])")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--error-shape", type=int, nargs=2, default=(1024, 4096), help="the error cases' shape")
    parser.add_argument("--sweep-shape", type=int, nargs=2, default=(256, 4096), help="the sweep's shape")
    parser.add_argument("--note", default="", help="a line for the record (say, what else ran on the machine)")
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--plot", help="the sweep's plot (default: --out with .png, else peers.png)")
    args = parser.parse_args()
    try:
        import qwix  # noqa: F401
    except ImportError as e:
        raise SystemExit('benchmarks.peers needs Qwix: pip install ".[peers]"') from e
    plot = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else "peers.png")

    load = os.getloadavg()
    report = Report(
        args.out,
        [
            f"# jax_nvfp4 beside Qwix: {device_name()}",
            "",
            f"{datetime.date.today()}, {os.cpu_count()} cores, {jax.device_count()} {jax.devices()[0].platform} "
            f"device(s), jax {jax.__version__}, jax_nvfp4 {jax_nvfp4.__version__}, qwix {metadata.version('qwix')}; "
            f"`{shlex.join(['python', '-m', 'benchmarks.peers', *sys.argv[1:]])}`. "
            f"Load average at the start: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}.",
        ]
        + ([args.note] if args.note else [])
        + [
            "",
            "Both quantize the same bf16 inputs, 1x16 blocks along the last axis, E4M3 block scales, round to "
            "nearest. jax_nvfp4: `jax_nvfp4.quantize(x)` (rowwise copy only) and `jax_nvfp4.dequantize(t, dtype)`. "
            'Qwix: `qwix.quantize(x, "nvfp4", channelwise_axes=(0,), tiled_axes={1: 16})` (scales per row and '
            "16 columns; calibration absmax) and `qwix.dequantize(q)`. Qwix has no global scale: its block scale "
            "is absmax / 6 in E4M3, so blocks whose max is below 6 x 2^-10 decode to zeros and above 6 x 448 "
            "saturate; jax_nvfp4's E4M3 block scales are relative to an FP32 global scale (6 x 448 / amax).",
            "",
            "Errors (dequantized to float32, measured in float64): rel. RMS error ||x^ - x|| / ||x||; blocks zeroed: "
            "the share of 1x16 blocks with a nonzero input that decode to all zeros; block max cut: the share whose "
            "largest decoded magnitude is below 0.9x their largest input magnitude; max error / amax: "
            "max |x^ - x| / max |x|. The code is `benchmarks/peers.py`.",
            "",
            f"## Time (median of {args.repeats}, calls in turns, each jitted)",
            "",
            "| bf16 input | case | ms | x memcpy | x jax_nvfp4's |",
            "|---|---|---:|---:|---:|",
        ],
    )

    quantizers = {
        "jax_nvfp4 quantize": jax.jit(ours_quantize),
        "Qwix quantize": jax.jit(qwix_quantize),
        "jax_nvfp4 quantize + dequantize to bf16": jax.jit(lambda x: ours_roundtrip(x, jnp.bfloat16)),
        "Qwix quantize + dequantize to bf16": jax.jit(qwix_roundtrip),
    }
    for size in (args.size, args.size // 4):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
        host, copy = np.asarray(x), np.empty((size, size), np.asarray(x).dtype)
        fns = [lambda c=copy, h=host: np.copyto(c, h)] + [lambda f=f, x=x: f(x) for f in quantizers.values()]
        t_copy, *times = interleaved_medians(fns, args.repeats)
        report.add(f"| {size}x{size} | memcpy of the input (numpy copyto) | {t_copy * 1e3:.2f} | 1.00x | - |")
        for i, (name, t) in enumerate(zip(quantizers, times, strict=True)):
            ours = times[i - i % 2]
            report.add(f"| {size}x{size} | {name} | {t * 1e3:.2f} | {t / t_copy:.1f}x | {t / ours:.2f}x |")
    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    t, q = quantizers["jax_nvfp4 quantize"](x), quantizers["Qwix quantize"](x)
    # XLA's layout of Qwix's float4 codes: "{1,0:E(4)}" is 4 bits an element (packed).
    packed = ":E(4)}" in quantizers["Qwix quantize"].lower(x).compile().as_text()
    codes = q.qvalue.size // 2 if packed else q.qvalue.nbytes
    report.add("")
    report.add(
        f"The quantized {args.size}x{args.size}: jax_nvfp4 {t.data.nbytes + t.scale.nbytes + t.amax.nbytes:,} bytes "
        f"(codes {t.data.dtype} {list(t.data.shape)}, two a byte; scales {t.scale.dtype} {list(t.scale.shape)}; "
        f"amax {t.amax.dtype}); Qwix {codes + q.scale.nbytes:,} bytes (codes {q.qvalue.dtype} "
        f"{list(q.qvalue.shape)}, {'4 bits each in XLA layout' if packed else 'a byte each'}; scales "
        f"{q.scale.dtype} {list(q.scale.shape)})."
    )

    methods = {
        "jax_nvfp4": jax.jit(ours_roundtrip),
        "Qwix": jax.jit(lambda x: qwix_roundtrip(x, jnp.float32)),
    }
    per_token = jax.jit(lambda x: ours_roundtrip(x, row_scaled=True))
    rows, cols = args.error_shape
    report.add("")
    report.add(f"## Round-trip error, bf16 [{rows}, {cols}]")
    report.add("")
    report.add("| input | library | " + " | ".join(METRICS) + " |")
    report.add("|---|---|" + "---:|" * len(METRICS))
    for name, x in cases(jax.random.key(1), rows, cols).items():
        runs = dict(methods)
        if name.startswith("mixed rows"):
            runs["jax_nvfp4, per-token scales (row_scaled=True)"] = per_token
        for library, fn in runs.items():
            m = error_metrics(x, fn(x))
            cells = [_fmt(m["rel. RMS error"]), _pct(m["blocks zeroed"]), _pct(m["block max cut"])]
            report.add(f"| {name} | {library} | " + " | ".join(cells) + f" | {_fmt(m['max error / amax'])} |")

    rows, cols = args.sweep_shape
    exponents = sweep_exponents()
    z = np.asarray(jax.random.normal(jax.random.key(2), (rows, cols), jnp.float32))
    results = sweep(z, exponents, methods)
    plot_sweep(plot, exponents, results, f"round trip of bf16 N(0, 1) x 10^k, [{rows}, {cols}], 1x16 blocks")
    report.add("")
    report.add(f"## Magnitude sweep: bf16 N(0, 1) x 10^k, [{rows}, {cols}]")
    report.add("")
    report.add(f"![error against magnitude]({os.path.basename(plot)})")
    report.add("")
    report.add("Selected k (the plot has every k of the sweep).")
    report.add("")
    report.add(
        "| k | jax_nvfp4 rel. RMS | blocks zeroed | block max cut | Qwix rel. RMS | blocks zeroed | block max cut |"
    )
    report.add("|---:|---:|---:|---:|---:|---:|---:|")
    for i, k in enumerate(exponents):
        if k not in TABLE_K:
            continue
        cells = []
        for library in methods:
            m = results[library][i]
            cells += [_fmt(m["rel. RMS error"]), _pct(m["blocks zeroed"]), _pct(m["block max cut"])]
        report.add(f"| {k:g} | " + " | ".join(cells) + " |")
    load = os.getloadavg()
    report.add("")
    report.add(f"Load average at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}.")
    report.save()


if __name__ == "__main__":
    main()
