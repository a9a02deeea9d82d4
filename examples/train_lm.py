"""Train a small byte-level transformer with NVFP4 linear layers and compare it with bf16.

The corpus is the Python standard library's own source, which every machine has offline: ~4 MB of
bytes in a fixed order, the last 5% held out for validation. Every run starts from the same initial
weights and sees the same batches; only the linear layers inside the transformer blocks differ
(NVFP4 with a recipe variant, or bf16). The embeddings and the output head stay in bf16, as in NVIDIA's
NVFP4 recipe. Prints a table of final losses and step times and writes a plot of the loss curves.

    python examples/train_lm.py [--steps N] [--runs full,bf16 | all] [--out train_lm.png]

The NVFP4 recipe variants (``--runs``): plain (round to nearest, no transform), rht (+ the Random
Hadamard Transform on the weight-gradient operands), sr (+ stochastic rounding of the gradients, no
RHT), full (both: NVIDIA's recipe, ``jax_nvfp4.Recipe()``), full-est (full, with the post-RHT amax
estimated from the pre-RHT one), 4o6 (plain + 4over6 adaptive block scaling of x, W and dy: each
16-value block scaled to 6 or to 4, whichever gives the smaller squared error), per-token (plain +
one global scale per token for x and dy instead of one per tensor), full-keep-last (the bf16 model
converted by rules, ``jax_nvfp4.flax.quantize_model``: the full recipe everywhere but the last block).
Stochastic rounding draws a fresh key every step from the layers' ``"nvfp4"`` RNG stream.

`--seeds N` trains every run with the seeds --seed .. --seed+N-1 (initial weights and batch order) and
reports the mean and standard deviation of the losses and of each seed's gap to its bf16 run.

`--save DIR` writes each trained model to DIR/<run> for inference (``examples/generate.py DIR`` samples text
from it): the NVFP4 layers' kernels quantized once (``jax_nvfp4.QuantizedWeight``, 0.5625 bytes a value), every
other parameter as trained, saved with orbax-checkpoint (``jax_nvfp4.checkpoint``), and the model's settings in
config.json.

`--moe E` replaces every block's MLP with a mixture of E experts (``jax_nvfp4.flax.moe.MoEMLP``): top-2
routing by a float32 router, each expert a GELU MLP of hidden width 2 x d_model (as many weights per token
as the dense MLP's 4 x d_model), its grouped GEMMs ``jax_nvfp4.ragged_dot`` in NVFP4 runs and
``lax.ragged_dot`` in the bf16 run. The training loss adds 0.01 x the layers' mean load-balancing loss
(the printed train loss includes it; the validation loss is the cross-entropy alone). `--dispatch capacity`
gives each expert at most C = ceil(--capacity-factor x T x 2 / E) of the (token, choice) pairs of a batch of
T = batch x seq-len tokens (the first in token order; the others are dropped, in evaluation too) and runs its
GEMMs as batched ``jax_nvfp4.dot_general`` (``lax.dot_general`` in bf16) on a [E, C, d] buffer; the default,
`--dispatch ragged`, drops nothing.

`--mesh data=2,fsdp=2,tensor=2` trains sharded over that many devices (on CPU, set
XLA_FLAGS=--xla_force_host_platform_device_count=8): the batch splits over data x fsdp, the parameters
and their optimizer state over fsdp (gathered for use), and the attention heads and MLP over tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4 import checkpoint
from jax_nvfp4.flax import RNG_STREAM, NVFP4Dense, NVFP4DenseGeneral, keep_ends, quantize_model
from jax_nvfp4.flax.linen.layers import quantize_params
from jax_nvfp4.flax.linen.moe import MoEMLP

matplotlib.use("Agg")
import matplotlib.pyplot as plt

VOCAB = 256  # bytes
EVAL_WINDOWS, EVAL_BATCH = 256, 64  # fixed validation set: 256 windows, evenly spaced over the held-out bytes
DTYPE = jnp.bfloat16  # activations; parameters stay float32

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the mesh axes that split the batch
X, QKV = ("batch", "length", "act_embed"), ("batch", "length", "heads", "kv")  # activations' logical axes
# Logical axis names -> mesh axes. Parameters' "embed" is sharded over fsdp and gathered where used;
# activations name their model axis "act_embed" so that it stays whole. The vocabulary (256) is small:
# replicated. Without --mesh the annotations do nothing.
RULES = (
    ("batch", BATCH),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", None),
    ("length", None),
    ("kv", None),
)

# The NVFP4 recipe variants --runs can train (their weight blocks come from --weight-blocks).
RECIPES = {
    "plain": jax_nvfp4.Recipe(rht=False, stochastic_rounding=False),
    "rht": jax_nvfp4.Recipe(stochastic_rounding=False),
    "sr": jax_nvfp4.Recipe(rht=False),
    "full": jax_nvfp4.Recipe(),
    "full-est": jax_nvfp4.Recipe(rht_amax_estimate=True),
    # 4over6 on every operand (MSE, block scales aimed at E4M3 256); round to nearest, as 4over6 of dy needs.
    "4o6": jax_nvfp4.Recipe(rht=False, stochastic_rounding=False, four_over_six=jax_nvfp4.FourOverSix("all")),
    # Per-token global scales for the activations and the gradients (one float32 amax per row of x and of dy).
    "per-token": jax_nvfp4.Recipe(
        rht=False, stochastic_rounding=False, row_scaled_activations=True, row_scaled_gradients=True
    ),
}
# Runs that convert the bf16 model by rules (jax_nvfp4.flax.quantize_model) instead of building it with NVFP4
# layers: the recipe of RECIPES they use, every layer in NVFP4 but those of the last block (kept in bf16).
RULE_RUNS = {"full-keep-last": "full"}
RUNS = (*RECIPES, *RULE_RUNS, "bf16")
MOE_TOP_K = 2  # --moe: experts per token
LOAD_BALANCE = 0.01  # --moe: the weight of the load-balancing loss in the training loss
# The settings that define the model (build_model's), saved with it by --save.
MODEL_ARGS = ("d_model", "layers", "heads", "seq_len", "weight_blocks")


def load_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
    """The standard library's .py sources as bytes, in sorted file order, up to max_bytes."""
    root = pathlib.Path(os.path.dirname(os.__file__))
    files = sorted(root.glob("*.py")) + sorted(p for p in root.glob("*/*.py") if "site-packages" not in p.parts)
    chunks, total = [], 0
    for path in files:
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """[len(starts), seq_len + 1] int32 token windows: inputs are [:, :-1], targets [:, 1:]."""
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def next_byte_loss(
    model: nn.Module, params: Any, batch: jax.Array, key: jax.Array | None = None, load_balance: float = 0.0
) -> jax.Array:
    """Mean cross-entropy of predicting each next byte of the windows ``batch`` [B, seq_len + 1].

    ``key`` feeds the NVFP4 layers' stochastic rounding (needed for gradients when the recipe has it).
    ``load_balance``: the weight of the MoE layers' mean load-balancing loss added to it (no MoE: none)."""
    rngs = None if key is None else {RNG_STREAM: key}
    logits, state = model.apply({"params": params}, batch[:, :-1], rngs=rngs, mutable=["losses"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    balance = jax.tree.leaves(state)
    return loss + load_balance * sum(balance) / len(balance) if balance else loss


def logical(init: Callable[..., jax.Array], *axes: str) -> Callable[..., Any]:
    """``init`` with the logical axis names of the parameter it makes (its values are unchanged)."""
    return nn.with_logical_partitioning(init, axes)


def constrain(x: jax.Array, mesh: jax.sharding.Mesh | None, *axes: str) -> jax.Array:
    """Shard an activation on the mesh as its logical axes say (no mesh: unchanged).

    The mesh is passed rather than set with ``jax.set_mesh``: under a global mesh, Flax's own DenseGeneral (the
    bf16 baseline) cannot apply its kernel's logical constraint to the 2-D kernel its init makes first
    (google/flax#3676; the NVFP4 layers work around it).
    """
    return x if mesh is None else nn.with_logical_constraint(x, axes, RULES, mesh)


def with_axes(cls: type[nn.Module]) -> Callable[..., nn.Module]:
    """``nn.Dense`` or ``nn.DenseGeneral`` taking ``kernel_axes``/``bias_axes`` like the NVFP4 layers, so that
    the bf16 baseline shards as they do."""

    def make(*args: Any, kernel_axes: Sequence[str], bias_axes: Sequence[str], **kwargs: Any) -> nn.Module:
        kernel_init = logical(nn.linear.default_kernel_init, *kernel_axes)
        return cls(*args, kernel_init=kernel_init, bias_init=logical(nn.initializers.zeros, *bias_axes), **kwargs)

    return make


def layer_norm(name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(
        dtype=DTYPE,
        scale_init=logical(nn.initializers.ones, "embed"),
        bias_init=logical(nn.initializers.zeros, "embed"),
        name=name,
    )


class Block(nn.Module):
    """Pre-LayerNorm block: causal multi-head self-attention, then a GELU MLP."""

    heads: int
    dense_cls: Callable[..., nn.Module]
    dense_general_cls: Callable[..., nn.Module]
    mesh: jax.sharding.Mesh | None = None
    moe_cls: Callable[..., nn.Module] | None = None  # the MLP as a mixture of experts (--moe)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        head_dim = d_model // self.heads
        h = layer_norm()(x)
        qkv = functools.partial(
            self.dense_general_cls,
            (self.heads, head_dim),
            dtype=DTYPE,
            kernel_axes=("embed", "heads", "kv"),
            bias_axes=("heads", "kv"),
        )
        q, k, v = (constrain(qkv(name=n)(h), self.mesh, *QKV) for n in ("q", "k", "v"))
        # Scores and softmax in f32: bf16 is too coarse for the exponentials and their sum.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(DTYPE)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        out = self.dense_general_cls(
            d_model, axis=(-2, -1), dtype=DTYPE, name="out", kernel_axes=("heads", "kv", "embed"), bias_axes=("embed",)
        )
        x = constrain(x + out(attn), self.mesh, *X)
        h = layer_norm()(x)
        if self.moe_cls is not None:
            return x + self.moe_cls(hidden=4 * d_model // MOE_TOP_K, top_k=MOE_TOP_K, name="moe")(h)
        up = self.dense_cls(4 * d_model, dtype=DTYPE, name="mlp_up", kernel_axes=("embed", "mlp"), bias_axes=("mlp",))
        # Exact (erf) GELU: on CPU it is faster than the tanh approximation.
        h = constrain(nn.gelu(up(h), approximate=False), self.mesh, "batch", "length", "mlp")
        down = self.dense_cls(d_model, dtype=DTYPE, name="mlp_down", kernel_axes=("mlp", "embed"), bias_axes=("embed",))
        return constrain(x + down(h), self.mesh, *X)


class TransformerLM(nn.Module):
    """Decoder-only byte-level language model; returns float32 logits."""

    d_model: int
    layers: int
    heads: int
    max_len: int
    dense_cls: Callable[..., nn.Module] = with_axes(nn.Dense)
    dense_general_cls: Callable[..., nn.Module] = with_axes(nn.DenseGeneral)
    mesh: jax.sharding.Mesh | None = None  # where to shard the activations
    moe_cls: Callable[..., nn.Module] | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)  # one scale for both, so positions are not drowned out by tokens
        table = nn.Embed(VOCAB, self.d_model, embedding_init=logical(init, "vocab", "embed"), name="embed").embedding
        # Gather the table (FSDP) before the lookup, which is nn.Embed's: XLA cannot move a lookup's output from
        # the table's sharding to the batch's without gathering all of it (and says so on every compile).
        x = jnp.take(constrain(table.astype(DTYPE), self.mesh, "vocab", "act_embed"), tokens, axis=0)
        pos = self.param("pos_embed", logical(init, "length", "embed"), (self.max_len, self.d_model))
        x = constrain(x + pos[: tokens.shape[1]].astype(DTYPE), self.mesh, *X)
        for i in range(self.layers):
            x = Block(self.heads, self.dense_cls, self.dense_general_cls, self.mesh, self.moe_cls, name=f"block{i}")(x)
        x = layer_norm("final_norm")(x)
        head = with_axes(nn.Dense)(
            VOCAB, dtype=DTYPE, name="head", kernel_axes=("embed", "vocab"), bias_axes=("vocab",)
        )
        return head(x).astype(jnp.float32)


def build_model(
    run: str, args: argparse.Namespace, mesh: jax.sharding.Mesh | None = None, **recipe_fields: Any
) -> nn.Module:
    """The same architecture; only the block's linear layers depend on the run (bf16 or an NVFP4 recipe, by
    NVFP4 layers or, for RULE_RUNS, by rules on the bf16 model). ``recipe_fields`` change the NVFP4 runs'
    recipe (e.g. ``impl="scaled_dot"``)."""
    recipe = lambda name: dataclasses.replace(  # noqa: E731
        RECIPES[name], weight_block_2d=args.weight_blocks == "16x16", **recipe_fields
    )
    if run in RECIPES:
        dense_cls = functools.partial(NVFP4Dense, recipe=recipe(run))
        dense_general_cls = functools.partial(NVFP4DenseGeneral, recipe=recipe(run))
    else:
        dense_cls, dense_general_cls = with_axes(nn.Dense), with_axes(nn.DenseGeneral)
    moe_cls = None
    if getattr(args, "moe", 0):
        moe_cls = functools.partial(
            MoEMLP,
            args.moe,
            recipe=recipe(run) if run in RECIPES else None,
            dtype=DTYPE,
            dispatch=getattr(args, "dispatch", "ragged"),
            capacity_factor=getattr(args, "capacity_factor", 1.25),
        )
    model = TransformerLM(
        args.d_model, args.layers, args.heads, args.seq_len, dense_cls, dense_general_cls, mesh, moe_cls
    )
    if run in RULE_RUNS:  # the last block (and the head, bf16 in every run) kept by the rules
        return quantize_model(model, keep_ends(args.layers, last=1, recipe=recipe(RULE_RUNS[run])))
    return model


def save_model(directory: pathlib.Path, run: str, args: argparse.Namespace, model: TransformerLM, params: Any) -> None:
    """Write a trained model for inference to ``directory``: ``params/``, its parameters with the NVFP4 layers'
    kernels quantized (``QuantizedWeight``) by ``jax_nvfp4.checkpoint`` (orbax), and ``config.json``, the run and
    the MODEL_ARGS that rebuild the model (``build_model``)."""
    if run in RECIPES:
        params = quantize_params(params, model=model, inputs=(jnp.zeros((1, args.seq_len), jnp.int32),))
    # On the host, unsharded: the checkpoint then restores on any number of devices.
    checkpoint.save(directory / "params", jax.device_get(params))
    config = {"run": run, **{name: getattr(args, name) for name in MODEL_ARGS}}
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")


class Progress:
    """A one-line progress bar on stderr: step/total, loss, steps/s, ETA."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.t0, self.step0, self.last = time.perf_counter(), 0, 0.0

    def restart(self, step: int) -> None:
        """Measure speed from here (after the compile step)."""
        self.t0, self.step0 = time.perf_counter(), step

    def update(self, step: int, loss: jax.Array) -> None:
        now = time.perf_counter()
        if now - self.last < 0.25 and step < self.total:
            return  # redrawing reads the loss back, which waits for the device
        loss = float(loss)  # waits for this step, so the rate below counts finished steps only
        self.last = now = time.perf_counter()
        rate = (step - self.step0) / max(now - self.t0, 1e-9)
        eta = f"{(self.total - step) / rate:.0f}s" if rate > 0 else "?"
        bar = "#" * (24 * step // self.total)
        line = f"{self.label} [{bar:<24}] {step}/{self.total} loss {loss:.3f} {rate:.2f} step/s ETA {eta}"
        sys.stderr.write("\r" + line.ljust(100))
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\r" + " " * 100 + "\r")
        sys.stderr.flush()


def parse_mesh(text: str) -> dict[str, int]:
    """``data=2,fsdp=2,tensor=2`` -> sizes of all of MESH_AXES (those not named: 1), for argparse."""
    sizes, named = dict.fromkeys(MESH_AXES, 1), set()
    for item in text.split(","):
        name, _, size = (part.strip() for part in item.partition("="))
        if name not in MESH_AXES or name in named or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r}: expected AXIS=SIZE,... with each AXIS at most once, one of "
                + "/".join(MESH_AXES)
            )
        sizes[name] = int(size)
        named.add(name)
    return sizes


def mesh_name(sizes: dict[str, int] | None) -> str | None:
    return None if sizes is None else ",".join(f"{k}={v}" for k, v in sizes.items())


def make_mesh(sizes: dict[str, int], args: argparse.Namespace) -> jax.sharding.Mesh:
    """The mesh of these axis sizes over all the devices; ValueError if they do not fit the devices or the model."""
    n = math.prod(sizes.values())
    if n != jax.device_count():
        cpu = f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n})"
        raise ValueError(
            f"needs {n} devices, found {jax.device_count()}{cpu if jax.default_backend() == 'cpu' else ''}"
        )
    batch_ways = sizes["data"] * sizes["fsdp"]
    if (
        args.batch % batch_ways
        or EVAL_BATCH % batch_ways
        or args.d_model % sizes["fsdp"]
        or args.heads % sizes["tensor"]
    ):
        raise ValueError(
            f"--batch and the eval batch ({EVAL_BATCH}) must be multiples of data*fsdp, --d-model of fsdp, "
            "--heads of tensor"
        )
    # Auto axes (make_mesh defaults to Explicit): jit and the library's partitioning rules place the intermediates.
    return jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, (jax.sharding.AxisType.Auto,) * len(sizes), devices=jax.devices()[:n]
    )


def sharded_params(init: Callable[[], Any], mesh: jax.sharding.Mesh) -> Any:
    """The unboxed parameters from ``init``, made by a jitted init directly in the shards their logical axes
    name, so no device ever holds them all."""
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(init)), mesh, RULES)
    return jax.jit(lambda: nn.unbox(init()), out_shardings=shardings)()


def shard_state(state: train_state.TrainState, mesh: jax.sharding.Mesh) -> tuple[train_state.TrainState, Any]:
    """The state committed to the mesh, its arrays sharded as they are (the params and, following them, their
    optimizer moments) and the rest replicated (step counts); and those shardings, to pin the train step's
    output to (jit picks equivalent but unequal ones, so the second step would compile again)."""
    replicated = NamedSharding(mesh, P())
    sharding = lambda a: a.sharding if isinstance(getattr(a, "sharding", None), NamedSharding) else replicated  # noqa: E731
    shardings = jax.tree.map(sharding, state)
    return jax.device_put(state, shardings), shardings


def train(
    run: str,
    args: argparse.Namespace,
    train_starts: np.ndarray,
    data: dict[str, Any],
    mesh: jax.sharding.Mesh | None = None,
    on_eval: Callable[[int, Any], None] | None = None,
) -> dict[str, Any]:
    """Train one model (bf16 or an NVFP4 recipe of RECIPES) from the shared seed on the shared batches, sharded
    over mesh if one is given; return its losses and timing. ``on_eval(step, params)`` runs at each evaluation."""
    model = build_model(run, args, mesh)

    loss_fn = functools.partial(next_byte_loss, model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10)
    decay_mask = functools.partial(jax.tree.map, lambda p: p.ndim >= 2)  # no decay on biases and norms
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decay_mask))
    init = lambda: model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]  # noqa: E731
    params = nn.unbox(init()) if mesh is None else sharded_params(init, mesh)
    # The optimizer's moments are zeros_like(params): they take the params' shardings.
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    jit_step, put = functools.partial(jax.jit, donate_argnums=0), lambda batch: batch
    if mesh is not None:
        state, shardings = shard_state(state, mesh)
        jit_step = functools.partial(jit_step, out_shardings=(shardings, NamedSharding(mesh, P())))
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, P(BATCH)))

    rounding_key = jax.random.key(args.seed + 1)  # stochastic rounding: a fresh key each step, folded in below

    @jit_step
    def train_step(state: train_state.TrainState, batch: jax.Array) -> tuple[train_state.TrainState, jax.Array]:
        key = jax.random.fold_in(rounding_key, state.step)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, key, LOAD_BALANCE)
        return state.apply_gradients(grads=grads), loss

    eval_step = jax.jit(loss_fn)

    def evaluate(params: Any) -> float:
        return float(np.mean([eval_step(params, put(b)) for b in data["val_batches"]]))

    label = f"{run:>8}"
    progress, losses, val, eval_time = Progress(label, args.steps), [], [], 0.0
    for step in range(1, args.steps + 1):
        state, loss = train_step(state, put(windows(data["train"], train_starts[step - 1], args.seq_len)))
        losses.append(loss)
        if step == 1:
            loss.block_until_ready()  # the first step compiles: time from here on
            t_start = time.perf_counter()
            progress.restart(step)
        else:
            losses[-2].block_until_ready()  # at most one step in flight: a steady progress bar, bounded memory
        progress.update(step, loss)
        if step % args.eval_every == 0 or step == args.steps:
            jax.block_until_ready(state)  # finish the training step first, so it is not timed as evaluation
            t_eval = time.perf_counter()
            val.append((step, evaluate(state.params)))
            if on_eval is not None:
                on_eval(step, state.params)
            progress.clear()
            print(f"{label} step {step:5d}  train {float(loss):.4f}  val {val[-1][1]:.4f}", flush=True)
            eval_time += time.perf_counter() - t_eval
            progress.t0 += time.perf_counter() - t_eval  # keep evaluation out of the speed display
            progress.update(step, loss)
    progress.clear()
    elapsed = time.perf_counter() - t_start - eval_time
    if args.save:
        save_model(pathlib.Path(args.save) / run, run, args, model, state.params)
        print(f"{label} saved to {pathlib.Path(args.save) / run}", flush=True)
    losses = np.asarray(jnp.stack(losses))
    tail = max(1, args.steps // 10)
    return {
        "run": run,
        "mesh": mesh_name(args.mesh),
        "train_loss": losses.tolist(),
        "val_loss": val,
        "final_train_loss": float(losses[-tail:].mean()),
        "final_val_loss": val[-1][1],
        "ms_per_step": 1e3 * elapsed / max(args.steps - 1, 1),
    }


COLORS = {"plain": "tab:orange", "rht": "tab:green", "sr": "tab:purple", "full": "tab:red", "full-est": "tab:brown"}
COLORS.update({"4o6": "tab:cyan", "per-token": "tab:olive", "full-keep-last": "tab:pink", "bf16": "tab:blue"})


def parse_runs(text: str) -> tuple[str, ...]:
    """``full,bf16`` or ``all`` -> the runs' names, for argparse."""
    runs = RUNS if text == "all" else tuple(dict.fromkeys(r.strip() for r in text.split(",")))
    if not runs or any(r not in RUNS for r in runs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'all' or a comma-separated list of {', '.join(RUNS)}")
    return runs


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(x, np.ones(window) / window, mode="valid")


def plot(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """Smoothed training loss (solid) and validation loss (dashed, dots) of each run, the last half zoomed,
    and each NVFP4 run's validation loss relative to bf16's."""
    panels = 3 if "bf16" in results and len(results) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    window = max(1, args.steps // 50)
    for name, r in results.items():
        color = COLORS[name]
        x = np.arange(window, args.steps + 1)
        y = smooth(np.asarray(r["train_loss"]), window)
        vs, vl = (np.asarray(v) for v in zip(*r["val_loss"], strict=True))
        for ax, first in zip(axes[:2], (0, args.steps // 2), strict=True):
            ax.plot(x[x >= first], y[x >= first], color=color, lw=1.2, label=name)
            ax.plot(vs[vs >= first], vl[vs >= first], "o--", color=color, alpha=0.7)
        if panels == 3 and name != "bf16":
            bf16 = np.asarray([v for _, v in results["bf16"]["val_loss"]])
            axes[2].plot(vs, 100 * (vl / bf16 - 1), "o-", color=color, label=name)
    titles = (f"training loss (moving avg {window}); dashed: validation", "second half")
    for ax, title in zip(axes[:2], titles, strict=True):
        ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
        ax.grid(alpha=0.3)
    axes[1].set_xlim(args.steps // 2, args.steps * 1.02)
    axes[0].legend()
    if panels == 3:
        axes[2].axhline(0, color=COLORS["bf16"], lw=1)
        axes[2].set(xlabel="step", ylabel="% above bf16", title="validation loss vs bf16")
        axes[2].grid(alpha=0.3)
        axes[2].legend()
    fig.suptitle(
        f"byte-level LM on stdlib source: d_model {args.d_model}, {args.layers} layers, "
        f"batch {args.batch}x{args.seq_len}, NVFP4 weight blocks {args.weight_blocks}"
        + (f", mesh {mesh_name(args.mesh)}" if args.mesh else "")
        + (f", MLP {describe_moe(args)}" if getattr(args, "moe", 0) else "")
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    plt.close(fig)


def prepare_data(args: argparse.Namespace) -> tuple[np.ndarray, dict[str, Any]]:
    """The training windows' starts [steps, batch] and the data ({"train": bytes, "val_batches": [...]}), the
    same for every run: one numpy RNG for training, evenly spaced fixed windows for validation."""
    corpus = load_corpus()
    split = int(0.95 * len(corpus))
    train_data, val_data = corpus[:split], corpus[split:]
    train_starts = np.random.default_rng(args.seed).integers(0, split - args.seq_len - 1, (args.steps, args.batch))
    val_starts = np.linspace(0, len(val_data) - args.seq_len - 1, EVAL_WINDOWS).astype(np.int64)
    val_windows = windows(val_data, val_starts, args.seq_len)
    val_batches = [jnp.asarray(w) for w in np.split(val_windows, EVAL_WINDOWS // EVAL_BATCH)]
    print(f"corpus: {len(corpus) / 1e6:.2f} MB of stdlib source ({len(train_data)} train / {len(val_data)} val bytes)")
    return train_starts, {"train": train_data, "val_batches": val_batches}


def describe_moe(args: argparse.Namespace) -> str:
    """The MoE MLP's settings (--moe, --dispatch, --capacity-factor), for the table and the plot."""
    text = f"{args.moe} experts top-{MOE_TOP_K}"
    if getattr(args, "dispatch", "ragged") == "capacity":
        text += f", capacity factor {args.capacity_factor:g}"
    return text


def describe(run: str, args: argparse.Namespace) -> str:
    """What a run's linear layers do, for the results table."""
    if getattr(args, "moe", 0):
        dense = describe(run, argparse.Namespace(**{**vars(args), "moe": 0}))
        return dense + f", MLP {describe_moe(args)}"
    if run == "bf16":
        return "bf16"
    if run in RULE_RUNS:
        return describe(RULE_RUNS[run], args) + ", last block bf16 (by rules)"
    recipe = RECIPES[run]
    parts = [f"NVFP4, {args.weight_blocks} weights"]
    if recipe.rht:
        parts.append("RHT" + (" (amax estimated)" if recipe.rht_amax_estimate else ""))
    if recipe.stochastic_rounding:
        parts.append("SR")
    if (fos := recipe.four_over_six) is not None:
        operands = {"weights": "W", "activations": "x", "all": "x, W, dy"}[fos.operands]
        parts.append(
            f"4over6 ({operands}; {fos.error.upper()}, E4M3 max {fos.e4m3_max}"
            + (", fast math" if fos.fast_math else "")
            + ")"
        )
    rows = [name for name, on in (("x", recipe.row_scaled_activations), ("dy", recipe.row_scaled_gradients)) if on]
    if rows:
        parts.append(f"per-token scales ({', '.join(rows)})")
    return " + ".join(parts)


def val_gaps(by_seed: dict[int, dict[str, dict[str, Any]]], run: str) -> np.ndarray:
    """[seeds, evaluations]: each seed's validation loss of ``run`` relative to that seed's bf16 run, in %."""
    return np.asarray(
        [
            [100 * (v / b - 1) for (_, v), (_, b) in zip(r[run]["val_loss"], r["bf16"]["val_loss"], strict=True)]
            for r in by_seed.values()
        ]
    )


def print_seed_table(by_seed: dict[int, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """Mean and sample standard deviation over the seeds of each run's final losses and gap to bf16."""
    n = len(by_seed)
    print(f"\n{n} seeds ({', '.join(map(str, by_seed))}): mean ± standard deviation over the seeds")
    print(
        "\n| run | recipe | train loss | val loss | val gap vs bf16 (same seed) | ms/step |\n|---|---|---|---|---|---|"
    )
    for run in args.runs:
        train_loss = np.asarray([r[run]["final_train_loss"] for r in by_seed.values()])
        val = np.asarray([r[run]["final_val_loss"] for r in by_seed.values()])
        ms = np.mean([r[run]["ms_per_step"] for r in by_seed.values()])
        gap = "-"
        if run != "bf16" and "bf16" in args.runs:
            final = val_gaps(by_seed, run)[:, -1]
            gap = f"{final.mean():+.2f}% ± {final.std(ddof=1):.2f}%"
        losses = f"{train_loss.mean():.4f} ± {train_loss.std(ddof=1):.4f} | {val.mean():.4f} ± {val.std(ddof=1):.4f}"
        print(f"| {run} | {describe(run, args)} | {losses} | {gap} | {ms:.1f} |")


def plot_seeds(by_seed: dict[int, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    """Each NVFP4 run's validation gap to bf16 over training: the mean over the seeds and a band of ± one
    standard deviation, next to <out>-seeds.png."""
    if "bf16" not in args.runs:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in args.runs:
        if run == "bf16":
            continue
        steps = [step for step, _ in next(iter(by_seed.values()))[run]["val_loss"]]
        gaps = val_gaps(by_seed, run)
        mean, sd = gaps.mean(0), gaps.std(0, ddof=1)
        ax.plot(steps, mean, "o-", color=COLORS[run], label=run)
        ax.fill_between(steps, mean - sd, mean + sd, color=COLORS[run], alpha=0.2)
    ax.axhline(0, color=COLORS["bf16"], lw=1)
    ax.set(
        xlabel="step",
        ylabel="% above bf16 (same seed)",
        title=f"validation loss vs bf16: mean ± sd of {len(by_seed)} seeds",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = pathlib.Path(args.out).with_name(pathlib.Path(args.out).stem + "-seeds.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


def make_parser() -> argparse.ArgumentParser:
    """The example's command line (its defaults are the recorded runs' settings)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
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
        "--runs",
        type=parse_runs,
        default=("full", "bf16"),
        help=f"comma-separated runs of {', '.join(RUNS)}, or 'all' (default: full,bf16)",
    )
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--out", default="train_lm.png", help="where to write the loss plot")
    parser.add_argument("--json", default=None, help="optionally, where to write the results as JSON")
    parser.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write each trained model to DIR/<run> (NVFP4 layers' weights quantized; orbax), for examples/generate.py",
    )
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help="train sharded on a device mesh, e.g. data=2,fsdp=2,tensor=2 (axes not named: 1); the sizes' product "
        "must be the device count (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    if args.d_model % args.heads or min(args.steps, args.eval_every, args.batch, args.seeds) < 1:
        parser.error("--d-model must be a multiple of --heads; --steps, --eval-every, --batch and --seeds at least 1")
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
            print(f"| {run} | {describe(run, args)} | {losses} | {gap} | {r['ms_per_step']:.1f} |")
    else:
        print_seed_table(by_seed, args)
        plot_seeds(by_seed, args)
    tail = max(1, args.steps // 10)
    print(f"\ntrain loss: mean of the last {tail} steps; total time {time.perf_counter() - t0:.0f}s")

    plot(results, args)
    print(f"wrote {args.out}")
    if args.json:
        args_json = {**vars(args), "mesh": mesh_name(args.mesh)}
        out = {"args": args_json, "results": results}
        if args.seeds > 1:
            out["results_by_seed"] = {str(seed): r for seed, r in by_seed.items()}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
