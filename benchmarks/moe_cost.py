"""The cost of a mixture-of-experts layer in NVFP4 against bf16: grouped (ragged) and capacity dispatch, one process.

One expert projection y = x W_g of M routed rows (top-1, so the active FLOPs are M K N), G experts W [G, K, N],
bf16 operands, the group sizes a multinomial draw of the M rows over G equally likely experts (fixed seed). Each
case runs forward + backward under ``jax.jit`` (``jax.grad`` of sum(y * dy) w.r.t. x and the weights, the full
recipe ``Recipe()`` with stochastic rounding, a fresh ``rng_key`` argument each call); the median of the timed
runs after one warm-up (compile) call, the cases of one G timed in interleaved rounds:

  1. NVFP4 ``jax_nvfp4.ragged_dot(x [M, K], W [G, K, N], group_sizes)`` (rows sorted by expert);
  2. bf16 ``lax.ragged_dot`` (bf16 result): the baseline of 1;
  3. NVFP4 capacity dispatch: the rows (in token order) scattered by ``moe.capacity_slots`` into a buffer
     [G, rows, K] (C = ``expert_capacity(M, 1, G, capacity_factor)`` slots, rows = ``buffer_rows(C)``), ONE
     batched ``jax_nvfp4.dot_general`` with the experts as batch axis, gathered back to [M, N] (dropped rows 0);
  4. bf16 capacity dispatch: the same with ``lax.dot_general`` (rows = C);
  5. dense NVFP4 ``jax_nvfp4.dot_general`` [M, K] x [K, N] (the same active FLOPs), and [G C, K] x [K, N] (the
     active FLOPs times the capacity factor: capacity dispatch's reference), and [G rows, K] x [K, N] (the rows
     NVFP4's capacity buffer really multiplies) and bf16 ``lax.dot_general`` [M, K] x [K, N], for reference.

Residual bytes: ``jax.vjp(jax.jit(f), x, w)`` (f with group sizes and key fixed) and the sum of ``nbytes`` over the
distinct arrays in ``jax.tree.leaves(vjp_fn)`` that the backward pass reads: what it keeps (including x or W
themselves where they are kept). Arrays ``vjp_fn`` holds that its backward jaxpr never reads after dead-code
elimination (capacity dispatch: the zero buffer of the scatter's JVP) are left out and listed apart. Of those
read, the arrays that change when W changes are the weights' own copies (W, its quantized copy); the rest (the
activations' copies, group sizes, slot indices, the key) are the activation residuals.

Writes ``benchmarks/results/moe-cost-<machine>.md`` (``--out`` to change; ``--quick``: G = 1, 4, 3 rounds, no
file unless ``--out``).

    python -m benchmarks.moe_cost [--experts 1,4,16,64] [--tokens 1024] [-k 256] [-n 256] [--repeats 21] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public API

import jax_nvfp4
from benchmarks.timing import Report, device_name
from jax_nvfp4.moe.dispatch import Routing, buffer_rows, capacity_slots, expert_capacity

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DENSE = (((1,), (0,)), ((), ()))
BATCHED = (((2,), (1,)), ((0,), (0,)))  # buffer [G, rows, K] . W [G, K, N] -> [G, rows, N]
RECIPE = jax_nvfp4.Recipe()

# Targets of the issue.
RAGGED_TARGET = 1.5  # NVFP4 ragged_dot / bf16 lax.ragged_dot, fwd + bwd, at G >= 4
RESIDUAL_TARGET = 1.2  # residual bytes of the grouped layer / the dense NVFP4 layer's
CAPACITY_TARGET = 1.3  # NVFP4 capacity dispatch / dense NVFP4 [G C, K] x [K, N], at G = 64


def machine() -> str:
    """The results files' machine name: backend, device, and on CPUs the cores (``cpu-amd-epyc-2core``)."""
    name = re.sub(r"[^a-z0-9]+", "-", device_name().lower()).strip("-")
    cores = f"-{os.cpu_count()}core" if jax.default_backend() == "cpu" else ""
    return f"{jax.default_backend()}-{name}{cores}"


def group_sizes_for(tokens: int, experts: int, seed: int) -> np.ndarray:
    """A multinomial draw of ``tokens`` rows over ``experts`` equally likely experts (sums to ``tokens``)."""
    return np.random.default_rng(seed).multinomial(tokens, np.full(experts, 1 / experts)).astype(np.int32)


def token_routing(sizes: np.ndarray, seed: int) -> Routing:
    """Top-1 routing of the tokens in token order with those group sizes (each token's expert a random
    permutation of the sorted assignment), in ``moe_dispatch.route``'s form."""
    experts = np.random.default_rng(seed + 1).permutation(np.repeat(np.arange(sizes.size), sizes))
    order = np.argsort(experts, kind="stable").astype(np.int32)
    tokens = experts.size
    return Routing(
        jnp.asarray(order),
        jnp.asarray(sizes),
        jnp.ones((tokens, 1), jnp.float32),
        jnp.float32(1),
        jnp.asarray(experts[:, None].astype(np.int32)),
    )


def capacity_projection(dot: Callable[..., jax.Array], routing: Routing, capacity: int, rows: int):
    """x [T, K] (token order), W [G, K, N] -> [T, N] by capacity dispatch: ``capacity_mlp``'s scatter, one batched
    ``dot`` (experts the batch axis) and its gather, one projection, no activation."""

    def f(x, w, key):
        experts = w.shape[0]
        slots = capacity_slots(routing, capacity, rows)
        buffer = jnp.zeros((experts * rows, x.shape[1]), x.dtype).at[slots.index].add(x, mode="drop")
        out = dot(buffer.reshape(experts, rows, -1), w, BATCHED, key)
        return out.reshape(experts * rows, -1).at[slots.index].get(mode="fill", fill_value=0)

    return f


def nvfp4_dot(lhs, rhs, dims, key):
    return jax_nvfp4.dot_general(lhs, rhs, dims, recipe=RECIPE, rng_key=key)


def bf16_dot(lhs, rhs, dims, key):
    del key
    return lax.dot_general(lhs, rhs, dims)


def cases(experts: int, tokens: int, k: int, n: int, factor: float, seed: int) -> tuple[dict, dict]:
    """name -> (f(x, w, key) -> y, x shape, w shape) for G experts, and the routing facts."""
    sizes = group_sizes_for(tokens, experts, seed)
    gs = jnp.asarray(sizes)
    routing = token_routing(sizes, seed)
    capacity = expert_capacity(tokens, 1, experts, factor)
    rows_nvfp4, rows_bf16 = buffer_rows(capacity, RECIPE), buffer_rows(capacity, None)
    x_shape, w_shape, dense_w = (tokens, k), (experts, k, n), (k, n)
    table = {
        "NVFP4 ragged_dot": (
            lambda x, w, key: jax_nvfp4.ragged_dot(x, w, gs, recipe=RECIPE, rng_key=key),
            x_shape,
            w_shape,
        ),
        "bf16 lax.ragged_dot": (lambda x, w, key: lax.ragged_dot(x, w, gs), x_shape, w_shape),
        "NVFP4 capacity": (capacity_projection(nvfp4_dot, routing, capacity, rows_nvfp4), x_shape, w_shape),
        "bf16 capacity": (capacity_projection(bf16_dot, routing, capacity, rows_bf16), x_shape, w_shape),
        "NVFP4 dense [M]": (nvfp4_dot_dense, x_shape, dense_w),
        "NVFP4 dense [G C]": (nvfp4_dot_dense, (experts * capacity, k), dense_w),
        "NVFP4 dense [G rows]": (nvfp4_dot_dense, (experts * rows_nvfp4, k), dense_w),
        "bf16 dense [M]": (lambda x, w, key: lax.dot_general(x, w, DENSE), x_shape, dense_w),
    }
    facts = {
        "sizes": sizes,
        "capacity": capacity,
        "rows": rows_nvfp4,
        "dropped": int(np.sum(np.maximum(sizes - capacity, 0))),
    }
    return table, facts


def nvfp4_dot_dense(x, w, key):
    return nvfp4_dot(x, w, DENSE, key)


def leaf_bytes(leaf) -> int:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return leaf.nbytes


def residual_bytes(f, x, w, key) -> tuple[int, int, int]:
    """(all, activation-only, unused) bytes of the residuals of ``jax.vjp(jax.jit(f), x, w)``.

    All: the distinct arrays of ``jax.tree.leaves(vjp_fn)`` that its backward pass reads (after dead-code
    elimination of its jaxpr); unused: the others, which ``vjp_fn`` holds but no backward computation reads (a
    jitted training step drops them). Activation-only: without the weights' own copies, the arrays that change
    when W does.
    """
    jf = jax.jit(f)
    dy = jax.eval_shape(jf, x, w, key)

    def residuals(w):
        _, vjp_fn = jax.vjp(lambda x, w: jf(x, w, key), x, w)
        leaves, treedef = jax.tree.flatten(vjp_fn)
        closed = jax.make_jaxpr(lambda leaves, dy: jax.tree.unflatten(treedef, leaves)(dy))(leaves, dy)
        jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
        _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        used = used[len(closed.jaxpr.constvars) : len(closed.jaxpr.constvars) + len(leaves)]
        read = {}  # id -> (array, read by the backward pass): distinct arrays, in order
        for leaf, used_here in zip(leaves, used, strict=True):
            read[id(leaf)] = (leaf, read.get(id(leaf), (leaf, False))[1] or used_here)
        return [a for a, r in read.values() if r], [a for a, r in read.values() if not r]

    (leaves, dead), (other, _) = residuals(w), residuals(w * 2 + 1)
    if [(a.shape, a.dtype) for a in leaves] != [(a.shape, a.dtype) for a in other]:
        raise RuntimeError("the residuals' structure depends on W's values")
    total = sum(leaf_bytes(a) for a in leaves)
    weights = sum(leaf_bytes(a) for a, b in zip(leaves, other, strict=True) if _bits(a) != _bits(b))
    return total, total - weights, sum(leaf_bytes(a) for a in dead)


def _bits(a) -> bytes:
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a).tobytes()


def step_times(cases: dict, repeats: int, seed: int) -> dict[str, float]:
    """Median seconds of each case's jitted fwd + bwd (grads of sum(y * dy) w.r.t. x and w), a fresh key each call.

    ``cases``: name -> (f, x, w, dy). One warm-up (compile) call each, then ``repeats`` rounds that time every case
    once in turn, so that the drift of a shared machine falls on all cases alike (one ``median_seconds`` per case
    measured the same shape up to 1.4x apart here).
    """
    keys = list(jax.random.split(jax.random.key(seed), repeats + 1))
    jax.block_until_ready(keys)
    steps = {
        name: (jax.jit(jax.grad(lambda x, w, dy, key, f=f: jnp.sum(f(x, w, key) * dy), (0, 1))), (x, w, dy))
        for name, (f, x, w, dy) in cases.items()
    }
    for name, (step, args) in steps.items():
        jax.block_until_ready(step(*args, keys[0]))
        print(f"  compiled {name}", flush=True)
    times = {name: [] for name in steps}
    for key in keys[1:]:
        for name, (step, args) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*args, key))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def fmt_bytes(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def verdict(value: float, target: float) -> str:
    """met / missed, and by how much (the margin relative to the target)."""
    if value <= target:
        return f"met ({value:.2f}x <= {target}x, {(1 - value / target) * 100:.0f}% under)"
    return f"missed ({value:.2f}x > {target}x, {(value / target - 1) * 100:.0f}% over)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", help="G values, comma separated (default 1,4,16,64; --quick: 1,4)")
    parser.add_argument("--tokens", type=int, default=1024, help="M: routed rows (top-1)")
    parser.add_argument("-k", type=int, default=256, help="K: the contracted features")
    parser.add_argument("-n", type=int, default=256, help="N: the output features")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeats", type=int, help="timed rounds (default 21; --quick: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="G = 1, 4 and 3 rounds; writes no file unless --out")
    parser.add_argument("--out", help="the markdown report's file (default results/moe-cost-<machine>.md)")
    args = parser.parse_args()
    args.experts = args.experts or ("1,4" if args.quick else "1,4,16,64")
    args.repeats = args.repeats or (3 if args.quick else 21)
    out = args.out or (None if args.quick else str(RESULTS / f"moe-cost-{machine()}.md"))
    experts_list = [int(g) for g in args.experts.split(",")]
    m, k, n, factor = args.tokens, args.k, args.n, args.capacity_factor

    command = " ".join(["python -m benchmarks.moe_cost", *sys.argv[1:]])
    report = Report(
        out,
        [
            f"# Mixture-of-experts layer cost, NVFP4 vs bf16: {device_name()} ({jax.default_backend()})",
            "",
            f"{datetime.date.today()}, {os.cpu_count()} cores, jax {jax.__version__}; `{command}`: M = {m} routed "
            f"rows (top-1: active FLOPs M K N), K = {k}, N = {n}, bf16 operands, capacity factor {factor}, all in one "
            f"process. Each time: forward + backward under `jax.jit` (`jax.grad` of sum(y * dy) w.r.t. x and W), "
            f"median of {args.repeats} rounds after one warm-up call (each round times every case of a G once, in "
            "turn); NVFP4 = `Recipe()` (16x16 weight blocks, RHT, "
            "stochastic rounding) with a fresh `rng_key` argument each call. Group sizes: a multinomial draw of the "
            f"M rows over G equally likely experts (numpy `default_rng({args.seed})`).",
            "",
            "Cases: **NVFP4 ragged_dot** `jax_nvfp4.ragged_dot(x [M, K], W [G, K, N], group_sizes)`; **bf16 "
            "lax.ragged_dot** the same with `lax.ragged_dot` (bf16 operands, bf16 result, `preferred_element_type` "
            "left None): the baseline; **capacity** the rows (token order, each token's expert a random permutation "
            "of the sorted assignment) scattered by `moe.capacity_slots` into [G, rows, K] (C = "
            "`expert_capacity(M, 1, G, f)`, rows = `buffer_rows(C)`: C rounded up to 16 in NVFP4, C in bf16), ONE "
            "batched `dot_general` (experts the batch axis, NVFP4 `jax_nvfp4.dot_general` or bf16 `lax.dot_general`)"
            " and gathered back (rows beyond C dropped, output 0); **dense [M]** one `jax_nvfp4.dot_general` "
            "[M, K] x [K, N] (same active FLOPs); **dense [G C]** [G C, K] x [K, N] (active FLOPs x capacity "
            "factor, capacity's reference); **dense [G rows]** [G rows, K] x [K, N] (the rows NVFP4's buffer "
            "multiplies); **bf16 dense [M]** `lax.dot_general` [M, K] x [K, N]. The ragged cases take x already "
            "sorted by expert; the capacity cases include their scatter and gather.",
            "",
            "Residuals: `jax.vjp(jax.jit(f), x, W)` (group sizes and key fixed), the sum of `nbytes` over the distinct"
            " arrays of `jax.tree.leaves(vjp_fn)` that the backward pass reads (x or W counted where kept themselves;"
            " arrays `vjp_fn` holds but its jaxpr, after dead-code elimination, never reads are left out and listed "
            "under the table). **act.** = without the "
            "weights' own copies (the arrays that change when W does: W, its quantized columnwise copy): the "
            "activations' copies, group sizes, slot indices, the key. The ratios are to the dense NVFP4 [M] layer's "
            "(total to total, act. to act.).",
            "",
        ],
    )
    if jax.default_backend() == "cpu":
        report.add(
            "On the CPU backend `lax.ragged_dot` lowers to a dense batched dot over all G groups (each group's rows "
            "masked from the whole [M, K]: G times the active FLOPs), and `jax_nvfp4.ragged_dot` runs its GEMMs "
            "through `lax.ragged_dot` of the decoded blocks, so both ragged cases pay that; the NVFP4 GEMMs are "
            "emulated (blocks decoded to bf16)."
        )
        report.add("")

    key = jax.random.key(args.seed)
    results = {}
    for experts in experts_list:
        table, facts = cases(experts, m, k, n, factor, args.seed)
        sizes = facts["sizes"]
        inputs = {}
        for index, (name, (f, x_shape, w_shape)) in enumerate(table.items()):
            kx, kw, kd = jax.random.split(jax.random.fold_in(key, index), 3)
            x = jax.random.normal(kx, x_shape, jnp.bfloat16)
            w = (jax.random.normal(kw, w_shape, jnp.float32) * k**-0.5).astype(jnp.bfloat16)
            dy = jax.random.normal(kd, (x_shape[0], n), jnp.bfloat16)
            inputs[name] = (f, x, w, dy)
        print(f"G={experts}: timing {len(inputs)} cases, {args.repeats} interleaved rounds", flush=True)
        seconds = step_times(inputs, args.repeats, args.seed)
        rows = {}
        for name, (f, x, w, _) in inputs.items():
            total, act, dead = residual_bytes(f, x, w, jax.random.key(args.seed + 1))
            rows[name] = (seconds[name], total, act, dead)
            print(
                f"  G={experts} {name}: {seconds[name] * 1e3:.2f} ms, residuals {total:,} B ({act:,} B act., "
                f"{dead:,} B unused)",
                flush=True,
            )
        results[experts] = rows
        base, dense = rows["bf16 lax.ragged_dot"], rows["NVFP4 dense [M]"]
        shown = sizes if sizes.size <= 16 else f"min {sizes.min()}, max {sizes.max()}, std {sizes.std():.1f}"
        report.add(f"## G = {experts}")
        report.add("")
        report.add(
            f"Group sizes: {np.array2string(sizes, separator=', ') if sizes.size <= 16 else shown}; C = "
            f"{facts['capacity']} slots, NVFP4 buffer rows {facts['rows']} (G rows = {experts * facts['rows']}, "
            f"G C = {experts * facts['capacity']}), {facts['dropped']} of {m} rows dropped by capacity dispatch."
        )
        report.add("")
        report.add(
            "| case | ms | / bf16 ragged | / NVFP4 dense [M] | residuals | act. residuals | residuals / dense "
            "| act. / dense act. |"
        )
        report.add("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, (seconds, total, act, _) in rows.items():
            report.add(
                f"| {name} | {seconds * 1e3:.2f} | {seconds / base[0]:.2f}x | {seconds / dense[0]:.2f}x | "
                f"{fmt_bytes(total)} | {fmt_bytes(act)} | {total / dense[1]:.2f}x | {act / dense[2]:.2f}x |"
            )
        unused = [f"{name} {r[3]:,} B" for name, r in rows.items() if r[3]]
        if unused:
            report.add("")
            report.add(f"Unused (held by `vjp_fn`, never read, not counted): {', '.join(unused)}.")
        report.add("")

    report.add("## Targets")
    report.add("")
    for experts in experts_list:
        if experts < 4:
            continue
        rows = results[experts]
        ratio = rows["NVFP4 ragged_dot"][0] / rows["bf16 lax.ragged_dot"][0]
        report.add(
            f"- NVFP4 ragged_dot fwd+bwd <= {RAGGED_TARGET}x bf16 lax.ragged_dot, G = {experts}: "
            f"{verdict(ratio, RAGGED_TARGET)}"
        )
    for kind, index in (("total", 1), ("activation-only", 2)):
        ratios = {g: r["NVFP4 ragged_dot"][index] / r["NVFP4 dense [M]"][index] for g, r in results.items()}
        per_g = ", ".join(f"G = {g}: {v:.2f}x" for g, v in ratios.items())
        worst = max(ratios, key=ratios.get)
        report.add(
            f"- residual memory of NVFP4 ragged_dot <= {RESIDUAL_TARGET}x the dense NVFP4 layer's, {kind} ({per_g}): "
            f"worst G = {worst}, {verdict(ratios[worst], RESIDUAL_TARGET)}"
        )
    if 64 in results:
        rows = results[64]
        ratio = rows["NVFP4 capacity"][0] / rows["NVFP4 dense [G C]"][0]
        report.add(
            f"- NVFP4 capacity dispatch at G = 64 <= {CAPACITY_TARGET}x dense NVFP4 [G C, K] x [K, N]: "
            f"{verdict(ratio, CAPACITY_TARGET)} (against dense [G rows]: "
            f"{rows['NVFP4 capacity'][0] / rows['NVFP4 dense [G rows]'][0]:.2f}x)"
        )
    else:
        report.add("- NVFP4 capacity dispatch at G = 64: not measured (G = 64 not in --experts)")
    report.save()
    if out:
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
