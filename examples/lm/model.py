"""The training example's model: a decoder-only byte-level transformer whose blocks' linear layers are NVFP4
(with one of the recipe variants of ``RECIPES``) or bf16.

Only the linear layers inside the transformer blocks differ between runs; the embeddings and the output head stay
in bf16, as in NVIDIA's NVFP4 recipe. ``build_model`` makes the model of a run; ``describe`` says what its linear
layers do.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jax_nvfp4
from examples.lm.data import VOCAB
from examples.lm.mesh import RULES
from jax_nvfp4.flax import CACHE, RNG_STREAM, NVFP4Dense, NVFP4DenseGeneral, Rule, keep_ends, quantize_model
from jax_nvfp4.flax.linen.moe import MoEMLP

DTYPE = jnp.bfloat16  # activations; parameters stay float32
X, QKV = ("batch", "length", "act_embed"), ("batch", "length", "heads", "kv")  # activations' logical axes

# The NVFP4 recipe variants --runs can train (their weight blocks come from --weight-blocks).
RECIPES = {
    "plain": jax_nvfp4.Recipe(rht=False, stochastic_rounding=False),
    "rht": jax_nvfp4.Recipe(stochastic_rounding=False),
    "sr": jax_nvfp4.Recipe(rht=False),
    "full": jax_nvfp4.Recipe(),
    "full-est": jax_nvfp4.Recipe(rht_amax_estimate=True),
    # 4over6 on every operand (MSE, block scales aimed at E4M3 256); round to nearest, as 4over6 of dy needs.
    "4o6": jax_nvfp4.Recipe(rht=False, stochastic_rounding=False, four_over_six=jax_nvfp4.FourOverSix("all")),
    # The same, choosing by the absolute error (MAE), said to suit pretraining better.
    "4o6-mae": jax_nvfp4.Recipe(
        rht=False, stochastic_rounding=False, four_over_six=jax_nvfp4.FourOverSix("all", error="mae")
    ),
    # Per-token global scales for the activations and the gradients (one float32 amax per row of x and of dy).
    "per-token": jax_nvfp4.Recipe(
        rht=False, stochastic_rounding=False, row_scaled_activations=True, row_scaled_gradients=True
    ),
}


class RuleRun(NamedTuple):
    """A run that converts the bf16 model by rules (jax_nvfp4.flax.quantize_model) instead of building it with
    NVFP4 layers: the recipe of RECIPES its NVFP4 layers use, its rules (from the block count and that recipe),
    and what they change, for the results table."""

    recipe: str
    rules: Callable[[int, jax_nvfp4.Recipe], tuple[Rule, ...]]
    what: str


ATTENTION = r"block\d+/(q|k|v|out)"  # the attention projections' paths
MLP_DOWN = r"block\d+/mlp_down"  # the MLP's last projection (in the Llama-style block, of the gated product)
HEAD = r"(.*/)?head"  # the output head, bf16 in every run (keep_ends' default keep)
RULE_RUNS = {
    "full-keep-last": RuleRun("full", lambda n, r: keep_ends(n, last=1, recipe=r), "last block bf16"),
    "full-keep-ends": RuleRun(
        "full", lambda n, r: keep_ends(n, first=1, last=1, recipe=r), "first and last blocks bf16"
    ),
    "full-mxfp8-attn": RuleRun(
        "full",
        lambda n, r: (Rule(ATTENTION, jax_nvfp4.MXFP8()), *keep_ends(n, last=0, recipe=r)),
        "attention projections MXFP8",
    ),
    "full-keep-attn": RuleRun(
        "full", lambda n, r: keep_ends(n, last=0, keep=(HEAD, ATTENTION), recipe=r), "attention projections bf16"
    ),
    "full-keep-down": RuleRun(
        "full", lambda n, r: keep_ends(n, last=0, keep=(HEAD, MLP_DOWN), recipe=r), "MLP down projections bf16"
    ),
}
RUNS = (*RECIPES, *RULE_RUNS, "bf16")
MOE_TOP_K = 2  # --moe: experts per token
# The settings that define the model (build_model's), saved with it by --save.
MODEL_ARGS = ("arch", "d_model", "layers", "heads", "kv_heads", "seq_len", "weight_blocks")
# The blocks --arch builds: GPT-2's, and the decoder of Llama (RMSNorm, RoPE, grouped-query attention, gated SiLU
# MLP, no biases) with or without RMSNorm on q and k (Qwen3, Gemma 3, OLMo 2 have it).
ARCHS = {
    "gpt": "GPT-2-style block (pre-LayerNorm, multi-head attention, GELU MLP 4x, biases, learned positions)",
    "llama": "Llama-style block (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP 3x, no biases)",
    "qwen3": "Qwen3-style block (the Llama-style block with RMSNorm on q and k)",
}
ROPE_BASE = 10_000.0


def next_byte_loss(
    model: nn.Module,
    params: Any,
    batch: jax.Array,
    key: jax.Array | None = None,
    load_balance: float = 0.0,
    cache: Any = None,
) -> jax.Array:
    """Mean cross-entropy of predicting each next byte of the windows ``batch`` [B, seq_len + 1].

    ``key`` feeds the NVFP4 layers' stochastic rounding (needed for gradients when the recipe has it).
    ``load_balance``: the weight of the MoE layers' mean load-balancing loss added to it (no MoE: none).
    ``cache``: the NVFP4 layers' weights quantized once for the step (``jax_nvfp4.flax.cache_weights``)."""
    rngs = None if key is None else {RNG_STREAM: key}
    variables = {"params": params} if cache is None else {"params": params, CACHE: cache}
    logits, state = model.apply(variables, batch[:, :-1], rngs=rngs, mutable=["losses"])
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


def rms_norm(axis: str = "embed", name: str | None = None) -> nn.RMSNorm:
    return nn.RMSNorm(epsilon=1e-6, dtype=DTYPE, scale_init=logical(nn.initializers.ones, axis), name=name)


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x`` [batch, length, heads, head_dim] (the rotate-half form of Llama),
    computed in float32."""
    half = x.shape[-1] // 2
    freq = ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq  # [length, half]
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]  # broadcast over the heads
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention of q [b, length, heads, d] over k, v [b, length, kv_heads, d] (grouped-query:
    every heads // kv_heads consecutive query heads share one key/value head); scores and softmax in float32,
    bf16 being too coarse for the exponentials and their sum."""
    b, length, heads, head_dim = q.shape
    group = heads // k.shape[2]
    q = q.reshape(b, length, k.shape[2], group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((length, length), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, length, heads, head_dim)


class GPTBlock(nn.Module):
    """Pre-LayerNorm block: causal multi-head self-attention, then a GELU MLP of hidden width 4 x d_model."""

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
        attn = causal_attention(q, k, v)
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


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: causal grouped-query self-attention with RoPE (and RMSNorm on q and k if ``qk_norm``),
    then a gated SiLU MLP ``down(silu(gate(h)) * up(h))`` of hidden width 3 x d_model; no biases."""

    heads: int
    kv_heads: int
    qk_norm: bool
    dense_cls: Callable[..., nn.Module]
    dense_general_cls: Callable[..., nn.Module]
    mesh: jax.sharding.Mesh | None = None
    moe_cls: Callable[..., nn.Module] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        head_dim = d_model // self.heads
        h = rms_norm()(x)
        proj = functools.partial(
            self.dense_general_cls, dtype=DTYPE, use_bias=False, kernel_axes=("embed", "heads", "kv"), bias_axes=()
        )
        q = proj((self.heads, head_dim), name="q")(h)
        k, v = (proj((self.kv_heads, head_dim), name=n)(h) for n in ("k", "v"))
        if self.qk_norm:  # per head, over head_dim, before the rotation (Qwen3)
            q, k = rms_norm("kv", "q_norm")(q), rms_norm("kv", "k_norm")(k)
        q, k, v = (constrain(t, self.mesh, *QKV) for t in (rope(q), rope(k), v))
        out = self.dense_general_cls(
            d_model,
            axis=(-2, -1),
            dtype=DTYPE,
            use_bias=False,
            name="out",
            kernel_axes=("heads", "kv", "embed"),
            bias_axes=(),
        )
        x = constrain(x + out(causal_attention(q, k, v)), self.mesh, *X)
        h = rms_norm()(x)
        if self.moe_cls is not None:
            return x + self.moe_cls(hidden=4 * d_model // MOE_TOP_K, top_k=MOE_TOP_K, name="moe")(h)
        mlp = functools.partial(
            self.dense_cls, 3 * d_model, dtype=DTYPE, use_bias=False, kernel_axes=("embed", "mlp"), bias_axes=()
        )
        h = nn.silu(mlp(name="mlp_gate")(h)) * mlp(name="mlp_up")(h)
        h = constrain(h, self.mesh, "batch", "length", "mlp")
        down = self.dense_cls(
            d_model, dtype=DTYPE, use_bias=False, name="mlp_down", kernel_axes=("mlp", "embed"), bias_axes=()
        )
        return constrain(x + down(h), self.mesh, *X)


class TransformerLM(nn.Module):
    """Decoder-only byte-level language model of ``arch``'s blocks (ARCHS); returns float32 logits."""

    d_model: int
    layers: int
    heads: int
    max_len: int
    dense_cls: Callable[..., nn.Module] = with_axes(nn.Dense)
    dense_general_cls: Callable[..., nn.Module] = with_axes(nn.DenseGeneral)
    mesh: jax.sharding.Mesh | None = None  # where to shard the activations
    moe_cls: Callable[..., nn.Module] | None = None
    arch: str = "gpt"
    kv_heads: int | None = None  # the Llama-style blocks' key/value heads (None: as many as heads)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        gpt = self.arch == "gpt"
        init = nn.initializers.normal(0.02)  # one scale for both, so positions are not drowned out by tokens
        table = nn.Embed(VOCAB, self.d_model, embedding_init=logical(init, "vocab", "embed"), name="embed").embedding
        # Gather the table (FSDP) before the lookup, which is nn.Embed's: XLA cannot move a lookup's output from
        # the table's sharding to the batch's without gathering all of it (and says so on every compile).
        x = jnp.take(constrain(table.astype(DTYPE), self.mesh, "vocab", "act_embed"), tokens, axis=0)
        if gpt:  # learned positions (the Llama-style blocks rotate q and k instead)
            pos = self.param("pos_embed", logical(init, "length", "embed"), (self.max_len, self.d_model))
            x = x + pos[: tokens.shape[1]].astype(DTYPE)
        x = constrain(x, self.mesh, *X)
        layers = (self.dense_cls, self.dense_general_cls, self.mesh, self.moe_cls)
        for i in range(self.layers):
            if gpt:
                x = GPTBlock(self.heads, *layers, name=f"block{i}")(x)
            else:
                kv = self.kv_heads or self.heads
                x = LlamaBlock(self.heads, kv, self.arch == "qwen3", *layers, name=f"block{i}")(x)
        x = (layer_norm if gpt else rms_norm)(name="final_norm")(x)
        head = with_axes(nn.Dense)(
            VOCAB, dtype=DTYPE, use_bias=gpt, name="head", kernel_axes=("embed", "vocab"), bias_axes=("vocab",)
        )
        return head(x).astype(jnp.float32)


def kv_heads(args: argparse.Namespace) -> int:
    """The key/value heads of the model's attention: --kv-heads, by default half of --heads in the Llama-style
    blocks (grouped-query attention) and all of them in GPT-2's."""
    if getattr(args, "arch", "gpt") == "gpt":
        return args.heads
    return getattr(args, "kv_heads", None) or max(1, args.heads // 2)


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
        args.d_model,
        args.layers,
        args.heads,
        args.seq_len,
        dense_cls,
        dense_general_cls,
        mesh,
        moe_cls,
        arch=getattr(args, "arch", "gpt"),  # a model saved before --arch is GPT-2-style
        kv_heads=kv_heads(args),
    )
    if run in RULE_RUNS:  # the head stays bf16 in every run
        rule_run = RULE_RUNS[run]
        return quantize_model(model, rule_run.rules(args.layers, recipe(rule_run.recipe)))
    return model


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
        return describe(RULE_RUNS[run].recipe, args) + f", {RULE_RUNS[run].what} (by rules)"
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
