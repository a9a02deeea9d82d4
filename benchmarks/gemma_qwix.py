"""Google DeepMind's Gemma (``gemma.gm.nn.Transformer``, unmodified) trained in NVFP4 through our Qwix provider.

A tiny Gemma 3-style transformer from the ``gemma`` library (a linen model whose modules call ``jnp.einsum``
themselves: ``q_einsum``, ``kv_einsum``, ``attn_vec_einsum``, the MLP's ``gating_einsum`` and ``linear``) is
converted with ``qwix.quantize_model(model, jax_nvfp4.qwix.NVFP4Provider(rules))``, the tied embedding / LM head
(gemma's ``Embedder``: a gather, and ``jnp.dot(x, table.T)`` for the logits) kept in bf16 by
``Rule("embedder.*", None)``, every other GEMM in NVFP4 with ``jax_nvfp4.Recipe()``.

It checks which projections were routed: the provider's routed paths, and the ``nvfp4_quantize`` equations of
the traced forward (and forward + backward) with one projection path converted at a time. It then trains the
unconverted model (bf16) and the converted one (NVFP4) from the same initial weights on the same batches
(byte-level tokens of the Python standard library's source, next-byte cross-entropy, AdamW), both jitted on an
8-device mesh (``fsdp``, Auto axes: the batch and each parameter's largest axis divisible by 8 sharded over it),
with the loss on held-out windows (the last 5% of the text) at steps 0, 5, 10, 20 and 30, and runs the first steps
unsharded too (one device; NVFP4, and bf16 for scale) to compare the losses.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.gemma_qwix [--steps 30] [--out FILE]

Needs ``gemma`` (with its ``kauldron`` dependency), ``qwix``, ``optax`` and ``flax`` beside ``jax_nvfp4``.
On CPU the 8 devices are host devices (the flag above; set here too when missing).
"""

from __future__ import annotations

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30, help="AdamW updates per run")
parser.add_argument("--batch", type=int, default=8, help="sequences per batch (a multiple of the 8 devices)")
parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the model reads seq_len bytes)")
parser.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (linear warmup)")
parser.add_argument("--warmup", type=int, default=5, help="warmup steps")
parser.add_argument("--unsharded-steps", type=int, default=5, help="NVFP4 steps also run unsharded")
parser.add_argument("--devices", type=int, default=8, help="host devices to make on CPU")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", help="also write the markdown report to this file")
ARGS = parser.parse_args()
# Before jax starts: the CPU backend reads its device count once.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.devices}"

import collections  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import qwix  # noqa: E402
from gemma import gm  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvfp4  # noqa: E402
from benchmarks.timing import Report, device_name  # noqa: E402
from jax_nvfp4.flax.rules import Rule  # noqa: E402
from jax_nvfp4.qwix import NVFP4Provider  # noqa: E402

AXIS = "fsdp"
HELD_OUT = 64  # held-out windows, one batch
RULES = (Rule("embedder.*", None), Rule(".*", jax_nvfp4.Recipe()))
GLOBAL = gm.nn.config.AttentionType.GLOBAL
CONFIG = gm.nn.config.TransformerConfig(
    num_embed=256,  # byte-level tokens
    embed_dim=128,
    hidden_dim=512,
    num_heads=4,
    head_dim=32,
    num_kv_heads=2,  # grouped-query attention: q_einsum and kv_einsum (not qkv_einsum)
    final_logit_softcap=None,
    use_post_attn_norm=True,  # Gemma 3's norms
    use_post_ffw_norm=True,
    use_qk_norm=True,
    attention_types=(GLOBAL,) * 4,  # 4 layers
)
# Each block's GEMMs by Qwix's module path (gemma's FeedForward shares its scope with its two Einsums: both are
# "layer_i/mlp", told apart here by their weight's shape), and their parameter.
PROJECTIONS = {
    "attn/q_einsum": "attn/q_einsum/w",
    "attn/kv_einsum": "attn/kv_einsum/w",
    "attn/attn_vec_einsum": "attn/attn_vec_einsum/w",
    "mlp/gating_einsum": "mlp/gating_einsum",
    "mlp/linear": "mlp/linear",
}


# --------------------------------------------------------------------------------------------------- data


def stdlib_bytes() -> np.ndarray:
    """The Python standard library's top-level ``.py`` files (sorted by name), concatenated, as byte tokens; NUL
    bytes (gemma's padding id 0) replaced by spaces."""
    root = os.path.dirname(os.__file__)
    chunks = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
    data = np.frombuffer(b"\n".join(chunks), np.uint8).astype(np.int32)
    return np.where(data == 0, ord(" "), data)


def batches(data: np.ndarray, count: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """``count`` batches of ``batch`` windows of ``seq_len + 1`` bytes of ``data`` at random offsets (numpy seed
    ``seed``)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - seq_len - 1, size=(count, batch))
    return np.stack([np.stack([data[s : s + seq_len + 1] for s in row]) for row in starts])


# --------------------------------------------------------------------------------------------------- model


def loss_fn(model, params, tokens, key):
    """Next-byte cross-entropy (float32) of ``model`` on ``tokens`` (B, L+1): the float32 master weights cast to
    bf16, the parameter dtype gemma's Transformer creates and computes in; NVFP4's keys from ``key``."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    rngs = None if key is None else {"nvfp4": key}
    logits = model.apply({"params": params}, tokens[:, :-1], rngs=rngs).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def eqns_named(jaxpr, name: str) -> list:
    """Every equation of primitive ``name`` that a (closed) jaxpr runs, nested jaxprs included, one per call."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += eqns_named(sub, name)
    return found


def quantize_model(model, rules, tokens, disable_jit=False):
    """``qwix.quantize_model`` with an ``NVFP4Provider`` of ``rules``, run once (Qwix's first run, ``init``,
    abstractly); the model and the provider (its ``seen``: the paths whose calls a rule decided)."""
    provider = NVFP4Provider(rules, on_unmatched="ignore", disable_jit=disable_jit)
    qmodel = qwix.quantize_model(model, provider)
    jax.eval_shape(qmodel.init, jax.random.key(0), tokens)
    return qmodel, provider


def quantize_counts(model, params, tokens) -> tuple[dict[str, tuple[int, int]], int, int]:
    """For each projection of each layer, (forward, forward + backward) ``nvfp4_quantize`` equations with that
    projection's path alone converted; and the totals with the record's rules."""
    key = jax.random.key(1)
    counts = {}
    for layer in range(CONFIG.num_layers):
        for path in ("attn/q_einsum", "attn/kv_einsum", "attn/attn_vec_einsum", "mlp"):
            full = f"layer_{layer}/{path}"
            qmodel, _ = quantize_model(model, (Rule(re.escape(full), jax_nvfp4.Recipe()), Rule(".*", None)), tokens)
            fwd = eqns_named(jax.make_jaxpr(lambda p, m=qmodel: loss_fn(m, p, tokens, key))(params), "nvfp4_quantize")
            grad = jax.make_jaxpr(jax.grad(lambda p, m=qmodel: loss_fn(m, p, tokens, key)))(params)
            both = eqns_named(grad, "nvfp4_quantize")
            if path != "mlp":
                counts[f"layer_{layer}/{path}"] = (len(fwd), len(both))
                continue
            # The MLP's two Einsums share the path: the forward's quantizes by operand shape (gating: x of width
            # embed_dim and its (2, embed_dim, hidden) weight; linear: x of width hidden and its weight).
            gating = [e for e in fwd if is_gating_operand(e.invars[0].aval.shape)]
            counts[f"layer_{layer}/mlp/gating_einsum"] = (len(gating), None)
            counts[f"layer_{layer}/mlp/linear"] = (len(fwd) - len(gating), None)
            counts[f"layer_{layer}/mlp (both)"] = (len(fwd), len(both))
    qmodel, _ = quantize_model(model, RULES, tokens)
    total_fwd = len(eqns_named(jax.make_jaxpr(lambda p: loss_fn(qmodel, p, tokens, key))(params), "nvfp4_quantize"))
    total_both = len(
        eqns_named(jax.make_jaxpr(jax.grad(lambda p: loss_fn(qmodel, p, tokens, key)))(params), "nvfp4_quantize")
    )
    return counts, total_fwd, total_both


def head_check(model, params, tokens) -> tuple[bool, int]:
    """With Qwix's ``disable_jit=True`` and ``Rule(".*", Recipe())`` alone: whether the embedder's call (the LM
    head) is routed, and the forward's quantize calls."""
    qmodel, provider = quantize_model(model, (Rule(".*", jax_nvfp4.Recipe()),), tokens[:, :-1], disable_jit=True)
    jaxpr = jax.make_jaxpr(lambda p: loss_fn(qmodel, p, tokens, jax.random.key(1)))(params)
    return "embedder" in provider.seen, len(eqns_named(jaxpr, "nvfp4_quantize"))


def is_gating_operand(shape: tuple[int, ...]) -> bool:
    """Whether a quantized operand of the MLP's forward is the gating einsum's, by shape: its weight (2 x embed_dim
    x hidden, which reaches the quantize as (1, embed_dim, 2 * hidden)) or its x (B x L x embed_dim, as
    (1, B, L, embed_dim)); the linear einsum's are (1, hidden, embed_dim) and (1, B, L, hidden)."""
    return shape[-1] == 2 * CONFIG.hidden_dim or (len(shape) == 4 and shape[-1] == CONFIG.embed_dim)


# --------------------------------------------------------------------------------------------------- training


def fsdp_spec(shape: tuple[int, ...], devices: int) -> P:
    """The parameter's largest axis divisible by ``devices`` (the first of equal ones) over ``fsdp``; replicated if
    none is."""
    axes = [i for i, n in enumerate(shape) if n % devices == 0]
    if not axes:
        return P()
    axis = max(axes, key=lambda i: (shape[i], -i))
    return P(*[AXIS if i == axis else None for i in range(len(shape))])


def make_step(model, optimizer, nvfp4: bool):
    """A jitted AdamW step: (params, opt_state, tokens, step) -> (params, opt_state, loss before the update)."""
    base = jax.random.key(ARGS.seed + 1)

    def step(params, opt_state, tokens, i):
        key = jax.random.fold_in(base, i) if nvfp4 else None
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, tokens, key))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)


def train(name, model, optimizer, params, data, steps, mesh=None, held_out=None, eval_steps=()):
    """``steps`` updates from ``params``, then the loss at step ``steps`` (the step function's loss before the
    update, which is dropped); the losses, step 0 to ``steps``, the wall seconds of each call, and the loss on
    ``held_out`` (one batch) at each of ``eval_steps`` (after that many updates; not timed)."""
    nvfp4 = name != "bf16"
    step = make_step(model, optimizer, nvfp4=nvfp4)
    evaluate = jax.jit(lambda p, t: loss_fn(model, p, t, jax.random.key(0) if nvfp4 else None))
    opt_state = optimizer.init(params)
    if mesh is not None:
        shardings = jax.tree.map(lambda p: NamedSharding(mesh, fsdp_spec(p.shape, mesh.size)), params)
        params = jax.device_put(params, shardings)
        # The moments as their parameters; the step count replicated (else the second call compiles again).
        opt_state = jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x.shape, mesh.size))), opt_state
        )
        if held_out is not None:
            held_out = jax.device_put(held_out, NamedSharding(mesh, P(AXIS, None)))
    losses, seconds, evals, kept = [], [], {}, None
    where = f"{mesh.size} devices" if mesh is not None else "1 device"
    for i in range(steps + 1):
        if i in eval_steps:
            evals[i] = float(evaluate(params, held_out))
            print(f"  {name} ({where}) held-out loss after {i} updates: {evals[i]:.4f}", flush=True)
        tokens = data[i] if mesh is None else jax.device_put(data[i], NamedSharding(mesh, P(AXIS, None)))
        start = time.perf_counter()
        new_params, new_state, loss = step(params, opt_state, tokens, jnp.int32(i))
        loss = float(loss)  # waits for the step
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        if i < steps:
            params, opt_state = new_params, new_state
        print(f"  {name} ({where}) step {i:3d}  loss {loss:.4f}  {seconds[-1] * 1e3:8.1f} ms", flush=True)
    if mesh is not None:  # the update keeps each parameter where it was put
        kept = all(
            p.sharding.is_equivalent_to(NamedSharding(mesh, fsdp_spec(p.shape, mesh.size)), p.ndim)
            for p in jax.tree.leaves(params)
        )
        print(f"  {name}: parameters still sharded as placed after {steps} steps: {kept}", flush=True)
    return losses, seconds, evals, kept


# --------------------------------------------------------------------------------------------------- record


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def git(*args: str) -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    devices = jax.devices()
    if len(devices) < 8:
        sys.exit(f"needs 8 devices, found {len(devices)} (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    # Auto axes (GSPMD propagation): jax.make_mesh's default here, Explicit axes, rejects gemma's embedding
    # gather (`table[(tokens,)]`, table and tokens both sharded over fsdp: "out sharding could not be resolved").
    mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    cores = os.cpu_count()
    dirty = git("status", "--porcelain", "--", "jax_nvfp4")
    commit = git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes under jax_nvfp4/)" if dirty else "")
    command = "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.gemma_qwix " + " ".join(
        sys.argv[1:]
    )
    now = datetime.datetime.now(datetime.UTC)
    report = Report(
        ARGS.out,
        [
            f"# Gemma (gemma.gm.nn.Transformer) in NVFP4 through Qwix: {device_name()}, {cores} cores "
            f"({devices[0].platform}, {len(devices)} devices)",
            "",
            f"{now:%Y-%m-%d %H:%M} UTC, commit {commit}, Python {platform.python_version()}, jax {jax.__version__}, "
            f"flax {flax.__version__}, qwix {version('qwix')}, gemma {version('gemma')}, optax {optax.__version__}, "
            f"kauldron {version('kauldron')}: `{command.strip()}`",
            "",
        ],
    )

    data_all = stdlib_bytes()
    split = len(data_all) * 95 // 100  # the last 5% held out
    data = batches(data_all[:split], ARGS.steps + 1, ARGS.batch, ARGS.seq_len, ARGS.seed)
    held_out = batches(data_all[split:], 1, HELD_OUT, ARGS.seq_len, ARGS.seed + 1)[0]
    model = gm.nn.Transformer(config=CONFIG)  # dtype: bf16 (gemma's default) parameters and compute
    tokens0 = jnp.asarray(data[0][:, :-1])
    params_bf16 = model.init(jax.random.key(ARGS.seed), tokens0)["params"]
    dtypes = collections.Counter(str(p.dtype) for p in jax.tree.leaves(params_bf16))
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params_bf16)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    report.add(
        f"**Model**: `gm.nn.Transformer(config=TransformerConfig(num_embed=256, embed_dim=128, hidden_dim=512, "
        "num_heads=4, head_dim=32, num_kv_heads=2, final_logit_softcap=None, use_post_attn_norm=True, "
        "use_post_ffw_norm=True, use_qk_norm=True, attention_types=(GLOBAL,) * 4))`: 4 layers, grouped-query "
        f"attention (4 query heads, 2 KV heads: `q_einsum` + `kv_einsum`), GeGLU MLP, {n_params:,} parameters, "
        f"the embedding tied with the LM head. gemma's `Transformer.dtype` default creates the parameters in "
        f"bf16 ({dict(dtypes)}) and its einsums compute in the parameters' dtype; here AdamW keeps float32 master "
        "weights (the bf16 init, upcast) and each step casts them to bf16 for the forward pass, in both runs. "
        f"**Data**: {len(data_all) / 1e6:.2f} MB of byte tokens, the standard library's top-level `.py` files "
        f"({os.path.dirname(os.__file__)}, sorted by name), NUL bytes (gemma's padding id) made spaces; the last 5% "
        f"held out; {ARGS.batch} x {ARGS.seq_len} tokens a batch at random offsets in the first 95% (numpy seed "
        f"{ARGS.seed}), next-byte cross-entropy; the held-out loss on {HELD_OUT} x {ARGS.seq_len} fixed windows of the "
        "last 5%. **Optimizer**: `optax.adamw` (weight decay "
        f"1e-4), peak lr {ARGS.lr:g}, {ARGS.warmup} warmup steps then constant."
    )
    report.add("")
    head_routed, head_fwd = head_check(model, params, jnp.asarray(data[0]))
    report.add(
        '**Conversion**: `qwix.quantize_model(model, NVFP4Provider([Rule("embedder.*", None), '
        'Rule(".*", jax_nvfp4.Recipe())]))` on the unmodified model. The LM head is gemma\'s '
        "`Embedder.decode`, `jnp.dot(x, input_embedding.T)`, tied with the input embedding (a gather): the first "
        "rule keeps it in bf16. (Qwix does not intercept it anyway: `jnp.dot` runs its `lax.dot_general` inside "
        "`jnp`'s own `jit`, which Qwix skips unless `disable_jit=True`, so the provider reports the "
        "`embedder.*` rule as matching no call (the warning below). Checked: with `disable_jit=True` and "
        f'`Rule(".*", Recipe())` alone, the embedder\'s call is routed: {head_routed}, {head_fwd} forward quantize '
        'calls. The per-projection traces below pass `on_unmatched="ignore"`.)'
    )
    report.add("")

    # Conversion: the routed paths and the quantize calls per projection.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        provider = NVFP4Provider(RULES)
        qmodel = qwix.quantize_model(model, provider)
        qparams = qmodel.init(jax.random.key(ARGS.seed), tokens0)["params"]
    same_tree = jax.tree.structure(qparams) == jax.tree.structure(params_bf16)
    same_values = same_tree and all(
        bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(qparams), jax.tree.leaves(params_bf16), strict=True)
    )
    plain = qwix.quantize_model(model, qwix.QuantizationProvider([])).init(jax.random.key(ARGS.seed), tokens0)["params"]
    as_qwix = all(
        bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(qparams), jax.tree.leaves(plain), strict=True)
    )
    report.add(
        f"The converted model's `init` (same key) gives the unconverted one's parameter tree: {same_tree}; the same "
        f"values: {same_values}"
        + (
            ""
            if same_values
            else f" (Qwix's own wrapping draws these other values: with an empty `qwix.QuantizationProvider([])` "
            f"the values are those of ours: {as_qwix}); both runs start from the unconverted model's `init`"
        )
        + ". The provider's routed paths (its `seen`, after Qwix's first run, `init`): "
        f"{len(provider.seen)}: " + ", ".join(f"`{p}`" for p in sorted(provider.seen)) + "."
    )
    for w in {
        (w.category, str(w.message)): w for w in caught if w.category.__name__ == "UnmatchedRuleWarning"
    }.values():
        report.add("")
        report.add(f"Warning at the conversion ({w.category.__name__}): {str(w.message).splitlines()[0]}")
    report.add("")

    print("tracing the quantize calls per projection ...", flush=True)
    counts, total_fwd, total_both = quantize_counts(model, params, jnp.asarray(data[0]))
    report.add(
        "**Quantize calls** (`nvfp4_quantize` equations of `jax.make_jaxpr` of the loss, nested jaxprs included), "
        'with only that projection\'s path converted (`Rule(path, Recipe())`, `Rule(".*", None)`); forward, and '
        "forward + backward (`jax.grad`). Expected: 2 a GEMM in the forward (x and W). gemma's `FeedForward` "
        "shares its scope with its two `Einsum`s, so both run under Qwix's path `layer_i/mlp`; the forward's "
        "quantizes are split between them by operand shape. Forward + backward: 3 a GEMM expected, x (rowwise and "
        "its RHT columnwise copy in one call), W (16x16 blocks, one call for both GEMMs that read it) and dy "
        "(stochastic rounding, both copies)."
    )
    report.add("")
    report.add("| layer | " + " | ".join(f"`{p}` fwd" for p in PROJECTIONS) + " | `attn/*` fwd+bwd | `mlp` fwd+bwd |")
    report.add("|---|" + "---:|" * (len(PROJECTIONS) + 2))
    not_routed = []
    for layer in range(CONFIG.num_layers):
        row = []
        for p in PROJECTIONS:
            fwd, _ = counts[f"layer_{layer}/{p}"]
            row.append(str(fwd))
            if fwd == 0:
                not_routed.append(f"layer_{layer}/{p}")
        attn_both = "/".join(str(counts[f"layer_{layer}/{p}"][1]) for p in list(PROJECTIONS)[:3])
        row += [attn_both, str(counts[f"layer_{layer}/mlp (both)"][1])]
        report.add(f"| layer_{layer} | " + " | ".join(row) + " |")
    gemms = CONFIG.num_layers * len(PROJECTIONS)
    report.add("")
    report.add(
        f"With the record's rules: {total_fwd} quantize calls in the forward ({gemms} GEMMs x 2 = {2 * gemms} "
        f"expected), {total_both} in forward + backward. "
        + (
            "Every projection was routed (quantize calls > 0 for each)."
            if not not_routed
            else "Not routed: " + ", ".join(f"`{p}`" for p in not_routed) + "."
        )
        + " The attention products (`BTKGH,BSKH->BTKGS` and `BTKGS,BSKH->BTKGH`: two activations) stay in bf16, "
        "as the provider's docstring says."
    )
    report.add("")

    # Training.
    schedule = optax.join_schedules(
        [optax.linear_schedule(ARGS.lr / ARGS.warmup, ARGS.lr, ARGS.warmup), optax.constant_schedule(ARGS.lr)],
        [ARGS.warmup],
    )
    optimizer = optax.adamw(schedule, weight_decay=1e-4)
    data_j = jnp.asarray(data)
    print("training bf16 (sharded) ...", flush=True)
    shown = [s for s in (0, 5, 10, 20, 30) if s <= ARGS.steps]
    if ARGS.steps not in shown:
        shown.append(ARGS.steps)
    bf16_losses, bf16_s, bf16_eval, bf16_kept = train(
        "bf16", model, optimizer, params, data_j, ARGS.steps, mesh, held_out, shown
    )
    print("training NVFP4 (sharded) ...", flush=True)
    fp4_losses, fp4_s, fp4_eval, fp4_kept = train(
        "nvfp4", qmodel, optimizer, params, data_j, ARGS.steps, mesh, held_out, shown
    )
    print("training NVFP4 (unsharded) ...", flush=True)
    one_losses, one_s, _, _ = train("nvfp4", qmodel, optimizer, params, data_j, ARGS.unsharded_steps - 1, None)
    print("training bf16 (unsharded), for scale ...", flush=True)
    one_bf16, _, _, _ = train("bf16", model, optimizer, params, data_j, ARGS.unsharded_steps - 1, None)

    report.add(
        f"**Training**: {ARGS.steps} AdamW steps a run, both jitted (`jax.jit` of loss, gradients and update) on "
        f'`jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))` (with jax {jax.__version__}\'s default, '
        "Explicit axes, gemma's embedding gather `table[(tokens,)]` fails: \"ShardingTypeError: Use "
        '`.at[...].get(out_sharding=)` ...", both operands being sharded over `fsdp`): the batch '
        f"({ARGS.batch} sequences) sharded over `fsdp`, each "
        "parameter (and its AdamW moments) placed with `jax.device_put(NamedSharding(mesh, P(...)))` with its "
        "largest axis divisible by 8 over `fsdp` (every parameter here has one: the embedding's 256 rows, the "
        "einsum weights' 128 / 512 axes, the norms' 128 / 32). Same initial weights and batches; NVFP4 takes "
        '`rngs={"nvfp4": fold_in(key, step)}`. Loss at step s: on batch s, before update s (the step-'
        f"{ARGS.steps} loss after all {ARGS.steps} updates). After the last update every parameter is still sharded "
        f"as placed: bf16 {bf16_kept}, NVFP4 {fp4_kept}."
    )
    report.add("")
    report.add("| loss | " + " | ".join(f"step {s}" for s in shown) + " | median ms/step |")
    report.add("|---|" + "---:|" * (len(shown) + 1))
    runs = (("bf16", bf16_losses, bf16_s, bf16_eval), ("NVFP4", fp4_losses, fp4_s, fp4_eval))
    for name, losses, secs, _ in runs:
        cells = " | ".join(f"{losses[s]:.4f}" for s in shown)
        report.add(f"| {name}, training batch | {cells} | {statistics.median(secs[1:]) * 1e3:.1f} |")
    for name, _, _, evals in runs:
        cells = " | ".join(f"{evals[s]:.4f}" for s in shown)
        report.add(f"| {name}, held-out | {cells} | |")
    gap = (fp4_losses[ARGS.steps] / bf16_losses[ARGS.steps] - 1) * 100
    eval_gap = (fp4_eval[ARGS.steps] / bf16_eval[ARGS.steps] - 1) * 100
    last = max(1, min(5, ARGS.steps))
    mean_gap = (np.mean(fp4_losses[-last:]) / np.mean(bf16_losses[-last:]) - 1) * 100
    report.add("")
    report.add(
        f"Final gap, NVFP4 vs bf16 at step {ARGS.steps}: held-out loss {eval_gap:+.2f}%; training-batch loss "
        f"{gap:+.2f}% (one batch of {ARGS.batch} windows: noisy; the mean of the last {last} steps' losses: "
        f"{mean_gap:+.2f}%). One seed. Step times: the median of the calls after the first (which compiles), 8 host "
        f"devices on {cores} cores; first calls (compile + run) bf16 {bf16_s[0]:.1f} s, NVFP4 {fp4_s[0]:.1f} s."
    )
    report.add("")
    k = ARGS.unsharded_steps
    diffs = [abs(a - b) for a, b in zip(fp4_losses[:k], one_losses[:k], strict=True)]
    report.add(
        f"**Sharded vs unsharded** (NVFP4, steps 0-{k - 1}, the same step function on 1 device without "
        f"`device_put`): max |loss difference| {max(diffs):.3g} (per step: "
        + ", ".join(f"{d:.2g}" for d in diffs)
        + f"); unsharded median {statistics.median(one_s[1:]) * 1e3:.1f} ms/step. For scale, the bf16 model's "
        "sharded vs unsharded max |loss difference| over the same steps: "
        f"{max(abs(a - b) for a, b in zip(bf16_losses[:k], one_bf16, strict=True)):.3g}."
    )
    report.add("")
    report.add("All losses, step 0 to " + str(ARGS.steps) + ":")
    report.add("")
    report.add("| step | bf16 | NVFP4 | NVFP4 unsharded | bf16 unsharded |")
    report.add("|---:|---:|---:|---:|---:|")
    for s in range(ARGS.steps + 1):
        one = f"{one_losses[s]:.4f} | {one_bf16[s]:.4f}" if s < k else " | "
        report.add(f"| {s} | {bf16_losses[s]:.4f} | {fp4_losses[s]:.4f} | {one} |")
    report.save()


if __name__ == "__main__":
    main()
