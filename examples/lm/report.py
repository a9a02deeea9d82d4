"""The training example's results: the loss curves' plots and the table over several seeds."""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import subprocess
import sys
from typing import Any

import matplotlib
import numpy as np

from benchmarks.timing import device_name
from examples.lm.mesh import mesh_name
from examples.lm.model import describe, describe_moe

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"plain": "tab:orange", "rht": "tab:green", "sr": "tab:purple", "full": "tab:red", "full-est": "tab:brown"}
COLORS.update({"4o6": "tab:cyan", "4o6-mae": "tab:gray", "per-token": "tab:olive", "full-keep-last": "tab:pink"})
COLORS.update({"full-keep-ends": "magenta", "full-mxfp8-attn": "gold", "bf16": "tab:blue"})
COLORS.update({"full-keep-attn": "darkgreen", "full-keep-down": "navy"})


def provenance() -> dict[str, Any]:
    """What made a results file: the command, the commit (None outside a git checkout; "+dirty" with local
    changes), the date, Python, jax and jaxlib, and the machine, so that a record says what it reproduces."""
    import jax
    import jaxlib.version

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=10, cwd=pathlib.Path(__file__).parent
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {
        "command": " ".join(["python -m examples.train_lm", *sys.argv[1:]]),
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "machine": f"{platform.machine()}, {len(jax.devices('cpu'))} jax CPU device(s), {device_name()}",
    }


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(x, np.ones(window) / window, mode="valid")


def plot(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """Smoothed training loss (solid) and validation loss (dashed, dots) of each run, the last half zoomed,
    and each NVFP4 run's validation loss relative to bf16's."""
    panels = 3 if "bf16" in results and len(results) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    window = max(1, args.steps // 50)
    for name, r in results.items():
        color = COLORS[name]
        x = np.arange(window, args.steps + 1)
        y = smooth(np.asarray(r["train_loss"]), window)
        vs, vl = (np.asarray(v) for v in zip(*r["val_loss"], strict=True))
        for ax, first in zip(axes[:2], (0, args.steps // 2), strict=True):
            ax.plot(x[x >= first], y[x >= first], color=color, lw=1.2, label=name)
            ax.plot(vs[vs >= first], vl[vs >= first], "o--", color=color, alpha=0.7)
        if panels == 3 and name != "bf16":
            bf16 = np.asarray([v for _, v in results["bf16"]["val_loss"]])
            axes[2].plot(vs, 100 * (vl / bf16 - 1), "o-", color=color, label=name)
    titles = (f"training loss (moving avg {window}); dashed: validation", "second half")
    for ax, title in zip(axes[:2], titles, strict=True):
        ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
        ax.grid(alpha=0.3)
    axes[1].set_xlim(args.steps // 2, args.steps * 1.02)
    axes[0].legend()
    if panels == 3:
        axes[2].axhline(0, color=COLORS["bf16"], lw=1)
        axes[2].set(xlabel="step", ylabel="% above bf16", title="validation loss vs bf16")
        axes[2].grid(alpha=0.3)
        axes[2].legend()
    fig.suptitle(
        f"byte-level LM on stdlib source: {getattr(args, 'arch', 'gpt')} blocks, d_model {args.d_model}, "
        f"{args.layers} layers, "
        f"batch {args.batch}x{args.seq_len}, NVFP4 weight blocks {args.weight_blocks}"
        + (f", mesh {mesh_name(args.mesh)}" if args.mesh else "")
        + (f", MLP {describe_moe(args)}" if getattr(args, "moe", 0) else "")
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    plt.close(fig)


def val_gaps(by_seed: dict[int, dict[str, dict[str, Any]]], run: str) -> np.ndarray:
    """[seeds, evaluations]: each seed's validation loss of ``run`` relative to that seed's bf16 run, in %."""
    return np.asarray(
        [
            [100 * (v / b - 1) for (_, v), (_, b) in zip(r[run]["val_loss"], r["bf16"]["val_loss"], strict=True)]
            for r in by_seed.values()
        ]
    )


def describe_result(run: str, result: dict[str, Any], args: argparse.Namespace) -> str:
    """What a run's linear layers did, its precision schedule's switch included."""
    text = describe(run, args)
    if result.get("switch") is not None:
        text += f"; from step {result['switch']['step']} {describe(result['switch']['to'], args)}"
    return text


def print_seed_table(by_seed: dict[int, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """Mean and sample standard deviation over the seeds of each run's final losses and gap to bf16 (one seed:
    its values, no spread)."""
    n = len(by_seed)
    if n == 1:
        print(f"\none seed ({next(iter(by_seed))}): no spread, not a ranking")
    else:
        print(f"\n{n} seeds ({', '.join(map(str, by_seed))}): mean ± standard deviation over the seeds")

    def spread(a: np.ndarray, digits: int, unit: str = "") -> str:
        return f"{a.mean():{'+' if unit else ''}.{digits}f}{unit}" + (
            f" ± {a.std(ddof=1):.{digits}f}{unit}" if n > 1 else ""
        )

    print(
        "\n| run | recipe | train loss | val loss | val gap vs bf16 (same seed) | ms/step |\n|---|---|---|---|---|---|"
    )
    for run in args.runs:
        train_loss = np.asarray([r[run]["final_train_loss"] for r in by_seed.values()])
        val = np.asarray([r[run]["final_val_loss"] for r in by_seed.values()])
        ms = np.mean([r[run]["ms_per_step"] for r in by_seed.values()])
        gap = "-"
        if run != "bf16" and "bf16" in args.runs:
            final = val_gaps(by_seed, run)[:, -1]
            gap = spread(final, 2, "%")
        losses = f"{spread(train_loss, 4)} | {spread(val, 4)}"
        recipe = describe_result(run, by_seed[next(iter(by_seed))][run], args)
        print(f"| {run} | {recipe} | {losses} | {gap} | {ms:.1f} |")


def plot_seeds(by_seed: dict[int, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """Each NVFP4 run's validation gap to bf16 over training: the mean over the seeds and a band of ± one
    standard deviation, next to <out>-seeds.png."""
    if "bf16" not in args.runs:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in args.runs:
        if run == "bf16":
            continue
        steps = [step for step, _ in next(iter(by_seed.values()))[run]["val_loss"]]
        gaps = val_gaps(by_seed, run)
        mean, sd = gaps.mean(0), gaps.std(0, ddof=1)
        ax.plot(steps, mean, "o-", color=COLORS[run], label=run)
        ax.fill_between(steps, mean - sd, mean + sd, color=COLORS[run], alpha=0.2)
    ax.axhline(0, color=COLORS["bf16"], lw=1)
    ax.set(
        xlabel="step",
        ylabel="% above bf16 (same seed)",
        title=f"validation loss vs bf16: mean ± sd of {len(by_seed)} seeds",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = pathlib.Path(args.out).with_name(pathlib.Path(args.out).stem + "-seeds.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")
