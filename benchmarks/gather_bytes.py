"""All-gather bytes of the example's sharded training step, NVFP4 against bf16, read from the compiled HLO.

Compiles one training step (loss and gradients) of the training example's
model (``examples.lm``) on a device mesh, for both precisions, and sums the bytes each
all-gather moves per layer (the layer is read from the ``op_name`` XLA keeps
for each collective). Counting bytes in HLO is exact and machine-independent,
so this needs no timing. On CPU, ``--devices`` host devices are made.

XLA on CPU gathers the bf16 model's weights as f32 (it gathers the f32
parameter and casts after); the table shows those bytes and, as "bf16", the
2 bytes a value a bf16 gather moves.

    python -m benchmarks.gather_bytes [--mesh data=2,fsdp=2,tensor=2] [--out results.md]
"""

from __future__ import annotations

import argparse
import os
import re

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mesh", default="data=2,fsdp=2,tensor=2", help="as python -m examples.train_lm --mesh")
parser.add_argument("--devices", type=int, default=8, help="host devices to make on CPU")
parser.add_argument("--out", help="also write the markdown report to this file")
ARGS = parser.parse_args()
# Before jax starts: the CPU backend reads its device count once.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.devices}"

import collections  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.timing import Report, device_name  # noqa: E402
from examples.lm.mesh import BATCH, make_mesh, parse_mesh, sharded_params  # noqa: E402
from examples.lm.model import build_model, next_byte_loss  # noqa: E402
from jax_nvfp4.sharding.hlo import collectives  # noqa: E402

# The module path inside the model (block0/mlp_up, head, ...) of the op a collective came from.
_LAYER = re.compile(r"TransformerLM\)+/((?:block\d+/)?[A-Za-z_0-9]+)")


def layer_of(op_name: str) -> str:
    """The layer of an op (``jit(f)/transpose(jvp(TransformerLM))/block0/mlp_up/...`` -> ``block0/mlp_up``); a
    parameter gathered before any use is named by its path."""
    match = _LAYER.search(op_name)
    return match.group(1) if match else op_name.replace("\\'", "'")


def gathered_bytes(
    precision: str, args: argparse.Namespace, mesh: jax.sharding.Mesh
) -> tuple[dict[str, dict[str, int]], int]:
    """{layer: {dtype: bytes}} of the all-gathers in one compiled training step, and its temporary bytes per
    device (XLA's memory analysis: activations, residuals, gathered weights)."""
    model = build_model(precision, args, mesh)
    init = lambda: model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]  # noqa: E731
    params = sharded_params(init, mesh)

    batch = jax.device_put(jnp.zeros((args.batch, args.seq_len + 1), jnp.int32), NamedSharding(mesh, P(BATCH)))
    compiled = jax.jit(jax.value_and_grad(functools.partial(next_byte_loss, model))).lower(params, batch).compile()
    found: dict[str, dict[str, int]] = collections.defaultdict(collections.Counter)
    for c in collectives(compiled.as_text()):
        if c.op == "all-gather":
            found[layer_of(c.op_name)][c.dtype] += c.nbytes
    return found, compiled.memory_analysis().temp_size_in_bytes


def as_bf16(by_dtype: dict[str, int]) -> int:
    """The float gathers' bytes at 2 a value (XLA on CPU moves bf16 values as f32)."""
    return sum(n // {"f32": 2, "bf16": 1}[d] for d, n in by_dtype.items() if d in ("f32", "bf16"))


def main() -> None:
    args = argparse.Namespace(
        batch=8, seq_len=128, d_model=128, layers=4, heads=4, weight_blocks="16x16", mesh=parse_mesh(ARGS.mesh)
    )
    mesh = make_mesh(args.mesh, args)
    (nvfp4, nvfp4_temp), (bf16, bf16_temp) = gathered_bytes("plain", args, mesh), gathered_bytes("bf16", args, mesh)
    report = Report(
        ARGS.out,
        [
            f"# All-gather bytes of a sharded training step: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, mesh {ARGS.mesh}, `python -m benchmarks.gather_bytes`.",
            f"Model of the training example, `python -m examples.train_lm` (d_model {args.d_model}, {args.layers} "
            f"layers, batch {args.batch}x{args.seq_len}, NVFP4 plain recipe with 16x16 weight blocks); loss and "
            "gradients, from the compiled HLO.",
            "NVFP4 u8 = the packed codes and E4M3 scales of quantized weights; float = the weights that are not",
            "quantized (norms, biases, embeddings, head), counted for both models at 2 bytes a value as bf16 gathers",
            "move them (XLA on CPU moves them as f32, twice that: the last line).",
            "",
            "| layer | NVFP4 model: u8 | NVFP4 model: float | NVFP4 model | bf16 model | NVFP4 / bf16 |",
            "|---|---:|---:|---:|---:|---:|",
        ],
    )
    totals = [0, 0, 0, 0]
    for layer in sorted(set(nvfp4) | set(bf16)):
        q, b = nvfp4.get(layer, {}), bf16.get(layer, {})
        if set(q) - {"u8", "f32", "bf16"} or set(b) - {"f32", "bf16"}:
            raise RuntimeError(f"{layer}: unexpected gather dtypes {dict(q)} {dict(b)}")
        row = [q.get("u8", 0), as_bf16(q), q.get("u8", 0) + as_bf16(q), as_bf16(b)]
        totals = [t + r for t, r in zip(totals, row, strict=True)]
        report.add(f"| {layer} | " + " | ".join(f"{n:,}" for n in row) + f" | {row[2] / row[3]:.0%} |")
    report.add("| **step** | " + " | ".join(f"**{n:,}**" for n in totals) + f" | **{totals[2] / totals[3]:.0%}** |")
    cpu = [sum(sum(by_dtype.values()) for by_dtype in m.values()) for m in (nvfp4, bf16)]
    cpu_row = f"{cpu[0]:,} | {cpu[1]:,} | {cpu[0] / cpu[1]:.0%} |"
    report.add("| step, bytes XLA on CPU moves (floats as f32) | | | " + cpu_row)
    report.add("")
    report.add(
        f"Temporary memory of the step per device (XLA's memory analysis: activations, residuals, gathered "
        f"weights): NVFP4 {nvfp4_temp:,} B, bf16 {bf16_temp:,} B."
    )
    report.save()


if __name__ == "__main__":
    main()
