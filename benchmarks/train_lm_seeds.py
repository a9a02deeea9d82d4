"""The example's runs over several seeds, from the JSON of each invocation: mean ± sd of each run's losses and
of its same-seed validation gap to bf16, the gap over training (mean ± sd band), and the final gap against the
model's width.

Long comparisons run one seed per invocation (``python -m examples.train_lm --runs ... --seed S --json F``), each
finishing on its own; a run's bf16 partner may come from another invocation of the same seed. This merges them:
files with the same model and training settings (d_model, layers, steps, batch, lr, ...) form one group, every file's
results under its seed (``args.seed``), runs that several files hold taken from the last. Each group gets its
table (a run that not every seed of the group has is left out, and said so); ``--width-plot`` draws each run's
final gap against d_model over the groups, one curve per training length (a learning-rate sweep's bf16-only
groups are not points), and ``--progress-plot`` each width's gap against bf16's validation loss over training
(the widths compared at the same point of training); ``--width-runs`` picks their runs.

    python -m benchmarks.train_lm_seeds RESULTS.json ... [--out table.md] [--plot gaps.png] [--width-plot w.png]
        [--progress-plot p.png] [--width-runs full,full-keep-ends]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import pathlib
from collections.abc import Sequence

import matplotlib
import matplotlib.ticker
import numpy as np

from examples.lm.model import RUNS, kv_heads
from examples.lm.report import COLORS, plot_seeds, print_seed_table, val_gaps

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# The settings that define a group (the model, its data and its training).
SETTINGS = (
    "arch",
    "steps",
    "batch",
    "seq_len",
    "d_model",
    "layers",
    "heads",
    "kv_heads",
    "lr",
    "weight_blocks",
    "eval_every",
    "moe",
    "switch_at",
    "switch_to",
)


ABSENT = {"arch": "gpt"}  # what a file made before a setting existed ran (--arch: GPT-2's block, the only one)


def _group_name(settings: argparse.Namespace) -> str:
    return f"{settings.arch} d_model {settings.d_model}"


def groups(paths: list[str]) -> list[tuple[argparse.Namespace, dict[int, dict]]]:
    """Per group of equal settings: (the settings, with the runs every seed has, in RUNS order; seed -> run ->
    results), by block and d_model. A precision schedule that switches to bf16 leaves the bf16 run as it is: such a
    group without bf16 takes it from the same settings' group without the schedule (said so)."""
    found: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        given = {k: v for k, v in data["args"].items() if v is not None}
        given = {**ABSENT, **given}
        given["kv_heads"] = kv_heads(argparse.Namespace(**given))  # as the model took it (--kv-heads or its default)
        key = tuple(given.get(k) for k in SETTINGS)
        found.setdefault(key, {}).setdefault(int(data["args"]["seed"]), {}).update(data["results"])
    at = {name: SETTINGS.index(name) for name in ("arch", "d_model", "switch_at", "switch_to")}
    for key, by_seed in found.items():
        if key[at["switch_to"]] != "bf16":
            continue
        unswitched = found.get(tuple(None if i in (at["switch_at"], at["switch_to"]) else v for i, v in enumerate(key)))
        borrowed = [
            s for s, results in by_seed.items() if "bf16" not in results and "bf16" in (unswitched or {}).get(s, {})
        ]
        for seed in borrowed:
            by_seed[seed]["bf16"] = unswitched[seed]["bf16"]
        if borrowed:
            print(f"{key[at['arch']]} d_model {key[at['d_model']]}, switched to bf16: bf16 from the unswitched runs")
    out = []
    for key, by_seed in sorted(found.items(), key=lambda item: (item[0][at["arch"]], item[0][at["d_model"]])):
        settings = argparse.Namespace(**dict(zip(SETTINGS, key, strict=True)))
        settings.runs = [r for r in RUNS if all(r in results for results in by_seed.values())]
        missing = sorted({r for results in by_seed.values() for r in results} - set(settings.runs))
        if missing:
            print(f"{_group_name(settings)}: left out (not in every seed): {', '.join(missing)}")
        out.append((settings, by_seed))
    return out


def _heads(settings: argparse.Namespace) -> str:
    """The attention's heads, and its key/value heads where fewer (grouped-query)."""
    kv = f" over {settings.kv_heads} key/value heads" if settings.kv_heads != settings.heads else ""
    return f"{settings.heads} heads{kv}"


def _lr_seeds(settings: argparse.Namespace, by_seed: dict[int, dict]) -> str:
    return f"lr {settings.lr:g} ({len(by_seed)} seed{'s' * int(len(by_seed) > 1)})"


Chosen = dict[tuple[str, int, int], tuple[argparse.Namespace, dict[int, dict]]]
"""(arch, d_model, steps) -> the group drawn there."""


def _rank(group: tuple[argparse.Namespace, dict[int, dict]]) -> tuple[int, float]:
    """More seeds first, then the lower bf16 validation loss (the better-tuned learning rate)."""
    by_seed = group[1]
    return len(by_seed), -float(np.mean([r["bf16"]["final_val_loss"] for r in by_seed.values()]))


def comparable(found: list[tuple[argparse.Namespace, dict[int, dict]]]) -> Chosen:
    """The groups with bf16 and a run beside it and no precision schedule, one per (arch, d_model, steps): where
    groups differ only in learning rate, the one of the most seeds, and of those the one where bf16 ends lowest
    (said so)."""
    chosen: Chosen = {}
    for settings, by_seed in found:
        if "bf16" not in settings.runs or len(settings.runs) < 2 or settings.switch_to is not None:
            continue  # nothing to compare (a learning-rate sweep's bf16 runs), or not a recipe's gap
        key = (settings.arch, settings.d_model, settings.steps)
        if key in chosen:
            other = chosen[key]
            keep = (settings, by_seed) if _rank((settings, by_seed)) > _rank(other) else other
            drop = other if keep is not other else (settings, by_seed)
            print(f"plots, {key[0]} d_model {key[1]}, {key[2]} steps: {_lr_seeds(*keep)} drawn, {_lr_seeds(*drop)} not")
            chosen[key] = keep
        else:
            chosen[key] = (settings, by_seed)
    return chosen


def _multi_width_runs(chosen: Chosen, only: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The (arch, NVFP4 run) pairs of two widths or more (a curve needs two); of the runs ``only`` names, if
    given (every run at several widths makes an unreadable plot once a width has all the options)."""
    unknown = sorted(set(only or ()) - set(RUNS))
    if unknown:
        raise ValueError(f"--width-runs names no run of examples.train_lm: {unknown} (the runs: {sorted(RUNS)})")
    archs = sorted({arch for arch, _, _ in chosen})
    return [
        (arch, r)
        for arch in archs
        for r in RUNS
        if r != "bf16"
        and (only is None or r in only)
        and len({d for (a, d, _), (s, _) in chosen.items() if a == arch and r in s.runs}) > 1
    ]


MARKERS = {"gpt": "o", "llama": "^", "qwen3": "s"}  # the block's marker in the plots


def plot_widths(chosen: Chosen, path: str, only: Sequence[str] | None = None) -> None:
    """Each run's final validation gap to bf16 against d_model (the runs at two widths or more, of ``only`` if
    given): mean over the seeds, ± one sd (none for one seed). One curve per block (its marker), run (its colour)
    and training length (steps; the longest solid)."""
    longest = max((steps for _, _, steps in chosen), default=0)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arch, run in _multi_width_runs(chosen, only):
        for length in sorted({steps for _, _, steps in chosen}, reverse=True):
            points = []
            for (a, d_model, steps), (settings, by_seed) in sorted(chosen.items()):
                if a != arch or steps != length or run not in settings.runs:
                    continue
                final = val_gaps(by_seed, run)[:, -1]
                sd = final.std(ddof=1) if len(final) > 1 else 0.0
                points.append((d_model, final.mean(), sd, len(final), settings.lr))
            if len(points) < 2:  # a curve needs two widths
                continue
            d, mean, sd, n, lr = (np.asarray(v) for v in zip(*points, strict=True))
            ax.errorbar(
                d,
                mean,
                yerr=sd,
                fmt=MARKERS.get(arch, "d") + ("-" if length == longest else "--"),
                color=COLORS[run],
                capsize=4,
                label=f"{arch}: {run}, {length} steps",
            )
            for x, y, k, rate in zip(d, mean, n, lr, strict=True):
                ax.annotate(
                    f"{k} seed{'s' * int(k > 1)}, lr {rate:g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(6, 4),
                    fontsize=7,
                    color=COLORS[run],
                )
    ax.axhline(0, color=COLORS["bf16"], lw=1)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set(
        xlabel="d_model",
        ylabel="final val. loss, % above bf16 (same seed)",
        title="NVFP4's gap to bf16 against the model's width",
    )
    ax.margins(x=0.2)  # room for the last width's labels
    widths = sorted({d for _, d, _ in chosen})
    ax.set_xticks(widths, labels=[str(w) for w in widths])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


def plot_progress(chosen: Chosen, path: str, only: Sequence[str] | None = None) -> None:
    """Each run's validation gap to bf16 at every evaluation against bf16's validation loss there (mean over the
    seeds, ± one sd): one curve per block (its marker), width (its shade) and run (its line style), for the runs at
    two widths or more (of ``only`` if given) and a width's longest training only, so that widths compare at the
    same point of training whatever their steps and tokens per parameter."""
    pairs = _multi_width_runs(chosen, only)
    widths = sorted({d for _, d, _ in chosen})
    shade = dict(zip(widths, plt.get_cmap("viridis")(np.linspace(0, 0.85, len(widths))), strict=True))
    runs = list(dict.fromkeys(run for _, run in pairs))
    lines = dict(zip(runs, itertools.cycle(("-", "--", ":", "-.")), strict=False))  # every run a line style
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (arch, d_model, steps), (settings, by_seed) in sorted(chosen.items()):
        if any(a == arch and d == d_model and longer > steps for a, d, longer in chosen):
            continue  # the width's longer training passes the same points, and further
        bf16 = np.asarray([[loss for _, loss in r["bf16"]["val_loss"]] for r in by_seed.values()]).mean(0)
        for run in (r for a, r in pairs if a == arch and r in settings.runs):
            gaps = val_gaps(by_seed, run)
            sd = gaps.std(0, ddof=1) if len(gaps) > 1 else None
            label = f"{arch} d_model {d_model}, {run} ({steps} steps, {_lr_seeds(settings, by_seed)})"
            fmt = MARKERS.get(arch, "d") + lines[run]
            ax.errorbar(bf16, gaps.mean(0), yerr=sd, fmt=fmt, color=shade[d_model], capsize=3, label=label)
    ax.axhline(0, color=COLORS["bf16"], lw=1)
    ax.invert_xaxis()  # training goes to the right
    ax.set(
        xlabel="bf16's validation loss at the evaluation (training goes right)",
        ylabel="val. loss, % above bf16 (same seed)",
        title="NVFP4's gap to bf16 at the same point of training, by width",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files of examples.train_lm --json")
    parser.add_argument("--out", help="also write the tables (markdown) here")
    parser.add_argument(
        "--plot",
        default="train_lm_seeds.png",
        help="the gap plots' stem: a group of 2 seeds or more gets <stem>-d<d_model>-<steps>-lr<lr>-seeds.png",
    )
    parser.add_argument("--width-plot", help="the final gap against d_model, over the groups")
    parser.add_argument("--progress-plot", help="each width's gap against bf16's validation loss, over training")
    parser.add_argument(
        "--width-runs",
        type=lambda s: s.split(","),
        help="the runs of the width and progress plots, comma-separated (default: every run at two widths or more)",
    )
    args = parser.parse_args()
    found = groups(args.results)
    tables = io.StringIO()
    for settings, by_seed in found:
        with contextlib.redirect_stdout(tables):
            print(
                f"\n{settings.layers} {settings.arch} blocks of d_model {settings.d_model} ({_heads(settings)}), "
                f"{settings.steps} steps of "
                f"{settings.batch}x{settings.seq_len} bytes, peak lr {settings.lr:g};",
                end="",
            )
            print_seed_table(by_seed, settings)
        if len(by_seed) < 2 or len(settings.runs) < 2:
            continue  # a band of the seeds' spread around a gap needs two seeds and a run beside bf16
        stem = pathlib.Path(args.plot)
        name = f"{stem.stem}-{settings.arch}-d{settings.d_model}-{settings.steps}-lr{settings.lr:g}"
        if settings.switch_to is not None:
            name += f"-switch{settings.switch_at:g}-{settings.switch_to}"
        settings.out = str(stem.with_name(name + (stem.suffix or ".png")))  # a stem without one: .png
        plot_seeds(by_seed, settings)
    print(tables.getvalue())
    if args.out:
        pathlib.Path(args.out).write_text(tables.getvalue().lstrip("\n"))
    if args.width_plot or args.progress_plot:
        chosen = comparable(found)
        if args.width_plot:
            plot_widths(chosen, args.width_plot, args.width_runs)
        if args.progress_plot:
            plot_progress(chosen, args.progress_plot, args.width_runs)


if __name__ == "__main__":
    main()
