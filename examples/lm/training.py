"""The training example's training loop: one run (a model of ``build_model``) trained on the shared batches, with
its evaluations and timing, optionally sharded over a device mesh; and saving a trained model for inference.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.lm.data import windows
from examples.lm.mesh import BATCH, mesh_name, shard_state, sharded_params
from examples.lm.model import MODEL_ARGS, RECIPES, TransformerLM, build_model, describe, kv_heads, next_byte_loss
from jax_nvfp4 import checkpoint
from jax_nvfp4.flax.linen.layers import cache_weights, quantize_weights

LOAD_BALANCE = 0.01  # --moe: the weight of the load-balancing loss in the training loss


def save_model(directory: pathlib.Path, run: str, args: argparse.Namespace, model: TransformerLM, params: Any) -> None:
    """Write a trained model for inference to ``directory``: ``params/``, its parameters with the NVFP4 layers'
    kernels quantized (``QuantizedWeight``) by ``jax_nvfp4.checkpoint`` (orbax), and ``config.json``, the run and
    the MODEL_ARGS that rebuild the model (``build_model``)."""
    if run in RECIPES:
        params = quantize_weights(params, model=model, inputs=(jnp.zeros((1, args.seq_len), jnp.int32),))
    # On the host, unsharded: the checkpoint then restores on any number of devices. With several processes
    # (--processes) each gathers the whole tree from all of them, and all take part in the save (orbax).
    host = jax.device_get(params) if jax.process_count() == 1 else multihost_utils.process_allgather(params, tiled=True)
    checkpoint.save(directory / "params", host)
    config = {"run": run, **{name: getattr(args, name) for name in MODEL_ARGS}, "kv_heads": kv_heads(args)}
    if jax.process_index() == 0:  # one writer
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


def optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with warmup and cosine decay to a tenth of --lr, its updates clipped to global norm 1."""
    # A tenth of the steps warm up; at least one step is left to the decay (a one-step run takes --lr).
    warmup = min(max(1, args.steps // 10), args.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    decay_mask = functools.partial(jax.tree.map, lambda p: p.ndim >= 2)  # no decay on biases and norms
    adamw = optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


def init_state(
    model: nn.Module, args: argparse.Namespace, mesh: jax.sharding.Mesh | None = None
) -> tuple[train_state.TrainState, Callable, Callable]:
    """The model's initial training state (parameters from --seed and optimizer state, sharded over mesh if one is
    given), the ``jax.jit`` that compiles its training step (the state donated; on a mesh, the step's outputs
    pinned to the state's shardings) and ``put``, which places a batch (numpy, the same on every process) on the
    mesh, split over data x fsdp (no mesh: as it is)."""
    init = lambda: model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]  # noqa: E731
    params = nn.unbox(init()) if mesh is None else sharded_params(init, mesh)
    # The optimizer's moments are zeros_like(params): they take the params' shardings.
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer(args))
    jit_step, put = functools.partial(jax.jit, donate_argnums=0), lambda batch: batch
    if mesh is not None:
        state, shardings = shard_state(state, mesh)
        jit_step = functools.partial(jit_step, out_shardings=(shardings, NamedSharding(mesh, P())))
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, P(BATCH)))
    return state, jit_step, put


def make_train_step(
    loss_fn: Callable[..., jax.Array],
    *,
    rounding_key: jax.Array,
    jit_step: Callable,
    grad_accum: int = 1,
    cache_fn: Callable[[Any, jax.Array], Any] | None = None,
) -> tuple[Callable, Callable]:
    """The jitted training step of a model's loss ``loss_fn(params, batch, key, load_balance, cache)`` (stochastic
    rounding: ``rounding_key`` folded with the step count) and the jitted evaluation of its loss.

    ``grad_accum`` > 1: the batch is split into that many micro-batches whose gradients a ``lax.scan`` sums (each
    micro-batch's key folded in); ``cache_fn(params, batch)`` then quantizes the weights once for the step, which
    every micro-batch reads (None: each quantizes them itself)."""

    @jit_step
    def train_step(state: train_state.TrainState, batch: jax.Array) -> tuple[train_state.TrainState, jax.Array]:
        key = jax.random.fold_in(rounding_key, state.step)
        if grad_accum == 1:
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, key, LOAD_BALANCE)
            return state.apply_gradients(grads=grads), loss
        micro = batch.reshape(grad_accum, -1, batch.shape[-1])
        cache = None if cache_fn is None else cache_fn(state.params, micro[0])

        def accumulate(total, i):
            step = jax.value_and_grad(loss_fn)(state.params, micro[i], jax.random.fold_in(key, i), LOAD_BALANCE, cache)
            return jax.tree.map(jnp.add, total, step), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = lax.scan(accumulate, zeros, jnp.arange(grad_accum))
        return state.apply_gradients(grads=jax.tree.map(lambda g: g / grad_accum, grads)), loss / grad_accum

    return train_step, jax.jit(loss_fn)


def weight_cache(model: nn.Module) -> Callable[[Any, jax.Array], Any]:
    """``cache_fn`` for ``make_train_step``: the NVFP4 layers' weights of ``model`` quantized once (found by a
    forward pass on one window of the batch, which XLA drops inside the step but for the weights' quantization)."""
    return lambda params, batch: cache_weights(params, model=model, inputs=(batch[:1, :-1],))


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
    switch_step, switch_to = switch_of(run, args)
    state, jit_step, put = init_state(model, args, mesh)
    rounding_key = jax.random.key(args.seed + 1)  # stochastic rounding: a fresh key each step, folded in
    grad_accum = getattr(args, "grad_accum", 1)
    make_steps = functools.partial(make_train_step, rounding_key=rounding_key, jit_step=jit_step, grad_accum=grad_accum)
    train_step, eval_step = make_steps(functools.partial(next_byte_loss, model), cache_fn=weight_cache(model))

    def evaluate(params: Any) -> float:
        return float(np.mean([eval_step(params, put(b)) for b in data["val_batches"]]))

    label = f"{run:>8}"
    progress, losses, val, eval_time = Progress(label, args.steps), [], [], 0.0
    for step in range(1, args.steps + 1):
        if step == switch_step:  # the precision schedule: the same parameters and optimizer state from here on
            jax.block_until_ready(state)
            t_switch = time.perf_counter()
            model = build_model(switch_to, args, mesh)
            train_step, eval_step = make_steps(functools.partial(next_byte_loss, model), cache_fn=weight_cache(model))
            progress.clear()
            print(f"{label} step {step:5d}  switched to {describe(switch_to, args)}", flush=True)
        state, loss = train_step(state, put(windows(data["train"], train_starts[step - 1], args.seq_len)))
        losses.append(loss)
        if step == switch_step:  # its compilation is not timed (nor the step)
            loss.block_until_ready()
            eval_time += time.perf_counter() - t_switch
            progress.t0 += time.perf_counter() - t_switch
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
    if args.save:  # the model as it ends (after a switch, switch_to's)
        save_model(pathlib.Path(args.save) / run, switch_to or run, args, model, state.params)
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
        "ms_per_step": 1e3 * elapsed / max(args.steps - 1 - (switch_step is not None), 1),
        "switch": None if switch_step is None else {"step": switch_step, "to": switch_to},
    }


def switch_of(run: str, args: argparse.Namespace) -> tuple[int | None, str | None]:
    """The precision schedule of ``run`` (``--switch-at F --switch-to RUN``): the first step trained as RUN (the
    last 1 - F of the steps) and RUN, or (None, None) where there is none (no flags, or RUN is the run itself)."""
    switch_to = getattr(args, "switch_to", None)
    if switch_to is None or switch_to == run:
        return None, None
    return first_switched_step(args.switch_at, args.steps), switch_to


def first_switched_step(fraction: float, steps: int) -> int:
    """The first step of the switched part: after round(fraction x steps) steps, at least one on each side."""
    return min(max(round(fraction * steps), 1), steps - 1) + 1
