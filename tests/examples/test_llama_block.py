"""The training example's Llama-style blocks (``--arch llama`` / ``qwen3``): RoPE, grouped-query attention, and a
small model that trains with every one of its blocks' GEMMs in NVFP4 under the full recipe."""

from __future__ import annotations

import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import eqns_named, normal

from examples import train_lm
from examples.lm.data import VOCAB
from examples.lm.model import build_model, causal_attention, next_byte_loss, rope

PROJECTIONS = ("q", "k", "v", "out", "mlp_gate", "mlp_up", "mlp_down")


def test_rope_leaves_position_0_and_the_norms_and_scores_depend_on_the_offset_only():
    q, k = normal((1, 12, 2, 8), 0), normal((1, 12, 2, 8), 1)
    rq = rope(q)
    np.testing.assert_array_equal(rq[:, 0], q[:, 0])  # angle 0: cos 1, sin 0
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    # The same q and k put 3 and 5 positions later: the same score (a rotation by the offset only).
    shifted = lambda x, at: jnp.zeros_like(x).at[:, at].set(x[:, 0])  # noqa: E731
    score = lambda i, j: jnp.sum(rope(shifted(q, i))[:, i] * rope(shifted(k, j))[:, j])  # noqa: E731
    np.testing.assert_allclose(score(3, 1), score(8, 6), rtol=1e-5)
    assert not np.isclose(score(3, 1), score(3, 2), rtol=1e-3)


def test_grouped_query_attention_is_attention_over_repeated_key_value_heads():
    """4 query heads over 2 key/value heads: heads 0-1 read kv head 0, heads 2-3 kv head 1; causal."""
    q, k, v = normal((2, 6, 4, 8), 0), normal((2, 6, 2, 8), 1), normal((2, 6, 2, 8), 2)
    want = causal_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(causal_attention(q, k, v), want, rtol=1e-6, atol=1e-6)
    # Causal: the first position's output is its own value, whatever the later keys.
    np.testing.assert_allclose(want[:, 0], jnp.repeat(v, 2, axis=2)[:, 0], rtol=1e-6)


def _parse(flags: str):
    return train_lm.make_parser().parse_args(flags.split())


SMALL = "--d-model 64 --heads 4 --seq-len 16 --batch 2 --runs full"


def test_the_llama_style_blocks_parameters():
    """d_model 64, 4 heads over 2 key/value heads (by default half), SwiGLU 192: no biases, no learned positions;
    qwen3 adds a q and a k norm per block (over the head's 16 values), llama none."""
    tokens = jnp.zeros((1, 16), jnp.int32)
    shapes = {}
    for arch in ("llama", "qwen3"):
        model = build_model("full", _parse(f"--arch {arch} {SMALL}"))
        params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))
        shapes[arch] = {jax.tree_util.keystr(p): a.shape for p, a in jax.tree_util.tree_leaves_with_path(params)}
    block = "['params']['block0']"
    assert shapes["llama"][f"{block}['q']['kernel']"] == (64, 4, 16)
    assert shapes["llama"][f"{block}['k']['kernel']"] == shapes["llama"][f"{block}['v']['kernel']"] == (64, 2, 16)
    assert shapes["llama"][f"{block}['mlp_gate']['kernel']"] == (64, 192)
    assert shapes["llama"][f"{block}['mlp_down']['kernel']"] == (192, 64)
    assert not [p for p in shapes["qwen3"] if "bias" in p or "pos_embed" in p]
    extra = {p: shape for p, shape in shapes["qwen3"].items() if p not in shapes["llama"]}
    assert set(shapes["llama"]) < set(shapes["qwen3"]) and len(extra) == 2 * 4  # 4 blocks
    assert extra[f"{block}['q_norm']['scale']"] == extra[f"{block}['k_norm']['scale']"] == (16,)


def test_the_qwen3_style_model_trains_with_every_block_gemm_in_nvfp4():
    """One block: each of its 7 projections runs its 3 GEMMs (fprop, dgrad, wgrad) as nvfp4_gemm; the only other
    dot_generals are the attention's (batched over batch and heads) and the head's (bf16, VOCAB wide); three Adam
    steps lower the loss on a repeated batch, every projection's kernel getting a finite, nonzero gradient."""
    args = _parse(f"--arch qwen3 --layers 1 {SMALL}")
    model = build_model("full", args)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"])
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.seq_len + 1), np.int32))
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt, key):
        loss, grads = jax.value_and_grad(functools.partial(next_byte_loss, model, batch=batch, key=key))(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, loss, grads

    traced = step.trace(params, tx.init(params), jax.random.key(0))
    assert len(eqns_named(traced.jaxpr, "nvfp4_gemm")) == 3 * len(PROJECTIONS)
    others = eqns_named(traced.jaxpr, "dot_general")
    head = [e for e in others if VOCAB in (*e.invars[0].aval.shape, *e.invars[1].aval.shape)]
    assert len(head) == 3 and all(e.params["dimension_numbers"][1][0] for e in others if e not in head)
    step, opt, losses = traced.lower().compile(), tx.init(params), []
    for i in range(3):
        params, opt, loss, grads = step(params, opt, jax.random.key(i))
        losses.append(float(loss))
        for name in PROJECTIONS:
            assert np.all(np.isfinite(grads["block0"][name]["kernel"])) and np.any(grads["block0"][name]["kernel"])
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--arch", "gpt", "--kv-heads", "2"], "--kv-heads needs --arch llama or qwen3"),
        (["--arch", "llama", "--kv-heads", "3"], "must be a multiple of --kv-heads (3)"),
        (["--arch", "qwen3", "--d-model", "120", "--heads", "8"], "the head width (--d-model / --heads) even"),
    ],
)
def test_the_attention_shapes_that_do_not_fit_are_refused(flags, message, monkeypatch, capsys, tmp_path):
    # A shape let through trains one tiny step (not the default run) and fails below.
    tiny = ["--steps", "1", "--batch", "2", "--seq-len", "16", "--layers", "1", "--out", str(tmp_path / "lm.png")]
    monkeypatch.setattr(sys, "argv", ["train_lm.py", "--d-model", "32", "--heads", "2", *tiny, *flags])
    with pytest.raises(SystemExit):
        train_lm.main()
    assert message in capsys.readouterr().err
