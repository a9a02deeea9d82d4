"""The training example's sharded model (``examples/train_lm.py --mesh``) on 8 CPU devices, made small."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4.testing import collectives

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_lm

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 CPU devices (set in conftest.py)")


def _args(mesh: str) -> argparse.Namespace:
    return argparse.Namespace(
        batch=8, seq_len=32, d_model=64, layers=1, heads=2, weight_blocks="16x16", mesh=train_lm.parse_mesh(mesh)
    )


def _loss_and_grad(args, mesh, run: str):
    """The jitted loss and gradients of the NVFP4 model (recipe ``run``) on a fixed batch, sharded over mesh (None:
    not), as a function of (params, batch, stochastic-rounding key)."""
    model = train_lm.build_model(run, args, mesh)
    init = lambda: model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]  # noqa: E731
    params = nn.unbox(init()) if mesh is None else train_lm.sharded_params(init, mesh)
    batch = np.random.default_rng(0).integers(0, train_lm.VOCAB, (args.batch, args.seq_len + 1), np.int32)
    if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, P(train_lm.BATCH)))

    return jax.jit(jax.value_and_grad(functools.partial(train_lm.next_byte_loss, model))), params, batch


def test_sharded_step_gathers_the_nvfp4_weights_as_packed_bytes():
    args = _args("data=2,fsdp=2,tensor=2")
    step, params, batch = _loss_and_grad(args, train_lm.make_mesh(args.mesh, args), "full")
    hlo = step.lower(params, batch, jax.random.key(0)).compile().as_text()
    gathers = [c for c in collectives(hlo) if c.op == "all-gather"]
    in_gemms = [c for c in gathers if "NVFP4DotGeneral" in c.op_name]
    # Each of the 6 NVFP4 layers gathers its FSDP-sharded weight, codes and scales, in the forward and backward.
    assert {re.search(r"/(block0/\w+)/NVFP4DotGeneral", c.op_name).group(1) for c in in_gemms} == {
        f"block0/{name}" for name in ("q", "k", "v", "out", "mlp_up", "mlp_down")
    }
    assert {c.dtype for c in in_gemms} == {"u8"}
    # The layers' other gathers are their biases, 1-D.
    layers = ("/q/", "/k/", "/v/", "/out/", "/mlp_up/", "/mlp_down/")
    assert all(len(c.shape) == 1 for c in gathers if any(s in c.op_name for s in layers) and c not in in_gemms)


@pytest.mark.parametrize("mesh", ["data=8", "data=2,fsdp=4"])
def test_data_and_fsdp_sharding_give_the_unsharded_step(mesh, monkeypatch):
    """In float32 (no bf16 fusion differences) data and FSDP sharding change no value: each NVFP4 GEMM sees the
    same bytes, and the amax is reduced over the mesh. The plain recipe: with stochastic rounding each shard
    draws its own random bits. With the RHT, one column of mlp_up's weight gradient differed by a block-scale
    step: the layers' float32 inputs and gradients, read out of the sharded program, differ from the unsharded
    ones in last bits, and a sum of 16 of them moved a block scale. tests/test_sharding.py checks the RHT's
    sharded step on an MLP whose intermediates it controls."""
    monkeypatch.setattr(train_lm, "DTYPE", jnp.float32)
    args = _args(mesh)
    want_loss, want_grads = (lambda f, p, b: f(p, b))(*_loss_and_grad(args, None, "plain"))
    got_loss, got_grads = (lambda f, p, b: f(p, b))(*_loss_and_grad(args, train_lm.make_mesh(args.mesh, args), "plain"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)  # its mean sums the shards in another order
    # Gradients: their f32 sums over the batch shards are added in another order. (The key bias's gradient is 0
    # but for rounding, so the tolerance is relative to the largest gradient.)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


def test_the_four_over_six_and_per_token_runs_are_their_recipes():
    recipes = train_lm.RECIPES
    assert recipes["4o6"] == dataclasses.replace(recipes["plain"], four_over_six="all")
    assert recipes["4o6"] == jax_nvfp4.Recipe(rht=False, stochastic_rounding=False, four_over_six="all")
    assert (recipes["4o6"].four_over_six_error, recipes["4o6"].e4m3_max) == ("mse", 256)
    assert recipes["per-token"] == dataclasses.replace(
        recipes["plain"], row_scaled_activations=True, row_scaled_gradients=True
    )
    assert {"plain", "4o6", "per-token", "bf16"} <= set(train_lm.parse_runs("all"))
    args = _args("data=1")
    assert train_lm.describe("4o6", args) == "NVFP4, 16x16 weights + 4over6 (x, W, dy; MSE, E4M3 max 256)"
    assert train_lm.describe("per-token", args) == "NVFP4, 16x16 weights + per-token scales (x, dy)"


def test_moe_blocks_train_in_nvfp4():
    """--moe 4: each block's MLP is 4 experts (top-2, hidden 2 x d_model) whose GEMMs are NVFP4 ragged_dots."""
    args = argparse.Namespace(**{**vars(_args("data=1")), "moe": 4})
    step, params, batch = _loss_and_grad(args, None, "full")
    moe = params["block0"]["moe"]
    assert moe["up"].shape == (4, 64, 128) and moe["down"].shape == (4, 128, 64) and "mlp_up" not in params["block0"]
    jaxpr = jax.make_jaxpr(step)(params, batch, jax.random.key(0))
    assert "nvfp4_gemm" in str(jaxpr) and "ragged_dot_general" not in str(jaxpr)  # every GEMM is NVFP4
    loss, grads = step(params, batch, jax.random.key(0))
    assert np.isfinite(loss)
    for name in ("up", "down"):
        assert np.all(np.isfinite(grads["block0"]["moe"][name])) and np.any(grads["block0"]["moe"][name])
    assert np.any(grads["block0"]["moe"]["router"]["kernel"])


@pytest.mark.parametrize(
    "flags", [["--moe", "4", "--save", "ckpt"], ["--moe", "1"], ["--moe", "4", "--runs", "full-keep-last"]]
)
def test_moe_refuses_what_it_does_not_support(flags, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_lm.py", *flags])
    with pytest.raises(SystemExit):
        train_lm.main()
    assert "--moe" in capsys.readouterr().err
