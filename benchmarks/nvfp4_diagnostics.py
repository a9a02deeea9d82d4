"""Which tensors NVFP4 holds worst while the example trains: the diagnostics of every layer's x, W and dy.

Trains the example's model (``python -m examples.train_lm``, a recipe of its ``--runs``; default the full recipe)
and at each evaluation collects ``jax_nvfp4.flax.linen.diagnostics.collect_stats`` on that step's batch: per layer
and operand the relative quantization error, the share of blocks whose E4M3 scale underflows or saturates,
the amax, and the share of nonzero values that quantize to zero. Writes a markdown report (the evolution of
each operand's statistics over training, the last evaluation's worst layers, the full last table) and a plot.
With ``--against RUN`` it also trains RUN (same seed, same batches) and reports, for the layers both runs hold in
NVFP4, how each operand's relative error changed: which operands' errors fell. ``--json FILE`` writes the statistics;
``--compare FILE ...`` draws those of several such files (e.g. one per ``--arch``) side by side, by kind of layer
(q, k, v, out, mlp_gate, mlp_up, mlp_down: the mean over the blocks) and operand, at their last evaluation.

    python -m benchmarks.nvfp4_diagnostics [--arch qwen3] [--run full] [--against full] [--steps 1400]
        [--eval-every 350] [--report FILE] [--json FILE]
    python -m benchmarks.nvfp4_diagnostics --compare GPT.json QWEN3.json --out blocks.png
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import jax_nvfp4
from benchmarks.timing import Report, device_name
from examples.lm.data import prepare_data, windows
from examples.lm.model import ARCHS, RUNS, build_model, describe
from examples.lm.report import provenance
from examples.lm.training import train
from examples.train_lm import make_parser
from jax_nvfp4.flax import RNG_STREAM
from jax_nvfp4.flax.linen import diagnostics

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OPERANDS = tuple(diagnostics.OPERAND_COLORS)
SHOWN = ("rel_error", "zero", "underflow")


def next_byte_ce(batch: jax.Array, logits: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def operand_means(stats: dict, stat: str) -> dict[str, float]:
    """The mean over the layers of one statistic, per operand."""
    return {op: float(np.mean([s[op][stat] for s in stats.values() if op in s])) for op in OPERANDS}


def plot(history: dict[int, dict], path: str, title: str) -> None:
    """Left: each operand's statistics (mean over layers) over training. Right: the last evaluation's relative
    error per layer and operand."""
    steps = sorted(history)
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    for op, color in diagnostics.OPERAND_COLORS.items():
        for stat, style in zip(SHOWN[:2], ("o-", "s--"), strict=True):
            values = [operand_means(history[s], stat)[op] for s in steps]
            axes[0].plot(steps, values, style, color=color, label=f"{op} {stat}")
    axes[0].set(xlabel="step", ylabel="mean over layers", title="relative error (solid), share of values -> 0 (dashed)")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    diagnostics.bar_chart(axes[1], history[steps[-1]], "rel_error")
    axes[1].set(ylabel="relative error", title=f"step {steps[-1]}: relative error per layer")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


KINDS = ("q", "k", "v", "out", "mlp_gate", "mlp_up", "mlp_down")  # the blocks' layers, in the order they run


def layer_kind(path: str) -> str:
    """A layer's path without its block (``block2/mlp_down`` -> ``mlp_down``)."""
    return re.sub(r"^block\d+/", "", path)


def kind_means(last: dict, kind: str, op: str, stat: str) -> float:
    """The mean of one statistic over the blocks' layers of one kind (NaN where none quantizes that operand)."""
    values = [v[op][stat] for layer, v in last.items() if layer_kind(layer) == kind and op in v]
    return float(np.mean(values)) if values else float("nan")


def plot_blocks(paths: list[str], out: str) -> list[str]:
    """Each file's last evaluation (``--json``): per kind of layer and operand, the relative error (top) and the
    share of nonzero values quantized to 0 (bottom), the mean over the blocks; one bar per file, side by side.
    Returns the same as a markdown table."""
    found = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    labels = [f"{d['args']['arch']} ({d['args']['run']}, final val {d['final_val_loss']:.4f})" for d in found]
    lasts = [d["history"][max(d["history"], key=int)] for d in found]
    found_kinds = {layer_kind(layer) for last in lasts for layer in last}
    kinds = [k for k in KINDS if k in found_kinds] + sorted(found_kinds - set(KINDS))
    fig, axes = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True)
    slots = [(kind, op) for kind in kinds for op in OPERANDS]
    width = 0.8 / len(found)
    for ax, stat, what in zip(axes, ("rel_error", "zero"), ("relative error", "share of values -> 0"), strict=True):
        for i, (last, label, hatch) in enumerate(zip(lasts, labels, ("", "//", "..", "xx"), strict=False)):
            values = [kind_means(last, kind, op, stat) for kind, op in slots]
            colors = [diagnostics.OPERAND_COLORS[op] for _, op in slots]
            x = np.arange(len(slots)) + (i - (len(found) - 1) / 2) * width
            ax.bar(x, values, width, color=colors, hatch=hatch, edgecolor="black", linewidth=0.3, label=label)
        ax.set(ylabel=what)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(
        fontsize=8,
        title="hatch: the file; colour: x (blue), W (orange), dy (red)",
        title_fontsize=8,
        loc="lower left",
        bbox_to_anchor=(0, 1.02),
        ncol=len(found),
    )
    axes[1].set_xticks(np.arange(len(slots)), [f"{kind} {op}" for kind, op in slots], rotation=70, fontsize=7)
    fig.suptitle("NVFP4's error by kind of layer and operand, mean over the blocks, at the last evaluation")
    fig.tight_layout()  # leaves the legend above the top axes its room
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"wrote {out}")
    archs = [d["args"]["arch"] for d in found]
    table = [
        "| layer | operand | " + " | ".join(f"{a} rel. error | {a} zero" for a in archs) + " |",
        "|---|---|" + "---:|" * (2 * len(found)),
    ]
    for kind, op in slots:
        cells = [
            f"{kind_means(last, kind, op, 'rel_error'):.4f} | {100 * kind_means(last, kind, op, 'zero'):.1f}%"
            for last in lasts
        ]
        table.append(f"| {kind} | {op} | " + " | ".join(cells).replace("nan | nan%", "- | -") + " |")
    return table


def common_means(history: dict, against: dict, step: int) -> dict[str, tuple[float, float, int]]:
    """Per operand: the mean relative error over the layers both runs quantize at ``step``, in ``history``'s
    run and in ``against``'s, and how many layers that is."""
    ours, theirs = history[step], against[step]
    out = {}
    for op in OPERANDS:
        shared = [layer for layer in sorted(set(ours) & set(theirs)) if op in ours[layer] and op in theirs[layer]]
        ours_mean = float(np.mean([ours[layer][op]["rel_error"] for layer in shared]))
        theirs_mean = float(np.mean([theirs[layer][op]["rel_error"] for layer in shared]))
        out[op] = (ours_mean, theirs_mean, len(shared))
    return out


def diagnose(run: str, args, train_starts, data) -> tuple[dict[int, dict], dict]:
    """Train ``run`` and collect every NVFP4 layer's statistics at each evaluation: (history by step, result)."""
    model = build_model(run, args)
    history: dict[int, dict] = {}

    def on_eval(step: int, params) -> None:
        t0 = time.perf_counter()
        batch = jnp.asarray(windows(data["train"], train_starts[step - 1], args.seq_len))
        loss_fn = functools.partial(next_byte_ce, batch)
        rngs = {RNG_STREAM: jax.random.key(step)}
        history[step] = diagnostics.collect_stats(model, {"params": params}, loss_fn, batch[:, :-1], rngs=rngs)
        errors = operand_means(history[step], "rel_error")
        sys.stderr.write("\r" + " " * 100 + "\r")
        print(
            f"  step {step}: {len(history[step])} layers in {time.perf_counter() - t0:.1f}s; mean relative error "
            + ", ".join(f"{op} {e:.4f}" for op, e in errors.items()),
            flush=True,
        )

    return history, train(run, args, train_starts, data, on_eval=on_eval)


def main() -> None:
    parser = make_parser()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(eval_every=350, out="nvfp4_diagnostics.png")
    runs = [r for r in RUNS if r != "bf16"]
    parser.add_argument("--run", default="full", choices=runs)
    parser.add_argument("--against", choices=runs, help="also train this run: which operands' errors changed")
    parser.add_argument("--report", help="also write the markdown report to this file")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="plot these --json files' statistics to --out")
    args = parser.parse_args()
    if args.compare:
        table = plot_blocks(args.compare, args.out)
        print("\n".join(table))
        if args.report:
            pathlib.Path(args.report).write_text("\n".join(table) + "\n")
        return
    made_by = {**provenance(), "command": " ".join(["python -m benchmarks.nvfp4_diagnostics", *sys.argv[1:]])}
    print(f"jax {jax.__version__} on {jax.default_backend()} ({device_name()}), jax_nvfp4 {jax_nvfp4.__version__}")
    train_starts, data = prepare_data(args)
    history, result = diagnose(args.run, args, train_starts, data)
    steps = sorted(history)
    cmd = made_by["command"]
    report = Report(
        args.report,
        [
            f"# NVFP4 diagnostics of the example while it trains: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, `{cmd}`: the example's model ({ARCHS[args.arch]}, "
            f"d_model {args.d_model}, {args.layers} blocks) trained with `{args.run}` ({describe(args.run, args)}; "
            f"final val loss {result['final_val_loss']:.4f}, seed {args.seed}). At each evaluation, on that step's "
            f"batch ({args.batch}x{args.seq_len} tokens), `jax_nvfp4.flax.linen.diagnostics.collect_stats` quantizes "
            "every NVFP4 layer's x (1x16 blocks), W (16x16) and dy (1x16, stochastic rounding with a fixed key), each "
            "as the forward or dgrad GEMM sees it. rel. error: ||q(t) - t|| / ||t||; zero: share of nonzero "
            "values that quantize to 0; underflow: share of blocks whose E4M3 scale rounds to 0; saturated: "
            "share of blocks above the global amax (0 with the tensor's own amax).",
            "",
            "## Mean over the layers, by evaluation",
            "",
            "| step | " + " | ".join(f"{op} rel. error | {op} zero | {op} underflow" for op in OPERANDS) + " |",
            "|---|" + "---:|" * (3 * len(OPERANDS)),
        ],
    )
    for step in steps:
        cells = []
        for op in OPERANDS:
            err, zero, under = (operand_means(history[step], stat)[op] for stat in SHOWN)
            cells.append(f"{err:.4f} | {100 * zero:.2f}% | {100 * under:.3f}%")
        report.add(f"| {step} | " + " | ".join(cells) + " |")
    if args.against:
        against, against_result = diagnose(args.against, args, train_starts, data)
        report.add("")
        report.add(f"## Against `{args.against}`: which operands' errors fell")
        report.add("")
        report.add(
            f"`{args.against}` ({describe(args.against, args)}; final val loss {against_result['final_val_loss']:.4f}) "
            f"trained on the same seed and batches. Mean relative error over the layers both runs hold in NVFP4 "
            f"(`{args.run}` / `{args.against}`, and the change):"
        )
        report.add("")
        header = " | ".join(f"{op} ({args.run} / {args.against}) | {op} change" for op in OPERANDS)
        report.add(f"| step | {header} |")
        report.add("|---|" + "---:|" * (2 * len(OPERANDS)))
        for step in steps:
            means = common_means(history, against, step)
            cells = [f"{a:.4f} / {b:.4f} ({n} layers) | {100 * (a / b - 1):+.1f}%" for a, b, n in means.values()]
            report.add(f"| {step} | " + " | ".join(cells) + " |")
    last = history[steps[-1]]
    report.add("")
    report.add(f"## Worst layers at step {steps[-1]} (relative error)")
    report.add("")
    for op in OPERANDS:
        worst = sorted(last, key=lambda layer, op=op: -last[layer][op]["rel_error"])[:3]
        report.add(f"- {op}: " + ", ".join(f"{layer} {last[layer][op]['rel_error']:.4f}" for layer in worst))
    report.add("")
    report.add(f"## Every layer at step {steps[-1]}")
    report.add("")
    report.add(diagnostics.stats_table(last))
    report.save()
    plot(history, args.out, f"NVFP4 diagnostics, {args.run}: {args.arch}, d_model {args.d_model}, {args.layers} blocks")
    print(f"wrote {args.out}")
    if args.json:
        record = {"made_by": made_by, "args": vars(args), "final_val_loss": result["final_val_loss"]}
        pathlib.Path(args.json).write_text(json.dumps({**record, "history": history}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
