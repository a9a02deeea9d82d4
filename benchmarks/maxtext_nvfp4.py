"""MaxText's own pre-training loop run unquantized (bf16) and in NVFP4 through our Qwix provider, on a tiny model.

Each run calls ``maxtext.trainers.pre_train.train.main`` (MaxText 0.2.5, unmodified) on a tiny llama2-style decoder
(``base_emb_dim=64``, 4 heads of 16, MLP 128, 2 layers, vocab 32000), synthetic data, ``hardware=cpu``. For NVFP4
the script replaces ``maxtext.layers.quantizations.get_qt_provider`` in-process (its only caller,
``maybe_quantize_model``, looks it up in that module's globals; no installed file is edited) by a function returning
the stock ``jax_nvfp4.qwix.NVFP4Provider([Rule(RULE, jax_nvfp4.Recipe())], rngs=nnx.Rngs(nvfp4=0))`` (stochastic
rounding on), and passes ``quantization=int8 use_qwix_quantization=True`` so that ``maybe_quantize_model`` calls
``qwix.quantize_model`` with it (with Qwix, nothing else of int8 is built). It reports the provider's routed paths
(``provider.seen``) and counts the calls of the NNX NVFP4 ops (``NVFP4DotGeneral`` / ``NVFP4Einsum`` /
``NVFP4RaggedDot``) made after MaxText's last conversion of the model, i.e. while the training step is traced.
Each configuration runs in a subprocess of this script (``train.main`` is not known to be re-entrant); the
per-step losses are parsed from MaxText's log lines (``completed step: N, ... loss: X``).

    python -m benchmarks.maxtext_nvfp4 [--runs bf16,nvfp4] [--steps 5] [--scan-layers true|false|true,false]
        [--rule 'decoder/.*'] [--keys] [--logs DIR] [--out FILE]

``--keys`` also counts, by op path, the stochastic-rounding keys the ops draw while the run runs (a host callback
on each draw): draws and distinct keys, to see whether each layer and step gets its own.

MaxText is not a dependency of this project. In a scratch venv (Python 3.12; ``maxtext==0.2.5`` declares no
dependencies without an extra, and its ``[tpu]`` extra pulls ``libtpu``), its ``[tpu]`` requirements were installed
less ``libtpu``, ``nvidia-*`` and ``jax``/``jaxlib``, with a CPU jax, then this package, from the repository root::

    python3.12 -m venv /work/maxtext-venv && . /work/maxtext-venv/bin/activate
    pip install maxtext==0.2.5
    python -c "
    import importlib.metadata as m, re
    for r in m.requires('maxtext'):
        if r.endswith(\\"extra == 'tpu'\\") and not re.match(r'(libtpu|nvidia|jax|jaxlib)\\b', r):
            print(r.split(';')[0].replace(' ', ''))
    " > reqs.txt && printf 'jax==0.12.0.1\\njaxlib==0.12.0.1\\n' >> reqs.txt  # 232 lines; qwix among them
    pip install -r reqs.txt
    NVFP4_CUDA=OFF pip install --no-deps .

Run from the repository root, ``jax_nvfp4`` is imported from the working tree (its path is reported).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

MARK = "[maxtext_nvfp4] RESULT "
LOSS = re.compile(r"completed step: (\d+), .*?\bloss: ([-\d.naif]+)")
CONFIG = [  # the tiny model and a CPU run without Google Cloud services
    *("hardware=cpu", "skip_jax_distributed_system=True", "dataset_type=synthetic", "enable_checkpointing=False"),
    *("base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128", "head_dim=16"),
    *("base_num_decoder_layers=2", "per_device_batch_size=2", "max_target_length=128"),
    *("enable_goodput_recording=False", "monitor_goodput=False", "enable_checkpoint_cloud_logger=False"),
    "enable_tensorboard=False",
]
NVFP4_ARGS = ["quantization=int8", "use_qwix_quantization=True"]
MAXTEXT_RULE = r"decoder/.*layers.*"  # the module_path of MaxText's own Qwix rules (quantizations.py)


def overrides(args, mode: str, scan: str) -> list[str]:
    """The MaxText key=value overrides of one run (after the config file; the tokenizer's path is added there)."""
    extra = NVFP4_ARGS if mode == "nvfp4" else []
    return [*CONFIG, f"steps={args.steps}", f"learning_rate_schedule_steps={args.steps}", f"scan_layers={scan}", *extra]


def child(args) -> None:
    """One run in this process: MaxText's train.main, patched for NVFP4; prints a JSON result line at the end."""
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText's switch off Google Cloud services
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO)  # the per-step loss lines are absl INFO
    absl_logging.set_stderrthreshold(absl_logging.INFO)
    from maxtext.layers import quantizations
    from maxtext.trainers.pre_train import train
    from maxtext.utils.globals import MAXTEXT_ASSETS_ROOT, MAXTEXT_CONFIGS_DIR

    import jax_nvfp4

    mode, scan = args.child
    providers, calls, keys = [], collections.Counter(), collections.defaultdict(list)
    if mode == "nvfp4":
        from flax import nnx

        from jax_nvfp4.flax import Rule
        from jax_nvfp4.flax.nnx import layers
        from jax_nvfp4.qwix import NVFP4Provider

        def counted(call, name):
            def wrapped(self, *a, **k):
                calls[f"{name} {self.path}"] += 1
                return call(self, *a, **k)

            return wrapped

        for cls in (layers.NVFP4DotGeneral, layers.NVFP4Einsum, layers.NVFP4RaggedDot):
            cls.__call__ = counted(cls.__call__, cls.__name__)

        if args.keys:  # record each stochastic-rounding key an op draws, when the step runs (a host callback)
            import jax

            next_key = layers.NVFP4Op.next_key

            def keyed(self):
                key = next_key(self)
                if key is not None:
                    record = keys[self.path].append
                    jax.debug.callback(lambda k: record(repr(k.tolist())), jax.random.key_data(key))
                return key

            layers.NVFP4Op.next_key = keyed

        def get_qt_provider(config):
            providers.append(NVFP4Provider([Rule(args.rule, jax_nvfp4.Recipe())], rngs=nnx.Rngs(nvfp4=0)))
            return providers[-1]

        convert = quantizations.maybe_quantize_model

        def maybe_quantize_model(model, config):
            model = convert(model, config)
            calls.clear()  # count the calls made after the last conversion: the training step's trace
            return model

        quantizations.get_qt_provider = get_qt_provider
        quantizations.maybe_quantize_model = maybe_quantize_model  # create_model calls it by module attribute

    config = os.path.join(MAXTEXT_CONFIGS_DIR, "decoupled_base_test.yml")
    tokenizer = os.path.join(MAXTEXT_ASSETS_ROOT, "tokenizers", "tokenizer.llama2")
    argv = [config, f"base_output_directory={args.output_dir}", f"run_name={mode}_scan_{scan}"]
    argv += [*overrides(args, mode, scan), f"tokenizer_path={tokenizer}"]
    print("[maxtext_nvfp4] train.main argv:", " ".join(argv), flush=True)
    train.main([None, *argv])
    if keys:
        jax.effects_barrier()
    result = {"jax_nvfp4": jax_nvfp4.__file__, "providers": len(providers), "calls": dict(sorted(calls.items()))}
    result["keys"] = {path: [len(k), len(set(k))] for path, k in sorted(keys.items())}
    result["seen"] = sorted(providers[-1].seen) if providers else []
    result["recipe"] = repr(providers[-1].rules[0].recipe) if providers else None
    print(MARK + json.dumps(result), flush=True)


def run(args, mode: str, scan: str) -> dict:
    """One configuration in a subprocess of this script: its losses, result line and wall time."""
    cmd = [sys.executable, "-m", "benchmarks.maxtext_nvfp4", "--child", mode, scan, "--steps", str(args.steps)]
    cmd += ["--rule", args.rule, "--output-dir", args.output_dir] + ["--keys"] * args.keys
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
    log = proc.stdout + proc.stderr
    if args.logs:
        with open(os.path.join(args.logs, f"{mode}_scan_{scan}.log"), "w") as f:
            f.write(log)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode or not lines:
        sys.exit(f"{mode} scan_layers={scan} failed (exit {proc.returncode}):\n{log[-6000:]}")
    losses = {int(s): float(x) for s, x in LOSS.findall(log)}
    return {"losses": losses, "wall": time.perf_counter() - start, **json.loads(lines[-1][len(MARK) :])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="bf16,nvfp4", help="comma-separated: bf16, nvfp4")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--scan-layers", default="true,false", help="MaxText's scan_layers: true, false or both")
    parser.add_argument("--rule", default=r"decoder/.*", help="the NVFP4 rule's module_path (Qwix fullmatch)")
    parser.add_argument("--keys", action="store_true", help="count the SR keys each NVFP4 op draws (draws, distinct)")
    parser.add_argument("--logs", help="also write each run's MaxText log to this folder")
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "SCAN"), help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)  # MaxText's base_output_directory
    args = parser.parse_args()
    if args.child:
        return child(args)

    import jax

    from benchmarks.timing import Report, device_name

    runs = [(m, s.capitalize()) for s in args.scan_layers.split(",") for m in args.runs.split(",")]
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    args.output_dir = tempfile.mkdtemp(prefix="maxtext_nvfp4_")
    try:
        results = {(m, s): run(args, m, s) for m, s in runs}
    finally:
        shutil.rmtree(args.output_dir, ignore_errors=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("maxtext", "jax", "flax", "qwix", "optax"))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    first = next(iter(results.values()))
    report = Report(
        args.out,
        [
            f"# MaxText pre-training with `NVFP4Provider`: {device_name()}, {os.cpu_count()} cores "
            f"({jax.default_backend()}, {jax.device_count()} device{'s' * (jax.device_count() > 1)})",
            "",
            f"{now}, commit {commit}, Python {sys.version.split()[0]}, {versions}; `jax_nvfp4` from "
            f"`{first['jax_nvfp4']}`.",
            "",
            f"    python -m benchmarks.maxtext_nvfp4 {' '.join(sys.argv[1:])}",
            "",
            "MaxText overrides (after `maxtext/configs/decoupled_base_test.yml`, with `tokenizer_path` its llama2 "
            "tokenizer, `run_name`, `base_output_directory` a temporary folder): "
            f"`{' '.join(overrides(args, '', 'S'))}` (`S`: `True`/`False`), and for NVFP4 "
            f"`{' '.join(NVFP4_ARGS)}` with `get_qt_provider` returning "
            f"`NVFP4Provider([Rule({args.rule!r}, Recipe())], rngs=nnx.Rngs(nvfp4=0))`.",
            "",
        ],
    )
    steps = range(args.steps)
    report.add("| run | scan_layers | " + " | ".join(f"loss step {i}" for i in steps) + " | wall s |")
    report.add("|---|---|" + "---:|" * (args.steps + 1))
    for (mode, scan), r in results.items():
        cells = " | ".join(f"{r['losses'][i]:.3f}" if i in r["losses"] else "-" for i in steps)
        report.add(f"| {mode} | {scan} | {cells} | {r['wall']:.0f} |")
    for (mode, scan), r in results.items():
        if mode != "nvfp4":
            continue
        report.add("")
        report.add(f"**nvfp4, scan_layers={scan}**: `get_qt_provider` called {r['providers']} times; recipe")
        report.add(f"`{r['recipe']}`. Routed paths (`provider.seen` of the last provider), and whether MaxText's")
        report.add(f"own rule `{MAXTEXT_RULE}` would match them:")
        report.add("")
        for path in r["seen"]:
            report.add(f"- `{path}`" + ("" if re.fullmatch(MAXTEXT_RULE, path) else f" (not by `{MAXTEXT_RULE}`)"))
        report.add("")
        report.add("NNX op calls after the last conversion (the training step's trace):")
        report.add("")
        for name, n in r["calls"].items() or [("none", 0)]:
            report.add(f"- `{name}`: {n}")
        if r["keys"]:
            report.add("")
            report.add("Stochastic-rounding keys drawn while the run ran (Qwix's first run included), by op path:")
            report.add("")
            for path, (n, distinct) in r["keys"].items():
                report.add(f"- `{path}`: {n} draws, {distinct} distinct keys")
    report.save()


if __name__ == "__main__":
    main()
