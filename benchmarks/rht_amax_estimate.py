"""How well the post-RHT amax estimate matches the true post-RHT amax, on the example's tensors.

``Recipe(rht_amax_estimate=True)`` scales the Random-Hadamard-transformed
wgrad copies of x and dy with amax(x) * factor (2 for x, 1 for dy) instead of
a pass that computes the transform's own amax. The transform of 16 values is
orthonormal, so the true ratio amax(RHT x) / amax(x) lies in [1/4, 4]:

- an estimate below the true amax (under-shoot) clips: block scales above the
  E4M3 range saturate, so the largest values of those blocks are cut;
- an estimate above it (over-shoot) wastes range: every block scale is smaller
  than it could be, and small blocks lose precision in E4M3's subnormals.

This trains the example's model (``python -m examples.train_lm``) with the full NVFP4 recipe and,
at each evaluation, takes the inputs x and output gradients dy of every NVFP4
layer on that step's batch. For each it reports the ratio, which way the
estimate misses, and the quantization error of the transformed copy with the
estimate relative to the error with the true amax.

    python -m benchmarks.rht_amax_estimate [--steps 1400] [--eval-every 200] [--report results.md]
"""

from __future__ import annotations

import collections
import datetime
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_nvfp4
from benchmarks.timing import Report, device_name
from examples.lm.data import prepare_data, windows
from examples.lm.model import RECIPES, build_model
from examples.lm.training import train
from examples.train_lm import make_parser
from jax_nvfp4 import reference
from jax_nvfp4.flax import RNG_STREAM, NVFP4DotGeneral


def tap(next_fun, args, kwargs, context):
    """Flax interceptor: record each NVFP4 GEMM's lhs (x) and make its output perturbable (for dy)."""
    if context.method_name == "__call__" and isinstance(context.module, NVFP4DotGeneral):
        context.module.sow("intermediates", "x", args[0])
        return context.module.perturb("dy", next_fun(*args, **kwargs))
    return next_fun(*args, **kwargs)


def layer_tensors(model: nn.Module, params, batch: jax.Array, key: jax.Array) -> dict[tuple[str, str], jax.Array]:
    """{(layer, "x" | "dy"): [tokens, features]} of every NVFP4 layer for one batch."""
    tokens, rngs = batch[:, :-1], {RNG_STREAM: key}
    with nn.intercept_methods(tap):
        _, zero = model.apply({"params": params}, tokens, rngs=rngs, mutable=["perturbations"])

        def loss(perturbations):
            logits, taps = model.apply(
                {"params": params, **perturbations}, tokens, rngs=rngs, mutable=["intermediates"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), taps

        grads, taps = jax.grad(loss, has_aux=True)(zero)
    out = {}
    for kind, tree in (("x", taps["intermediates"]), ("dy", grads["perturbations"])):
        for path, value in jax.tree_util.tree_leaves_with_path(tree):
            names = [getattr(p, "key", None) for p in path]
            layer = "/".join(n for n in names if isinstance(n, str) and n not in ("x", "dy", "NVFP4DotGeneral_0"))
            # x keeps the token axes in front and its contracted axes last in every layer of this model.
            out[(layer, kind)] = value.reshape(batch.shape[0] * tokens.shape[1], -1)
    return out


def rht_copy(x: jax.Array) -> jax.Array:
    """The transformed columnwise copy [features, tokens] the wgrad GEMM quantizes (the spec's transform)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)[None]
    return jax.lax.bitcast_convert_type(reference.rht_columns(bits, x.dtype)[0], jnp.float32).astype(x.dtype)


def relative_error(z: jax.Array, amax: jax.Array) -> jax.Array:
    """Squared quantization error of z (rowwise 1x16, global amax ``amax``) over the squared norm of z."""
    z32 = z.astype(jnp.float32)
    err = jax_nvfp4.dequantize(jax_nvfp4.quantize(z, amax=amax)) - z32
    return jnp.sum(err * err) / jnp.sum(z32 * z32)


@functools.partial(jax.jit, static_argnums=1)
def measure(x: jax.Array, factor: float) -> dict[str, jax.Array]:
    """Pre-RHT amax, true and estimated post-RHT amax of x's wgrad copy, and the copy's error with each."""
    true = jax_nvfp4.quantize(x, rowwise=False, columnwise=True, rht=True).amax_t
    estimate = jax_nvfp4.quantize(x, rowwise=False, columnwise=True, rht=True, rht_amax_factor=factor).amax_t
    z = rht_copy(x)
    return {
        "pre": jax_nvfp4.amax(x),
        "true": true,
        "estimate": estimate,
        "z_amax": jnp.max(jnp.abs(z.astype(jnp.float32))),
        "error_ratio": relative_error(z, estimate) / relative_error(z, true),
    }


def summarize(m: dict[str, jax.Array]) -> dict[str, float]:
    m = {k: float(v) for k, v in m.items()}
    assert m["z_amax"] == m["true"]  # the spec's transform is the kernel's
    return {
        "ratio": m["true"] / m["pre"],
        "under": m["estimate"] < m["true"],
        "over": m["estimate"] > m["true"],
        "error_ratio": m["error_ratio"],
    }


def main() -> None:
    parser = make_parser()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--report", help="also write the markdown report to this file")
    args = parser.parse_args()
    recipe = RECIPES["full"]
    factors = {"x": recipe.rht_amax_factor_x, "dy": recipe.rht_amax_factor_dy}
    train_starts, data = prepare_data(args)
    model = build_model("full", args)
    rows = collections.defaultdict(list)
    tensors_fn = jax.jit(lambda p, b, k: layer_tensors(model, p, b, k))

    def on_eval(step: int, params) -> None:
        batch = jnp.asarray(windows(data["train"], train_starts[step - 1], args.seq_len))
        for (layer, kind), x in tensors_fn(params, batch, jax.random.key(step)).items():
            rows[kind].append({"step": step, "layer": layer, **summarize(measure(x, factors[kind]))})

    train("full", args, train_starts, data, on_eval=on_eval)
    report = Report(
        args.report,
        [
            f"# Post-RHT amax estimate vs the true post-RHT amax: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, `python -m benchmarks.rht_amax_estimate "
            f"--steps {args.steps} --eval-every {args.eval_every}`: the example's model (d_model {args.d_model}, "
            f"{args.layers} layers) trained with the full recipe; at each evaluation, x and dy of each of its "
            f"{len(rows['x']) // max(1, len({r['step'] for r in rows['x']}))} NVFP4 layers on that step's batch "
            f"({args.batch}x{args.seq_len} tokens). Ratio = true post-RHT amax / pre-RHT amax; error = squared "
            "quantization error of the transformed copy scaled by the estimate over that with the true amax.",
            "",
            "| tensor | factor | tensors | under-shoots | over-shoots | exact | ratio min / median / max "
            "| error ratio median / max |",
            "|---|---|---|---|---|---|---|---|",
        ],
    )
    for kind, factor in factors.items():
        r = rows[kind]
        ratio = np.array([m["ratio"] for m in r])
        err = np.array([m["error_ratio"] for m in r])
        under, over = sum(m["under"] for m in r), sum(m["over"] for m in r)
        report.add(
            f"| {kind} | {factor:g} | {len(r)} | {under} ({100 * under / len(r):.0f}%) | {over} "
            f"({100 * over / len(r):.0f}%) | {len(r) - under - over} | {ratio.min():.3f} / {np.median(ratio):.3f} / "
            f"{ratio.max():.3f} | {np.median(err):.3f} / {err.max():.3f} |"
        )
    report.add("")
    report.add("Per step (median ratio over the layers; under-shoots / tensors):")
    report.add("")
    steps = sorted({m["step"] for m in rows["x"]})
    report.add("| step | " + " | ".join(str(s) for s in steps) + " |")
    report.add("|---|" + "---|" * len(steps))
    for kind in factors:
        cells = []
        for s in steps:
            at = [m for m in rows[kind] if m["step"] == s]
            cells.append(f"{np.median([m['ratio'] for m in at]):.2f} ({sum(m['under'] for m in at)}/{len(at)})")
        report.add(f"| {kind} | " + " | ".join(cells) + " |")
    report.save()


if __name__ == "__main__":
    main()
