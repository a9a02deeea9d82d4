"""Train a small byte-level transformer with NVFP4 linear layers and compare it with bf16.

The corpus is the Python standard library's own source, which every machine has offline: ~4 MB of
bytes in a fixed order, the last 5% held out for validation. Both runs start from the same initial
weights and see the same batches; only the linear layers inside the transformer blocks differ
(NVFP4 or bf16). The embeddings and the output head stay in bf16, as in NVIDIA's NVFP4 recipe.
Prints a table of final losses and step times and writes a plot of both loss curves.

    python examples/train_lm.py [--steps N] [--only both|nvfp4|bf16] [--out train_lm.png]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax.training import train_state

import jax_nvfp4
from jax_nvfp4.flax import NVFP4Dense, NVFP4DenseGeneral

matplotlib.use("Agg")
import matplotlib.pyplot as plt

VOCAB = 256  # bytes
EVAL_WINDOWS, EVAL_BATCH = 256, 64  # fixed validation set: 256 windows, evenly spaced over the held-out bytes
DTYPE = jnp.bfloat16  # activations; parameters stay float32


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


class Block(nn.Module):
    """Pre-LayerNorm block: causal multi-head self-attention, then a GELU MLP."""

    heads: int
    dense_cls: Callable[..., nn.Module]
    dense_general_cls: Callable[..., nn.Module]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        head_dim = d_model // self.heads
        h = nn.LayerNorm(dtype=DTYPE)(x)
        q, k, v = (self.dense_general_cls((self.heads, head_dim), dtype=DTYPE, name=n)(h) for n in ("q", "k", "v"))
        # Scores and softmax in f32: bf16 is too coarse for the exponentials and their sum.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(DTYPE)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        x = x + self.dense_general_cls(d_model, axis=(-2, -1), dtype=DTYPE, name="out")(attn)
        h = nn.LayerNorm(dtype=DTYPE)(x)
        # Exact (erf) GELU: on CPU it is faster than the tanh approximation.
        h = nn.gelu(self.dense_cls(4 * d_model, dtype=DTYPE, name="mlp_up")(h), approximate=False)
        return x + self.dense_cls(d_model, dtype=DTYPE, name="mlp_down")(h)


class TransformerLM(nn.Module):
    """Decoder-only byte-level language model; returns float32 logits."""

    d_model: int
    layers: int
    heads: int
    max_len: int
    dense_cls: Callable[..., nn.Module] = nn.Dense
    dense_general_cls: Callable[..., nn.Module] = nn.DenseGeneral

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)  # one scale for both, so positions are not drowned out by tokens
        x = nn.Embed(VOCAB, self.d_model, dtype=DTYPE, embedding_init=init, name="embed")(tokens)
        pos = self.param("pos_embed", init, (self.max_len, self.d_model))
        x = x + pos[: tokens.shape[1]].astype(DTYPE)
        for i in range(self.layers):
            x = Block(self.heads, self.dense_cls, self.dense_general_cls, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=DTYPE, name="final_norm")(x)
        return nn.Dense(VOCAB, dtype=DTYPE, name="head")(x).astype(jnp.float32)


def build_model(precision: str, args: argparse.Namespace) -> TransformerLM:
    """The same architecture; only the block's linear layers depend on the precision."""
    if precision == "nvfp4":
        recipe = jax_nvfp4.Recipe(weight_block_2d=args.recipe == "2d")
        dense_cls = functools.partial(NVFP4Dense, recipe=recipe)
        dense_general_cls = functools.partial(NVFP4DenseGeneral, recipe=recipe)
    else:
        dense_cls, dense_general_cls = nn.Dense, nn.DenseGeneral
    return TransformerLM(args.d_model, args.layers, args.heads, args.seq_len, dense_cls, dense_general_cls)


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


def train(precision: str, args: argparse.Namespace, train_starts: np.ndarray, data: dict[str, Any]) -> dict[str, Any]:
    """Train one model from the shared seed on the shared batches; return its losses and timing."""
    model = build_model(precision, args)

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10)
    decay_mask = functools.partial(jax.tree.map, lambda p: p.ndim >= 2)  # no decay on biases and norms
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decay_mask))
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: train_state.TrainState, batch: jax.Array) -> tuple[train_state.TrainState, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    eval_step = jax.jit(loss_fn)

    def evaluate(params: Any) -> float:
        return float(np.mean([eval_step(params, b) for b in data["val_batches"]]))

    label = f"{precision:>5}"
    progress, losses, val, eval_time = Progress(label, args.steps), [], [], 0.0
    for step in range(1, args.steps + 1):
        state, loss = train_step(state, windows(data["train"], train_starts[step - 1], args.seq_len))
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
            progress.clear()
            print(f"{label} step {step:5d}  train {float(loss):.4f}  val {val[-1][1]:.4f}", flush=True)
            eval_time += time.perf_counter() - t_eval
            progress.t0 += time.perf_counter() - t_eval  # keep evaluation out of the speed display
            progress.update(step, loss)
    progress.clear()
    elapsed = time.perf_counter() - t_start - eval_time
    losses = np.asarray(jnp.stack(losses))
    tail = max(1, args.steps // 10)
    return {
        "precision": precision,
        "train_loss": losses.tolist(),
        "val_loss": val,
        "final_train_loss": float(losses[-tail:].mean()),
        "final_val_loss": val[-1][1],
        "ms_per_step": 1e3 * elapsed / max(args.steps - 1, 1),
    }


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(x, np.ones(window) / window, mode="valid")


def plot(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """Smoothed training loss of each run with its validation points: whole run, and the last half zoomed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    window = max(1, args.steps // 50)
    for name, r in results.items():
        color = {"nvfp4": "tab:red", "bf16": "tab:blue"}[name]
        x = np.arange(window, args.steps + 1)
        y = smooth(np.asarray(r["train_loss"]), window)
        vs, vl = zip(*r["val_loss"], strict=True)
        for ax, first in zip(axes, (0, args.steps // 2), strict=True):
            ax.plot(x[x >= first], y[x >= first], color=color, label=f"{name} train (moving avg {window})")
            keep = np.asarray(vs) >= first
            ax.plot(np.asarray(vs)[keep], np.asarray(vl)[keep], "o--", color=color, alpha=0.7, label=f"{name} val")
    for ax, title in zip(axes, ("training loss", "second half"), strict=True):
        ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
        ax.grid(alpha=0.3)
    axes[1].set_xlim(args.steps // 2, args.steps * 1.02)
    axes[0].legend()
    fig.suptitle(
        f"byte-level LM on stdlib source: d_model {args.d_model}, {args.layers} layers, "
        f"batch {args.batch}x{args.seq_len}, NVFP4 recipe {args.recipe}"
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="init and data seed, shared by both runs")
    parser.add_argument("--recipe", choices=("2d", "1d"), default="2d", help="weight blocks 16x16 (2d) or 1x16 (1d)")
    parser.add_argument("--only", choices=("both", "nvfp4", "bf16"), default="both")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--out", default="train_lm.png", help="where to write the loss plot")
    parser.add_argument("--json", default=None, help="optionally, where to write the results as JSON")
    args = parser.parse_args()
    if args.d_model % args.heads or min(args.steps, args.eval_every, args.batch) < 1:
        parser.error("--d-model must be a multiple of --heads; --steps, --eval-every and --batch at least 1")
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {jax.default_backend()} ({device}), jax_nvfp4 {jax_nvfp4.__version__}")

    corpus = load_corpus()
    split = int(0.95 * len(corpus))
    train_data, val_data = corpus[:split], corpus[split:]
    # Same windows for both runs: one numpy RNG for training, evenly spaced fixed windows for validation.
    train_starts = np.random.default_rng(args.seed).integers(0, split - args.seq_len - 1, (args.steps, args.batch))
    val_starts = np.linspace(0, len(val_data) - args.seq_len - 1, EVAL_WINDOWS).astype(np.int64)
    val_windows = windows(val_data, val_starts, args.seq_len)
    val_batches = [jnp.asarray(w) for w in np.split(val_windows, EVAL_WINDOWS // EVAL_BATCH)]
    data = {"train": train_data, "val_batches": val_batches}
    print(f"corpus: {len(corpus) / 1e6:.2f} MB of stdlib source ({len(train_data)} train / {len(val_data)} val bytes)")
    shapes = jax.eval_shape(build_model("bf16", args).init, jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))
    n_params = sum(p.size for p in jax.tree.leaves(shapes))
    print(f"model: {n_params / 1e6:.2f}M params, {args.steps} steps of {args.batch}x{args.seq_len} bytes\n")

    t0 = time.perf_counter()
    runs = ("nvfp4", "bf16") if args.only == "both" else (args.only,)
    results = {p: train(p, args, train_starts, data) for p in runs}

    names = {"nvfp4": f"NVFP4 ({'16x16' if args.recipe == '2d' else '1x16'} weight blocks)", "bf16": "bf16"}
    print("\n| precision | train loss | val loss | val gap vs bf16 | ms/step |\n|---|---|---|---|---|")
    for p, r in results.items():
        gap = "-"
        if p == "nvfp4" and "bf16" in results:
            gap = f"{100 * (r['final_val_loss'] / results['bf16']['final_val_loss'] - 1):+.2f}%"
        losses = f"{r['final_train_loss']:.4f} | {r['final_val_loss']:.4f}"
        print(f"| {names[p]} | {losses} | {gap} | {r['ms_per_step']:.1f} |")
    tail = max(1, args.steps // 10)
    print(f"\ntrain loss: mean of the last {tail} steps; total time {time.perf_counter() - t0:.0f}s")

    plot(results, args)
    print(f"wrote {args.out}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
