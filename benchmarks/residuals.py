"""What one linear layer keeps for its backward pass: the residuals of ``jax.vjp``, NVFP4 against bf16.

Traces ``jax.vjp`` of ``jax_nvfp4.dot_general`` (the full recipe) and of ``lax.dot_general`` on x [M, K] . W [K, N]
with ``jax.eval_shape`` (nothing is computed or allocated) and lists the arrays the returned backward function
holds, which stay in memory from the forward pass to the backward one: for bf16 x and W themselves, for NVFP4 the
quantized copies the backward GEMMs read. With 16x16 weight blocks W's one rowwise copy is kept and transposed
for dgrad (issue 51); the table also gives what W's columnwise copy, which the recipe kept as well until then,
would add. And under a plain ``jax.checkpoint`` of the layer, what the rematerialized backward pass keeps:
bf16's x and W, NVFP4's x and W's quantized copy (saved under every policy; W itself is then not needed).

    python -m benchmarks.residuals [--shape 8192,4096,4096] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp
from jax import lax

import jax_nvfp4
from benchmarks.layer_breakdown import DENSE
from benchmarks.timing import Report


def residuals(dot, shape: tuple[int, int, int]) -> list[jax.ShapeDtypeStruct]:
    """The arrays ``jax.vjp(dot, x, W)``'s backward function holds (random keys left out), for bf16 x [M, K] and
    W [K, N]: their shapes and dtypes, traced without computing."""
    m, k, n = shape
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    held = jax.tree.leaves(jax.eval_shape(lambda x, w: jax.vjp(dot, x, w)[1], x, w))
    return [a for a in held if not jnp.issubdtype(a.dtype, jax.dtypes.prng_key)]


def nbytes(arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays)


def columnwise_weight_copy(shape: tuple[int, int, int]) -> int:
    """Bytes of W's columnwise 16x16-block copy (codes and scales): what keeping both copies added."""
    _, k, n = shape
    t = jax.eval_shape(
        lambda w: jax_nvfp4.quantize(w, rowwise=False, columnwise=True, block_2d=True),
        jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
    )
    return nbytes([t.data_t, t.scale_t])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192,4096,4096", help="M,K,N: x [M, K] . W [K, N]")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    m, k, n = shape
    key = jax.random.key(0)
    nvfp4 = residuals(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, rng_key=key), shape)
    bf16 = residuals(lambda x, w: lax.dot_general(x, w, DENSE), shape)
    both = nbytes(nvfp4) + columnwise_weight_copy(shape)
    checkpointed = [
        residuals(jax.checkpoint(lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, rng_key=key)), shape),
        residuals(jax.checkpoint(lambda x, w: lax.dot_general(x, w, DENSE)), shape),
    ]
    report = Report(
        args.out,
        [
            f"# One linear layer's residuals (what the backward pass keeps), {m} x {k} . {k} x {n}",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}; `python -m benchmarks.residuals --shape {args.shape}`: "
            "the arrays `jax.vjp`'s backward function holds (`jax.eval_shape`: traced, nothing computed), bf16 "
            "x and W, the full recipe (16x16 weight blocks). The same on any backend.",
            "",
            "| layer | shape | dtype | MB |",
            "|---|---|---|---:|",
        ],
    )
    for name, arrays in (("NVFP4", nvfp4), ("bf16", bf16)):
        for a in arrays:
            report.add(f"| {name} | {list(a.shape)} | {a.dtype} | {a.size * a.dtype.itemsize / 1e6:.2f} |")
    report.add("")
    report.add("| residuals | MB | x bf16's |")
    report.add("|---|---:|---:|")
    for label, size in (
        ("bf16 (x and W)", nbytes(bf16)),
        ("NVFP4 (x's columnwise copy, W's rowwise copy, their global amaxes)", nbytes(nvfp4)),
        ("NVFP4 with W's columnwise copy kept too (the recipe until issue 51)", both),
        ("under jax.checkpoint: bf16 (x and W)", nbytes(checkpointed[1])),
        ("under jax.checkpoint: NVFP4 (x, W's saved rowwise copy and its amax)", nbytes(checkpointed[0])),
    ):
        report.add(f"| {label} | {size / 1e6:.1f} | {size / nbytes(bf16):.2f} |")
    report.save()


if __name__ == "__main__":
    main()
