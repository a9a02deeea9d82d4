"""Train a small byte-level transformer with NVFP4 linear layers and compare it with bf16.

The corpus is the Python standard library's own source, which every machine has offline: ~4 MB of
bytes in a fixed order, the last 5% held out for validation. Every run starts from the same initial
weights and sees the same batches; only the linear layers inside the transformer blocks differ
(NVFP4 with a recipe variant, or bf16). The embeddings and the output head stay in bf16, as in NVIDIA's
NVFP4 recipe. Prints a table of final losses and step times and writes a plot of the loss curves.

    python -m examples.train_lm [--steps N] [--runs full-keep-ends,bf16 | all] [--out train_lm.png]

The block (``--arch``): qwen3 (the default; RMSNorm, rotary positions, grouped-query attention with --kv-heads
key/value heads, by default half of --heads, RMSNorm on q and k, a gated SiLU MLP of width 3 x d_model, no biases: the
decoder block of Qwen3, and with ``--arch llama`` without the q/k norms that of Llama), or gpt (GPT-2's: LayerNorm,
learned positions, multi-head attention, a GELU MLP of width 4 x d_model, biases).

The NVFP4 recipe variants (``--runs``): plain (round to nearest, no transform), rht (+ the Random
Hadamard Transform on the weight-gradient operands), sr (+ stochastic rounding of the gradients, no
RHT), full (both: NVIDIA's recipe, ``jax_nvfp4.Recipe()``), full-est (full, with the post-RHT amax
estimated from the pre-RHT one), 4o6 (plain + 4over6 adaptive block scaling of x, W and dy: each
16-value block scaled to 6 or to 4, whichever gives the smaller squared error), 4o6-mae (the same by the
absolute error), per-token (plain + one global scale per token for x and dy instead of one per tensor),
full-keep-last (the bf16 model converted by rules, ``jax_nvfp4.flax.quantize_model``: the full recipe
everywhere but the last block), full-keep-ends (the same with the first and the last block in bf16),
full-mxfp8-attn (the full recipe, the attention projections in MXFP8: ``jax_nvfp4.MXFP8``), full-keep-attn and
full-keep-down (the full recipe, the attention projections or the MLPs' down projections in bf16).
Stochastic rounding draws a fresh key every step from the layers' ``"nvfp4"`` RNG stream.

`--switch-at F --switch-to RUN` is a precision schedule: every other run trains its first F of the steps as
itself and the rest as RUN (e.g. ``--switch-at 0.8 --switch-to bf16``), keeping the parameters and the optimizer
state (the runs' models have the same parameters); the results record the step of the switch.

`--seeds N` trains every run with the seeds --seed .. --seed+N-1 (initial weights and batch order) and
reports the mean and standard deviation of the losses and of each seed's gap to its bf16 run.

`--save DIR` writes each trained model to DIR/<run> for inference (``python -m examples.generate DIR`` samples
text from it): the NVFP4 layers' kernels quantized once (``jax_nvfp4.QuantizedWeight``, 0.5625 bytes a value),
every other parameter as trained, saved with orbax-checkpoint (``jax_nvfp4.checkpoint``), and the model's
settings in config.json.

`--moe E` replaces every block's MLP with a mixture of E experts (``jax_nvfp4.flax.moe.MoEMLP``): top-2
routing by a float32 router, each expert a GELU MLP of hidden width 2 x d_model (as many weights per token
as GPT-2's dense MLP of 4 x d_model), its grouped GEMMs ``jax_nvfp4.ragged_dot`` in NVFP4 runs and
``lax.ragged_dot`` in the bf16 run. The training loss adds 0.01 x the layers' mean load-balancing loss
(the printed train loss includes it; the validation loss is the cross-entropy alone). `--dispatch capacity`
gives each expert at most C = ceil(--capacity-factor x T x 2 / E) of the (token, choice) pairs of a batch of
T = batch x seq-len tokens (the first in token order; the others are dropped, in evaluation too) and runs its
GEMMs as batched ``jax_nvfp4.dot_general`` (``lax.dot_general`` in bf16) on a [E, C, d] buffer; the default,
`--dispatch ragged`, drops nothing.

`--mesh data=2,fsdp=2,tensor=2` trains sharded over that many devices (on CPU, set
XLA_FLAGS=--xla_force_host_platform_device_count=8): the batch splits over data x fsdp, the parameters
and their optimizer state over fsdp (gathered for use), and the attention heads and MLP over tensor.

`--processes 2 --mesh fsdp=8` trains as two ``jax.distributed`` processes of 4 CPU devices each on this machine, as
on two hosts (the launcher: ``examples.lm.distributed``); on a cluster each process runs the command with
``--processes N --process-id I --coordinator HOST:PORT``, or ``--coordinator auto`` where
``jax.distributed.initialize()`` finds the job itself (SLURM, Open MPI, Kubernetes). docs/sharding.md has more.

This module is the command line; the model, its data and the training loop are the package ``examples.lm``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

import jax_nvfp4
from examples.lm.data import prepare_data
from examples.lm.distributed import join, rerun_as_processes
from examples.lm.mesh import make_mesh, mesh_name, parse_mesh
from examples.lm.model import ARCHS, MOE_TOP_K, RULE_RUNS, RUNS, build_model, kv_heads
from examples.lm.report import describe_result, plot, plot_seeds, print_seed_table, provenance
from examples.lm.training import train


def parse_runs(text: str) -> tuple[str, ...]:
    """``full-keep-ends,bf16`` or ``all`` -> the runs' names, for argparse."""
    runs = RUNS if text == "all" else tuple(dict.fromkeys(r.strip() for r in text.split(",")))
    if not runs or any(r not in RUNS for r in runs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'all' or a comma-separated list of {', '.join(RUNS)}")
    return runs


def make_parser() -> argparse.ArgumentParser:
    """The example's command line (its defaults are the recorded runs' settings)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--arch",
        choices=tuple(ARCHS),
        default="qwen3",
        help="the transformer block: " + "; ".join(f"{name}: {what}" for name, what in ARCHS.items()),
    )
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="--arch llama/qwen3: key/value heads of the grouped-query attention (default: half of --heads)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="init and data seed, shared by every run")
    parser.add_argument(
        "--seeds", type=int, default=1, help="train every run with seeds --seed, --seed+1, ...: mean and spread"
    )
    parser.add_argument(
        "--moe",
        type=int,
        default=0,
        metavar="E",
        help="each block's MLP a mixture of E experts (top-2; default: dense)",
    )
    parser.add_argument(
        "--dispatch",
        choices=("ragged", "capacity"),
        default="ragged",
        help="--moe: grouped GEMMs over every routed token (ragged), or batched GEMMs over at most C tokens per "
        "expert, the rest dropped (capacity)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="--dispatch capacity: C = ceil(factor x tokens x top-k / E) slots per expert (default 1.25)",
    )
    parser.add_argument("--weight-blocks", choices=("16x16", "1x16"), default="16x16", help="NVFP4 weight blocks")
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="split each step's batch into N micro-batches and sum their gradients (lax.scan); each NVFP4 weight "
        "is quantized once per step (jax_nvfp4.flax.cache_weights) and read by every micro-batch",
    )
    parser.add_argument(
        "--runs",
        type=parse_runs,
        default=("full-keep-ends", "bf16"),
        help=f"comma-separated runs of {', '.join(RUNS)}, or 'all' (default: full-keep-ends,bf16, the recommended "
        "run: NVIDIA's full recipe with the first and last blocks in bf16)",
    )
    parser.add_argument(
        "--switch-at",
        type=float,
        default=None,
        metavar="F",
        help="a precision schedule: after this fraction of the steps, train on as --switch-to (same parameters and "
        "optimizer state)",
    )
    parser.add_argument(
        "--switch-to",
        choices=RUNS,
        default=None,
        help="--switch-at: the run (bf16 or a recipe) every other run switches to",
    )
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--out", default="train_lm.png", help="where to write the loss plot")
    parser.add_argument("--json", default=None, help="optionally, where to write the results as JSON")
    parser.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write each trained model to DIR/<run> (NVFP4 layers' weights quantized; orbax), for "
        "python -m examples.generate",
    )
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help="train sharded on a device mesh, e.g. data=2,fsdp=2,tensor=2 (axes not named: 1); the sizes' product "
        "must be the device count (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="train as N JAX processes over the --mesh devices (jax.distributed): alone, it launches N processes "
        "on this machine's CPU, each with mesh/N devices (gloo collectives), and shows process 0's output; with "
        "--process-id, this process is one of the N (one per host on a cluster)",
    )
    parser.add_argument(
        "--process-id", type=int, default=None, metavar="I", help="--processes N: join as process I (0 to N-1)"
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="--process-id: the address of the job's coordinator (process 0 serves it); 'auto': "
        "jax.distributed.initialize() reads the job from the cluster's environment (SLURM, Open MPI, Kubernetes)",
    )
    return parser


def check_processes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """What --processes, --process-id and --coordinator ask for: "launch" (start --processes local processes),
    "join" (be one process of the job) or "alone" (no jax.distributed); a parser error if they do not fit."""
    if args.coordinator == "auto":
        if args.process_id is not None or args.processes != 1:
            parser.error("--coordinator auto reads the processes from the cluster: no --processes or --process-id")
        return "join"
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if (args.process_id is None) != (args.coordinator is None):
        parser.error("--process-id and --coordinator HOST:PORT go together (or --coordinator auto alone)")
    if args.process_id is not None:
        if not 0 <= args.process_id < args.processes:
            parser.error(f"--process-id must be in [0, {args.processes}) for --processes {args.processes}")
        return "join"
    if args.processes == 1:
        return "alone"
    devices = math.prod(args.mesh.values()) if args.mesh else 0
    if not devices or devices % args.processes:
        parser.error(f"--processes {args.processes} needs a --mesh whose device count is a multiple of it")
    return "launch"


def main() -> None:
    made_by = provenance()  # at the start: the code that runs is the checkout's now, not at the end
    parser = make_parser()
    args = parser.parse_args()
    if args.d_model % args.heads or min(args.steps, args.eval_every, args.batch, args.seeds) < 1:
        parser.error("--d-model must be a multiple of --heads; --steps, --eval-every, --batch and --seeds at least 1")
    if args.arch == "gpt":
        if args.kv_heads is not None:
            parser.error("--kv-heads needs --arch llama or qwen3 (GPT-2's attention has a key/value head per head)")
    elif args.heads % kv_heads(args) or (args.d_model // args.heads) % 2:
        parser.error(
            f"--arch {args.arch}: --heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads(args)}) and "
            "the head width (--d-model / --heads) even, for RoPE"
        )
    if args.moe:
        unsupported = [n for n, on in (("--mesh", args.mesh), ("--save", args.save)) if on]
        unsupported += [f"the run {r}" for r in args.runs if r in RULE_RUNS]
        if unsupported:
            parser.error(f"--moe does not support {', '.join(unsupported)} yet")
        if args.moe < MOE_TOP_K:
            parser.error(f"--moe takes at least {MOE_TOP_K} experts (top-{MOE_TOP_K} routing)")
        if not (math.isfinite(args.capacity_factor) and args.capacity_factor > 0):
            parser.error(f"--moe --capacity-factor must be a positive number, got {args.capacity_factor}")
    elif args.dispatch != "ragged":
        parser.error("--dispatch needs --moe")
    if args.grad_accum < 1 or args.batch % args.grad_accum:
        parser.error(f"--grad-accum must be at least 1 and divide --batch {args.batch}, got {args.grad_accum}")
    if (args.switch_at is None) != (args.switch_to is None):
        parser.error("--switch-at and --switch-to go together")
    if args.switch_at is not None and (not 0 < args.switch_at < 1 or args.steps < 2):
        parser.error(f"--switch-at must be in (0, 1) with --steps at least 2, got {args.switch_at}")
    processes = check_processes(parser, args)
    if processes == "launch":  # this process only starts the others: it never touches jax's devices
        sys.exit(rerun_as_processes(sys.argv[1:], args.processes, math.prod(args.mesh.values()) // args.processes))
    if processes == "join":
        join(args.processes, args.process_id, args.coordinator)
    try:
        mesh = make_mesh(args.mesh, args) if args.mesh else None
    except ValueError as e:
        parser.error(f"--mesh {mesh_name(args.mesh)}: {e}")
    taken = [
        str(pathlib.Path(args.save) / run)
        for run in args.runs
        if args.save and (pathlib.Path(args.save) / run).exists()
    ]
    if taken:
        parser.error(f"--save {args.save}: {', '.join(taken)} exists already (remove it or save elsewhere)")
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {jax.default_backend()} ({device}), jax_nvfp4 {jax_nvfp4.__version__}")
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} local devices")
    if mesh is not None:
        d, f, t = args.mesh.values()
        print(f"mesh: {mesh}")
        print(
            f"sharded: batch {d * f}-way (data x fsdp), params and optimizer state {f}-way (fsdp), "
            f"attention heads and MLP {t}-way (tensor)"
        )

    shapes = jax.eval_shape(build_model("bf16", args).init, jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))
    n_params = sum(p.size for p in jax.tree.leaves(shapes))
    print(f"model: {n_params / 1e6:.2f}M params, {args.steps} steps of {args.batch}x{args.seq_len} bytes\n")

    t0 = time.perf_counter()
    by_seed = {}  # seed -> run -> results
    for seed in range(args.seed, args.seed + args.seeds):
        seed_args = argparse.Namespace(**{**vars(args), "seed": seed, "save": args.save if seed == args.seed else None})
        if args.seeds > 1:
            print(f"seed {seed}:")
        train_starts, data = prepare_data(seed_args)
        by_seed[seed] = {run: train(run, seed_args, train_starts, data, mesh) for run in args.runs}
    results = by_seed[args.seed]

    if args.seeds == 1:
        print("\n| run | recipe | train loss | val loss | val gap vs bf16 | ms/step |\n|---|---|---|---|---|---|")
        for run, r in results.items():
            gap = "-"
            if run != "bf16" and "bf16" in results:
                gap = f"{100 * (r['final_val_loss'] / results['bf16']['final_val_loss'] - 1):+.2f}%"
            losses = f"{r['final_train_loss']:.4f} | {r['final_val_loss']:.4f}"
            print(f"| {run} | {describe_result(run, r, args)} | {losses} | {gap} | {r['ms_per_step']:.1f} |")
    else:
        print_seed_table(by_seed, args)
        if jax.process_index() == 0:  # several processes: process 0 writes the files
            plot_seeds(by_seed, args)
    tail = max(1, args.steps // 10)
    print(f"\ntrain loss: mean of the last {tail} steps; total time {time.perf_counter() - t0:.0f}s")

    if jax.process_index() > 0:  # several processes: process 0 writes the files
        return
    if args.json:  # first: the results of a long run are kept whatever happens to the plot
        args_json = {**vars(args), "mesh": mesh_name(args.mesh)}
        out = {"made_by": made_by, "args": args_json, "results": results}
        if args.seeds > 1:
            out["results_by_seed"] = {str(seed): r for seed, r in by_seed.items()}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    plot(results, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
