"""The training example's sharded model (``python -m examples.train_lm --mesh``) on 8 CPU devices, made small."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import eqns_named, needs_8_cpus, needs_8_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from examples import train_lm
from examples.lm import distributed, training
from examples.lm.data import VOCAB, prepare_data
from examples.lm.mesh import BATCH, make_mesh, parse_mesh, sharded_params
from examples.lm.model import RECIPES, RUNS, build_model, describe, next_byte_loss
from examples.lm.report import COLORS
from examples.lm.training import LOAD_BALANCE
from jax_nvfp4.sharding.hlo import collectives

pytestmark = needs_8_cpus


def _args(mesh: str) -> argparse.Namespace:
    return argparse.Namespace(
        batch=8, seq_len=32, d_model=64, layers=1, heads=2, weight_blocks="16x16", mesh=parse_mesh(mesh)
    )


def _loss_and_grad(args, mesh, run: str):
    """The jitted loss and gradients of the NVFP4 model (recipe ``run``) on a fixed batch, sharded over mesh (None:
    not), as a function of (params, batch, stochastic-rounding key)."""
    model = build_model(run, args, mesh)
    init = lambda: model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]  # noqa: E731
    params = nn.unbox(init()) if mesh is None else sharded_params(init, mesh)
    batch = np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.seq_len + 1), np.int32)
    if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, P(BATCH)))

    return jax.jit(jax.value_and_grad(functools.partial(next_byte_loss, model))), params, batch


@needs_8_devices
@pytest.mark.parametrize(
    "arch, layers",
    [
        ("gpt", ("q", "k", "v", "out", "mlp_up", "mlp_down")),
        ("qwen3", ("q", "k", "v", "out", "mlp_gate", "mlp_up", "mlp_down")),
    ],
)
def test_sharded_step_gathers_the_nvfp4_weights_as_packed_bytes(arch, layers):
    """qwen3: its 2 key/value heads split over tensor=2 as its 4 query heads do."""
    args = argparse.Namespace(**{**vars(_args("data=2,fsdp=2,tensor=2")), "arch": arch, "heads": 4})
    step, params, batch = _loss_and_grad(args, make_mesh(args.mesh, args), "full")
    hlo = step.lower(params, batch, jax.random.key(0)).compile().as_text()
    gathers = [c for c in collectives(hlo) if c.op == "all-gather"]
    in_gemms = [c for c in gathers if "NVFP4DotGeneral" in c.op_name]
    # Each NVFP4 layer gathers its FSDP-sharded weight, codes and scales, in the forward and backward.
    assert {re.search(r"/(block0/\w+)/NVFP4DotGeneral", c.op_name).group(1) for c in in_gemms} == {
        f"block0/{name}" for name in layers
    }
    assert {c.dtype for c in in_gemms} == {"u8"}
    # The layers' other gathers are their biases (gpt) or norms' scales (qwen3), 1-D.
    paths = tuple(f"/{name}/" for name in layers)
    assert all(len(c.shape) == 1 for c in gathers if any(s in c.op_name for s in paths) and c not in in_gemms)


@needs_8_devices
@pytest.mark.parametrize("mesh", ["data=8", "data=2,fsdp=4"])
def test_data_and_fsdp_sharding_give_the_unsharded_step(mesh, monkeypatch):
    """In float32 (no bf16 fusion differences) data and FSDP sharding change no value: each NVFP4 GEMM sees the
    same bytes, and the amax is reduced over the mesh. The plain recipe: with stochastic rounding each shard
    draws its own random bits. With the RHT, one column of mlp_up's weight gradient differed by a block-scale
    step: the layers' float32 inputs and gradients, read out of the sharded program, differ from the unsharded
    ones in last bits, and a sum of 16 of them moved a block scale. tests/test_sharding.py checks the RHT's
    sharded step on an MLP whose intermediates it controls."""
    monkeypatch.setattr("examples.lm.model.DTYPE", jnp.float32)
    args = _args(mesh)
    want_loss, want_grads = (lambda f, p, b: f(p, b))(*_loss_and_grad(args, None, "plain"))
    got_loss, got_grads = (lambda f, p, b: f(p, b))(*_loss_and_grad(args, make_mesh(args.mesh, args), "plain"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)  # its mean sums the shards in another order
    # Gradients: their f32 sums over the batch shards are added in another order. (The key bias's gradient is 0
    # but for rounding, so the tolerance is relative to the largest gradient.)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


def test_the_four_over_six_and_per_token_runs_are_their_recipes():
    recipes = RECIPES
    assert recipes["4o6"] == dataclasses.replace(recipes["plain"], four_over_six=jax_nvfp4.FourOverSix("all"))
    assert recipes["4o6"] == jax_nvfp4.Recipe(
        rht=False, stochastic_rounding=False, four_over_six=jax_nvfp4.FourOverSix("all")
    )
    assert (recipes["4o6"].four_over_six.error, recipes["4o6"].four_over_six.e4m3_max) == ("mse", 256)
    assert recipes["per-token"] == dataclasses.replace(
        recipes["plain"], row_scaled_activations=True, row_scaled_gradients=True
    )
    assert recipes["4o6-mae"] == dataclasses.replace(
        recipes["4o6"], four_over_six=jax_nvfp4.FourOverSix("all", error="mae")
    )
    assert {"plain", "4o6", "4o6-mae", "per-token", "full-keep-ends", "bf16"} <= set(train_lm.parse_runs("all"))
    args = _args("data=1")
    assert describe("4o6", args) == "NVFP4, 16x16 weights + 4over6 (x, W, dy; MSE, E4M3 max 256)"
    assert describe("4o6-mae", args) == "NVFP4, 16x16 weights + 4over6 (x, W, dy; MAE, E4M3 max 256)"
    assert describe("full-keep-last", args) == "NVFP4, 16x16 weights + RHT + SR, last block bf16 (by rules)"
    assert describe("full-keep-ends", args) == "NVFP4, 16x16 weights + RHT + SR, first and last blocks bf16 (by rules)"
    assert describe("full-mxfp8-attn", args).endswith("+ SR, attention projections MXFP8 (by rules)")
    assert describe("per-token", args) == "NVFP4, 16x16 weights + per-token scales (x, dy)"


def test_every_run_has_its_colour_and_description():
    """The plots draw each run in its colour (a run without one fails at the end of training)."""
    assert set(COLORS) == set(RUNS)
    args = _args("data=1")
    assert describe("full-keep-down", args).endswith("+ SR, MLP down projections bf16 (by rules)")
    assert describe("full-keep-attn", args).endswith("+ SR, attention projections bf16 (by rules)")


def test_moe_blocks_train_in_nvfp4():
    """--moe 4: each block's MLP is 4 experts (top-2, hidden 2 x d_model) whose GEMMs are NVFP4 ragged_dots."""
    args = argparse.Namespace(**{**vars(_args("data=1")), "moe": 4})
    step, params, batch = _loss_and_grad(args, None, "full")
    moe = params["block0"]["moe"]
    assert moe["up"].shape == (4, 64, 128) and moe["down"].shape == (4, 128, 64) and "mlp_up" not in params["block0"]
    jaxpr = jax.make_jaxpr(step)(params, batch, jax.random.key(0))
    # Every expert GEMM is NVFP4: per block and projection one grouped quantize of x (forward) and one of dy
    # (backward), and three grouped GEMMs of their decoded blocks (fprop, dgrad, wgrad).
    blocks = sum(name.startswith("block") for name in params)
    assert len(eqns_named(jaxpr, "nvfp4_grouped_quantize")) == 4 * blocks
    assert len(eqns_named(jaxpr, "ragged_dot_general")) == 6 * blocks
    loss, grads = step(params, batch, jax.random.key(0))
    assert np.isfinite(loss)
    for name in ("up", "down"):
        assert np.all(np.isfinite(grads["block0"]["moe"][name])) and np.any(grads["block0"]["moe"][name])
    assert np.any(grads["block0"]["moe"]["router"]["kernel"])


def test_moe_capacity_dispatch_trains_in_nvfp4():
    """--moe 16 --dispatch capacity on the smallest model the example allows (1 layer, 1 head, d_model 32, a
    batch of 2 x 16 tokens: C = ceil(1.25 x 32 x 2 / 16) = 5 slots per expert): each expert GEMM is a batched
    NVFP4 dot_general (no ragged_dot, no plain dot_general batched over the experts), and three Adam steps of
    the full recipe (fresh stochastic-rounding keys) give finite losses and gradients that reach the experts
    and the router, the loss going down on the repeated batch."""
    flags = "--moe 16 --dispatch capacity --batch 2 --seq-len 16 --d-model 32 --layers 1 --heads 1 --runs full"
    args = train_lm.make_parser().parse_args(flags.split())
    model = build_model("full", args)
    init = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))
    params = nn.unbox(init)["params"]
    assert params["block0"]["moe"]["up"].shape == (16, 32, 64)
    batch = np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.seq_len + 1), np.int32)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt, key):
        loss_fn = functools.partial(next_byte_loss, model, batch=batch, key=key)
        loss, grads = jax.value_and_grad(loss_fn)(params, load_balance=LOAD_BALANCE)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, loss, grads

    traced = step.trace(params, tx.init(params), jax.random.key(0))
    # 6 NVFP4 layers (q, k, v, out, the experts' up and down) x (fprop, dgrad, wgrad); no grouped GEMM.
    assert len(eqns_named(traced.jaxpr, "nvfp4_gemm")) == 18 and not eqns_named(traced.jaxpr, "ragged_dot_general")
    # The bf16 run's expert GEMMs are dot_generals batched over the 16 experts (dimensions 0 x 0): none here. (The
    # float32 gate weighting is batched over the 32 tokens.)
    dots = eqns_named(traced.jaxpr, "dot_general")
    assert not [e for e in dots if e.params["dimension_numbers"][1] == ((0,), (0,)) and e.invars[0].aval.shape[0] == 16]
    step, opt, losses = traced.lower().compile(), tx.init(params), []
    for i in range(3):
        params, opt, loss, grads = step(params, opt, jax.random.key(i))
        losses.append(float(loss))
        moe = grads["block0"]["moe"]
        assert all(np.all(np.isfinite(g)) and np.any(g) for g in (moe["up"], moe["down"], moe["router"]["kernel"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    "flags",
    [
        ["--moe", "4", "--save", "ckpt"],
        ["--moe", "1"],
        ["--moe", "4", "--runs", "full-keep-last"],
        ["--dispatch", "capacity"],
        ["--moe", "4", "--dispatch", "capacity", "--capacity-factor", "0"],
    ],
)
def test_moe_refuses_what_it_does_not_support(flags, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_lm.py", *flags])
    with pytest.raises(SystemExit):
        train_lm.main()
    assert "--moe" in capsys.readouterr().err


def test_every_run_has_the_bf16_models_parameters():
    """What --switch-at / --switch-to rely on: any run's parameters are any other's (names, shapes, dtypes)."""
    args = train_lm.make_parser().parse_args(["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16"])
    for moe in (0, 4):
        args.moe = moe
        tokens = jnp.zeros((1, args.seq_len), jnp.int32)
        shapes = {r: jax.eval_shape(build_model(r, args).init, jax.random.key(0), tokens)["params"] for r in RUNS}
        shapes = {r: jax.tree.map(lambda a: (a.shape, a.dtype), nn.unbox(p)) for r, p in shapes.items()}
        assert all(shapes[r] == shapes["bf16"] for r in RUNS), moe


def test_a_precision_schedule_switches_the_run_part_way():
    """--switch-at 0.5 --switch-to bf16 on 4 steps: steps 1-2 are the full recipe's, steps 3-4 the bf16 model's
    on the same parameters and optimizer state (the same batches and keys)."""
    flags = "--steps 4 --batch 2 --seq-len 16 --d-model 32 --layers 1 --heads 2 --eval-every 4 --runs full"
    args = train_lm.make_parser().parse_args(flags.split())
    train_starts, data = prepare_data(args)
    full = training.train("full", args, train_starts, data)
    switched_args = train_lm.make_parser().parse_args([*flags.split(), "--switch-at", "0.5", "--switch-to", "bf16"])
    switched = training.train("full", switched_args, train_starts, data)
    assert full["switch"] is None and switched["switch"] == {"step": 3, "to": "bf16"}
    assert switched["train_loss"][:2] == full["train_loss"][:2]
    assert all(a != b for a, b in zip(switched["train_loss"][2:], full["train_loss"][2:], strict=True))
    assert training.switch_of("bf16", switched_args) == (None, None)  # the run switched to is not switched


def test_grad_accum_reads_the_weights_quantized_once_per_step(monkeypatch, capsys):
    """--grad-accum 2 sums two micro-batches' gradients in a lax.scan; with the weight cache no weight is
    quantized in the loop (seven fewer quantizes there than each micro-batch quantizing its weights), and the
    step trains. A count that does not divide --batch is refused. (The cache's outputs and gradients against
    quantizing in each GEMM: tests/flax/test_cache.py, tests/gemm/test_cached_weight.py.)"""
    flags = "--steps 1 --batch 4 --seq-len 16 --d-model 32 --layers 1 --heads 2 --runs full --grad-accum 2"
    args = train_lm.make_parser().parse_args(flags.split())
    model = build_model("full", args, None)
    state = training.init_state(model, args)[0]
    make = functools.partial(training.make_train_step, rounding_key=jax.random.key(1), jit_step=jax.jit, grad_accum=2)
    cached = make(functools.partial(next_byte_loss, model), cache_fn=training.weight_cache(model))[0]
    plain = make(functools.partial(next_byte_loss, model))[0]
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 17), np.int32))
    counts = []
    for step in (cached, plain):  # quantizes in the loop over micro-batches (traced, not compiled)
        (scan,) = eqns_named(jax.make_jaxpr(step)(state, batch), "scan")
        counts.append(len(eqns_named(scan.params["jaxpr"], "nvfp4_quantize")))
    assert counts[1] - counts[0] == 7, counts  # the default (qwen3) block's q, k, v, out, mlp_gate, mlp_up, mlp_down
    new_state, loss = cached(state, batch)
    assert np.isfinite(float(loss)) and int(new_state.step) == 1
    monkeypatch.setattr(sys, "argv", ["train_lm.py", "--batch", "8", "--grad-accum", "3"])
    with pytest.raises(SystemExit):
        train_lm.main()
    assert "--grad-accum" in capsys.readouterr().err


SWITCH_ERRORS = [["--switch-at", "0.5"], ["--switch-to", "bf16"], ["--switch-at", "1", "--switch-to", "bf16"]]


@pytest.mark.parametrize("flags", SWITCH_ERRORS)
def test_a_precision_schedule_needs_both_flags_and_a_fraction(flags, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_lm.py", *flags])
    with pytest.raises(SystemExit):
        train_lm.main()
    assert "--switch-at" in capsys.readouterr().err


PROCESSES_ERRORS = [
    (["--processes", "2"], "--processes 2 needs a --mesh"),
    (["--processes", "3", "--mesh", "fsdp=8"], "multiple of it"),
    (["--processes", "0"], "at least 1"),
    (["--processes", "2", "--process-id", "0"], "go together"),
    (["--processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"], "must be in [0, 2)"),
    (["--coordinator", "auto", "--process-id", "0"], "--coordinator auto"),
]


@pytest.mark.parametrize(("flags", "message"), PROCESSES_ERRORS)
def test_processes_flags_that_do_not_fit_are_refused(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_lm.py", *flags])
    with pytest.raises(SystemExit):
        train_lm.main()
    assert message in capsys.readouterr().err


def test_processes_reruns_the_command_as_that_many_processes(monkeypatch):
    """--processes 2 --mesh fsdp=8: this process only launches two of 4 CPU devices each, the same flags plus their
    process id and the coordinator (tests/multiprocess/ runs the launcher and a training step that way)."""
    flags = ["--processes", "2", "--mesh", "fsdp=8", "--steps", "2"]
    calls = []
    monkeypatch.setattr(distributed, "launch", lambda *args, **kwargs: calls.append((args, kwargs)) or ["", ""])
    monkeypatch.setattr(sys, "argv", ["train_lm.py", *flags])
    with pytest.raises(SystemExit) as exited:
        train_lm.main()
    assert exited.value.code == 0 and len(calls) == 1
    (command, processes, local_devices), kwargs = calls[0]
    assert (processes, local_devices, kwargs) == (2, 4, {"show_first": True})
    assert command(1, "127.0.0.1:1234") == [
        sys.executable,
        *("-m", "examples.train_lm", *flags),
        *("--process-id", "1", "--coordinator", "127.0.0.1:1234"),
    ]


@pytest.mark.parametrize("steps", [1, 2, 1400])
def test_the_schedule_warms_up_a_tenth_and_leaves_a_step_to_decay(steps):
    # --steps 1 used to fail in optax (a cosine decay of 0 steps); longer runs keep their schedule.
    args = argparse.Namespace(lr=1e-3, steps=steps)
    params = {"w": jnp.ones((2, 2))}
    tx = training.optimizer(args)
    updates, _ = tx.update({"w": jnp.ones((2, 2))}, tx.init(params), params)
    first = float(jnp.abs(updates["w"]).max())
    assert (first > 0) == (steps == 1)  # the warmup starts at 0 wherever it has a step
