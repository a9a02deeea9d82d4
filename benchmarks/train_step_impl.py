"""A training step of the example's transformer: NVFP4 GEMMs emulated, through lax.scaled_dot, and bf16.

The model of the training example (``examples.lm``; its NVFP4 layers with the full recipe, ``jax_nvfp4.Recipe()``) at
the given size: one jitted step (loss, gradients, SGD update) with ``Recipe(impl="emulated")`` (the blocks dequantized
to bf16 for a bf16 dot), with ``impl="scaled_dot"`` (``lax.scaled_dot`` on float4_e2m1fn codes: the FP4 tensor
cores on Blackwell, decomposed by XLA elsewhere), on a GPU with ``impl="fused"`` (the Pallas GEMM decoding the
packed operands in its tiles), and with bf16 layers, all in one process, and the ratios against bf16.
``impl="auto"`` picks the first on this machine as the table says. Prints a markdown table; ``--out FILE`` also
writes it there.

``--target b200`` (or another ``benchmarks.offline_gpu`` target) runs nothing: it compiles the bf16 step and the
NVFP4 one (``impl="auto"``, decided for that GPU) for that GPU offline and counts them instead, kernel by kernel
(``benchmarks.layer_breakdown``): kernels, bytes, the GEMMs whose PTX runs FP4 MMAs, and the roofline model's time
(``benchmarks.roofline``).

    python -m benchmarks.train_step_impl [--d-model 2048] [--layers 2] [--batch 8] [--seq-len 512] [--repeats 5]
                                         [--target b200]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline
from benchmarks.layer_breakdown import category, dumped_mmas, kernels, mma_label, ptx_dump
from benchmarks.offline_gpu import TARGETS, target, target_of
from benchmarks.timing import Report, commit, device_name, median_seconds
from examples.lm.data import VOCAB
from examples.lm.model import TransformerLM, build_model, next_byte_loss
from jax_nvfp4.linear.block_sum import resolve_impl


def model_for(variant: str, args: argparse.Namespace) -> TransformerLM:
    """The example's model with bf16 layers or NVFP4 layers (full recipe) whose GEMMs run as ``variant``."""
    if variant == "bf16":
        return build_model("bf16", args)
    return build_model("full", args, impl=variant)


def step_fn(model: TransformerLM, lr: float = 1e-3):
    """A jitted SGD step: (params, batch, key) -> (new params, loss)."""
    loss_fn = functools.partial(next_byte_loss, model)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", choices=tuple(TARGETS), help="compile for this GPU offline and model it")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    args.weight_blocks = "16x16"
    if args.target:
        return offline(args)

    tokens = args.batch * args.seq_len
    gpu = target_of(device_name()) if jax.default_backend() == "gpu" else None  # the roofline model's GPU
    report = Report(
        args.out,
        [
            f"# Training step of the example model, by GEMM implementation: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, {os.cpu_count()} cores, jax {jax.__version__}; `python -m "
            f"benchmarks.train_step_impl --d-model {args.d_model} --layers {args.layers} --heads {args.heads} "
            f"--batch {args.batch} --seq-len {args.seq_len}` ({tokens} tokens a step, SGD), median of "
            f"{args.repeats}, all in one process. NVFP4: the full recipe (RHT, stochastic rounding, 16x16 weight "
            f'blocks) in every linear layer of the blocks; embeddings and head bf16. `impl="auto"` resolves to '
            f"`{resolve_impl('auto', 'benchmark')}` here."
            + (
                f" Model: `benchmarks.roofline` on the compiled step with the {gpu.device_kind}'s published figures "
                f"({gpu.source}); a model, not a timing."
                if gpu
                else ""
            ),
            "",
            f"| layers' GEMMs | ms/step | tokens/s | x bf16 |{' modeled ms |' if gpu else ''}",
            f"|---|---:|---:|---:|{'---:|' if gpu else ''}",
        ],
    )
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.seq_len + 1)), jnp.int32)
    key = jax.random.key(1)
    times = {}
    # The fused GEMM runs in Pallas's interpret mode off a GPU: far too slow to time there.
    impls = ("emulated", "scaled_dot", "fused") if jax.default_backend() == "gpu" else ("emulated", "scaled_dot")
    for variant in ("bf16", *impls):
        model = model_for(variant, args)
        params = jax.jit(model.init)(jax.random.key(0), batch[:1, :-1])["params"]
        step = step_fn(model)
        state = {"params": params}

        def run(state=state, step=step):
            state["params"], loss = step(state["params"], batch, key)
            return loss

        times[variant] = median_seconds(run, repeats=args.repeats)
        ms = 1e3 * times[variant]
        name = "bf16 (nn.Dense, nn.DenseGeneral)" if variant == "bf16" else f'NVFP4, impl="{variant}"'
        model_ms = ""
        if gpu:
            hlo = step.lower(state["params"], batch, key).compile().as_text()
            model_ms = f" {sum(roofline.modeled(hlo, gpu).values()) * 1e3:.3f} |"
        ratio = times[variant] / times["bf16"]
        report.add(f"| {name} | {ms:.1f} | {tokens / times[variant]:,.0f} | {ratio:.2f} |{model_ms}")
    faster = min(impls, key=times.get)
    report.add("")
    report.add(f"Faster NVFP4 GEMM here: `{faster}` ({times[faster] / times['bf16']:.2f}x the bf16 step).")
    report.save()


def offline(args: argparse.Namespace) -> None:
    """The bf16 and NVFP4 steps compiled for ``args.target`` offline: counted and modeled, not run."""
    import shutil

    from benchmarks.offline_gpu import compile_for, prepare

    dump = ptx_dump()
    prepare()
    gpu = target(args.target)
    tokens = args.batch * args.seq_len
    report = Report(
        args.out,
        [
            f"# Training step of the example model, compiled offline for the {gpu.device_kind}: counted and modeled",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, commit {commit()}; `python -m benchmarks.train_step_impl "
            f"--d-model {args.d_model} --layers {args.layers} --heads {args.heads} --batch {args.batch} --seq-len "
            f"{args.seq_len} --target {args.target}` ({tokens} tokens a step, SGD): compiled for the {gpu.device_kind} "
            "(sm_" + ".".join(map(str, gpu.capability)) + ") with no GPU attached (XLA's untuned GEMM configs); "
            'nothing runs. NVFP4: the full recipe in every linear layer of the blocks, `impl="auto"`; embeddings '
            "and head bf16. Bytes: each kernel's operands read once and its result written once. FP4 GEMMs: the "
            "GEMM kernels whose PTX holds a `kind::mxf4nvf4` MMA. Model: `benchmarks.roofline` with the published "
            f"figures ({gpu.source}); a model, not a timing.",
            "",
            "| step | kernels | GEMM kernels | FP4 GEMMs | GB moved | modeled ms | x bf16 |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ],
    )
    batch = jnp.zeros((args.batch, args.seq_len + 1), jnp.int32)
    modeled = {}
    for variant in ("bf16", "auto"):
        model = model_for(variant, args)
        params = jax.eval_shape(model.init, jax.random.key(0), batch[:1, :-1])["params"]
        key = jax.eval_shape(lambda: jax.random.key(1))
        with compile_for(args.target) as on_gpu:
            args_ = jax.tree.map(lambda a: on_gpu(a.shape, a.dtype), (params, batch, key))
            hlo = step_fn(model).trace(*args_).lower().compile().as_text()
        found, mma = kernels(hlo, gpu=True), dumped_mmas(dump)
        gemms = [k for k in found if category(k) == "GEMM" and roofline.dots(hlo).get(k.name)]
        fp4 = [k for k in gemms if "mxf4nvf4" in mma_label(k, mma)]
        modeled[variant] = sum(roofline.modeled(hlo, gpu, mma).values())
        name = "bf16 (nn.Dense, nn.DenseGeneral)" if variant == "bf16" else 'NVFP4, impl="auto"'
        moved = sum(k.read + k.written for k in found) / 1e9
        report.add(
            f"| {name} | {len(found)} | {len(gemms)} | {len(fp4)} | {moved:.2f} | {modeled[variant] * 1e3:.3f} | "
            f"{modeled[variant] / modeled['bf16']:.2f} |"
        )
    shutil.rmtree(dump)
    report.save()


if __name__ == "__main__":
    main()
