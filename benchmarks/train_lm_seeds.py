"""The example's runs over several seeds, from the JSON of each invocation: mean ± sd of each run's losses and
of its same-seed validation gap to bf16, and the gap over training (mean ± sd band) as a plot.

Long comparisons run one seed per invocation (``python -m examples.train_lm --runs ... --seed S --json F``), each
finishing on its own; a run's bf16 partner may come from another invocation of the same seed. This merges them:
every file's results under its seed (``args.seed``), runs that several files hold taken from the last. All files
must share the model's settings (d_model, layers, steps, batch, ...): mixing them is an error.

    python -m benchmarks.train_lm_seeds RESULTS.json ... [--out table.md] [--plot gaps.png]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib

from examples.lm.model import RUNS
from examples.lm.report import plot_seeds, print_seed_table

# The settings that must agree between the merged files (the model, its data and its training).
SETTINGS = ("steps", "batch", "seq_len", "d_model", "layers", "heads", "lr", "weight_blocks", "eval_every", "moe")


def merge(paths: list[str]) -> tuple[argparse.Namespace, dict[int, dict]]:
    """(the shared settings with every run found, in RUNS order; seed -> run -> results)."""
    by_seed: dict[int, dict] = {}
    settings = None
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        these = {k: data["args"].get(k) for k in SETTINGS}
        if settings is not None and these != settings:
            raise SystemExit(f"{path}: settings {these} differ from the others' {settings}")
        settings = these
        by_seed.setdefault(int(data["args"]["seed"]), {}).update(data["results"])
    runs = [r for r in RUNS if all(r in results for results in by_seed.values())]
    missing = sorted({r for results in by_seed.values() for r in results} - set(runs))
    if missing:
        print(f"left out (not in every seed): {', '.join(missing)}")
    return argparse.Namespace(**settings, runs=runs), by_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files of examples.train_lm --json")
    parser.add_argument("--out", help="also write the table (markdown) here")
    parser.add_argument("--plot", default="train_lm_seeds.png", help="the gap plot (its name gets -seeds)")
    args = parser.parse_args()
    settings, by_seed = merge(args.results)
    settings.out = args.plot
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        print_seed_table(by_seed, settings)
    print(table.getvalue())
    if args.out:
        pathlib.Path(args.out).write_text(table.getvalue().lstrip("\n"))
    plot_seeds(by_seed, settings)


if __name__ == "__main__":
    main()
