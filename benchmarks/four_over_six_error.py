"""Quantization error of every NVFP4 layer's x, W and dy in the example, with and without 4over6.

4over6 (``jax_nvfp4.quantize(four_over_six_error="mse" | "mae")``, ``Recipe(four_over_six=...)``) quantizes each
16-value block twice, its max on E2M1's 6 and, with a 1.5x larger block scale, on 4, and keeps the candidate
with the smaller squared (MSE) or absolute (MAE) error; its global scale aims the block scales at E4M3 256
instead of 448, leaving room for the larger scale.

This trains the example's model (``python -m examples.train_lm``) with the plain recipe (round to nearest, no
transform) and, at each evaluation, takes every NVFP4 layer's input x [tokens, features] and output gradient dy
[tokens, features] on that step's batch, and its weight W^T [out, in] (bf16, as the layer casts it). Each is quantized
as the recipe quantizes it (x and dy in 1x16 blocks, both the rowwise copy of the forward / dgrad GEMM and the
columnwise copy of the wgrad GEMM; W in 16x16 blocks) plainly (E4M3 max 448) and with 4over6 (E4M3 max 256),
and the relative error ||dequantize(quantize(t)) - t||^2 / ||t||^2 is averaged per layer over the evaluations.

    python -m benchmarks.four_over_six_error [--steps 1400] [--eval-every 350] [--report r.md] [--out r.png]
"""

from __future__ import annotations

import collections
import datetime
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import jax_nvfp4
from benchmarks.rht_amax_estimate import layer_tensors
from benchmarks.timing import Report, device_name
from examples.lm.data import prepare_data, windows
from examples.lm.model import DTYPE, build_model
from examples.lm.training import train
from examples.train_lm import make_parser

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# The quantizations compared: keyword arguments of jax_nvfp4.quantize.
MODES = {
    "plain": {},
    "4o6 MSE": {"four_over_six_error": "mse", "e4m3_max": 256},
    "4o6 MAE": {"four_over_six_error": "mae", "e4m3_max": 256},
}
# The quantized copies: x and dy rowwise (forward / dgrad GEMM) and columnwise (wgrad GEMM), W in 16x16 blocks.
COPIES = ("x", "x^T", "W", "dy", "dy^T")
PANELS = ("x", "W", "dy")  # the copies the plot shows (the columnwise ones are in the summary table)
LAYER_ORDER = ("q", "k", "v", "out", "mlp_up", "mlp_down")  # a block's NVFP4 layers, in the order they run
COLORS = {"plain": "tab:orange", "4o6 MSE": "tab:cyan", "4o6 MAE": "tab:purple"}


def relative_error(t: jax.Array, q: jax_nvfp4.NVFP4Tensor, columnwise: bool = False) -> jax.Array:
    t32 = t.astype(jnp.float32)
    err = jax_nvfp4.dequantize(q, jnp.float32, columnwise=columnwise) - t32
    return jnp.sum(err * err) / jnp.sum(t32 * t32)


@functools.partial(jax.jit, static_argnums=1)
def errors(t: jax.Array, weight: bool) -> dict[str, dict[str, jax.Array]]:
    """{mode: {copy: relative error}} of t [rows, cols]: a weight W^T in 16x16 blocks, or an activation or
    gradient in 1x16 blocks, rowwise ("") and columnwise ("^T")."""
    out = {}
    for mode, options in MODES.items():
        if weight:
            out[mode] = {"": relative_error(t, jax_nvfp4.quantize(t, block_2d=True, **options))}
        else:
            q = jax_nvfp4.quantize(t, columnwise=True, **options)
            out[mode] = {"": relative_error(t, q), "^T": relative_error(t, q, columnwise=True)}
    return out


def weights_t(params, layers: list[str], x_features: dict[str, int]) -> dict[str, jax.Array]:
    """{layer: W^T [out, in]} in the layers' compute dtype: the operand the recipe quantizes in 16x16 blocks."""
    out = {}
    for layer in layers:
        kernel = functools.reduce(lambda tree, name: tree[name], layer.split("/"), params)["kernel"]
        out[layer] = kernel.reshape(x_features[layer], -1).T.astype(DTYPE)
    return out


def mean(values) -> float:
    return float(np.mean(values))


def plot(means: dict, layers: list[str], path: str, title: str) -> None:
    """Grouped bars: each layer's mean relative error per mode, one panel per tensor (linear, from 0)."""
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(max(10, 0.55 * len(layers)), 3.2 * len(PANELS)), sharex=True)
    x = np.arange(len(layers))
    width = 0.8 / len(MODES)
    for ax, copy in zip(axes, PANELS, strict=True):
        for i, mode in enumerate(MODES):
            values = [means[layer, copy, mode] for layer in layers]
            ax.bar(x + (i - (len(MODES) - 1) / 2) * width, values, width, color=COLORS[mode], label=mode)
        ratio = mean([means[layer, copy, "4o6 MSE"] / means[layer, copy, "plain"] for layer in layers])
        ax.set(ylabel="||q(t) - t||² / ||t||²", title=f"{copy}: 4o6 MSE / plain {ratio:.3f} (mean)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=len(MODES), loc="upper center", bbox_to_anchor=(0.5, 0.965))
    axes[-1].set_xticks(x, layers, rotation=60, ha="right")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = make_parser()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(eval_every=350, out="four_over_six_error.png")
    parser.add_argument("--report", help="also write the markdown report to this file")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()} ({device_name()}), jax_nvfp4 {jax_nvfp4.__version__}")
    train_starts, data = prepare_data(args)
    model = build_model("plain", args)
    tensors_fn = jax.jit(lambda p, b, k: layer_tensors(model, p, b, k))
    errs = collections.defaultdict(list)  # (layer, copy, mode) -> relative error at each evaluation
    layers: list[str] = []
    t0 = time.perf_counter()

    def on_eval(step: int, params) -> None:
        t_eval = time.perf_counter()
        batch = jnp.asarray(windows(data["train"], train_starts[step - 1], args.seq_len))
        tensors = tensors_fn(params, batch, jax.random.key(step))
        # In the model's order (the jitted dict comes back sorted by name).
        layers[:] = sorted(
            {layer for layer, _ in tensors}, key=lambda n: (n.split("/")[0], LAYER_ORDER.index(n.split("/")[-1]))
        )
        w = weights_t(params, layers, {layer: tensors[layer, "x"].shape[-1] for layer in layers})
        operands = [(layer, kind, t) for (layer, kind), t in tensors.items()] + [(k, "W", t) for k, t in w.items()]
        for layer, kind, t in operands:
            for mode, by_copy in errors(t, kind == "W").items():
                for suffix, value in by_copy.items():
                    errs[layer, kind + suffix, mode].append(float(value))
        ratios = {
            copy: mean([errs[layer, copy, "4o6 MSE"][-1] / errs[layer, copy, "plain"][-1] for layer in layers])
            for copy in COPIES
        }
        sys.stderr.write("\r" + " " * 100 + "\r")
        print(
            f"  step {step}: {len(layers)} layers measured in {time.perf_counter() - t_eval:.1f}s; "
            "4o6 MSE / plain error (mean over layers): " + ", ".join(f"{copy} {r:.3f}" for copy, r in ratios.items()),
            flush=True,
        )

    result = train("plain", args, train_starts, data, on_eval=on_eval)
    steps = [s for s, _ in result["val_loss"]]
    means = {key: mean(v) for key, v in errs.items()}
    ratio = {(layer, copy, mode): means[layer, copy, mode] / means[layer, copy, "plain"] for layer, copy, mode in means}
    cmd = f"python -m benchmarks.four_over_six_error --steps {args.steps} --eval-every {args.eval_every}"
    report = Report(
        args.report,
        [
            f"# 4over6 vs plain NVFP4: quantization error per layer, {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, `{cmd}`: the example's model (d_model {args.d_model}, "
            f"{args.layers} layers, {len(layers)} NVFP4 layers) trained with the plain recipe (final val loss "
            f"{result['final_val_loss']:.4f}); at steps {', '.join(map(str, steps))}, each layer's x and dy on that "
            f"step's batch ({args.batch}x{args.seq_len} tokens) and its W^T [out, in] (bf16). Error: "
            "||dequantize(quantize(t)) - t||² / ||t||², averaged over those steps; ratio: that mean with 4over6 "
            "over the plain one (below 1: 4over6 is more accurate). plain: round to nearest, E4M3 max 448; "
            '4o6: `four_over_six_error="mse"` / `"mae"`, E4M3 max 256. x and dy: 1x16 blocks along the features '
            "(the forward / dgrad operand); x^T, dy^T: their columnwise copies, 1x16 blocks along the tokens (the "
            "wgrad operands); W: 16x16 blocks.",
            "",
            "## Summary (per tensor, over the layers)",
            "",
            "| tensor | plain error (mean) | 4o6 MSE error | 4o6 MSE / plain: mean (min .. max) over layers "
            "| 4o6 MAE error | 4o6 MAE / plain: mean (min .. max) |",
            "|---|---|---|---|---|---|",
        ],
    )

    def ratio_cell(mode: str, copies: tuple[str, ...]) -> str:
        r = [ratio[layer, copy, mode] for layer in layers for copy in copies]
        return f"{mean(r):.3f} ({min(r):.3f} .. {max(r):.3f})"

    for copy in COPIES:
        cells = [f"{mean([means[layer, copy, 'plain'] for layer in layers]):.3e}"]
        for mode in ("4o6 MSE", "4o6 MAE"):
            cells += [f"{mean([means[layer, copy, mode] for layer in layers]):.3e}", ratio_cell(mode, (copy,))]
        report.add(f"| {copy} | " + " | ".join(cells) + " |")
    report.add(
        f"| all ({len(layers) * len(COPIES)}) | | | {ratio_cell('4o6 MSE', COPIES)} | | "
        f"{ratio_cell('4o6 MAE', COPIES)} |"
    )
    report.add("")
    report.add("## Per layer (x, W, dy: the forward and dgrad operands)")
    report.add("")
    report.add("Mean relative error; 4over6 cells: error (ratio to plain).")
    report.add("")
    header = [f"{copy} {mode}" for copy in PANELS for mode in MODES]
    report.add("| layer | " + " | ".join(header) + " |")
    report.add("|---|" + "---|" * len(header))
    for layer in layers:
        cells = []
        for copy in PANELS:
            for mode in MODES:
                cell = f"{means[layer, copy, mode]:.3e}"
                cells.append(cell if mode == "plain" else f"{cell} ({ratio[layer, copy, mode]:.3f})")
        report.add(f"| {layer} | " + " | ".join(cells) + " |")
    report.add("")
    report.add("## Per evaluation step (4o6 MSE / plain, mean over the layers)")
    report.add("")
    report.add("| tensor | " + " | ".join(map(str, steps)) + " |")
    report.add("|---|" + "---|" * len(steps))
    for copy in COPIES:
        cells = [
            mean([errs[layer, copy, "4o6 MSE"][i] / errs[layer, copy, "plain"][i] for layer in layers])
            for i in range(len(steps))
        ]
        report.add(f"| {copy} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    report.add("")
    report.add(f"Total time {time.perf_counter() - t0:.0f}s ({result['ms_per_step']:.0f} ms per training step).")
    title = (
        f"NVFP4 relative quantization error per layer, mean over steps {', '.join(map(str, steps))} "
        f"(byte-level LM, d_model {args.d_model}, plain recipe)"
    )
    plot(means, layers, args.out, title)
    report.add("")
    report.add(f"![errors per layer]({pathlib.Path(args.out).name})")
    report.save()
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))


if __name__ == "__main__":
    main()
