"""Rules on models with Flax's automatic names: keep_ends finds their blocks, and a rule that matches no layer is
reported (a warning by default, an error, or nothing), with the paths seen and the block pattern they suggest."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes

from jax_nvfp4 import Recipe

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
from jax_nvfp4.flax import Rule, UnmatchedRuleWarning, keep_ends, nvfp4_rules, quantize_model  # noqa: E402
from jax_nvfp4.flax import nnx as nvfp4_nnx  # noqa: E402
from jax_nvfp4.flax.linen.convert import module_path  # noqa: E402
from jax_nvfp4.flax.rules import numbered_block_pattern, recipe_for  # noqa: E402

WIDTH, BLOCKS = 32, 4
RTN = Recipe(stochastic_rounding=False)


class Block(nn.Module):  # called without a name: Flax names it Block_0, Block_1, ...
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(WIDTH)(x)))  # Dense_0, Dense_1


class AutoNamedLM(nn.Module):
    """Every name automatic: Block_{i}/Dense_{j}, and the head Dense_0 at the root."""

    @nn.compact
    def __call__(self, x):
        for _ in range(BLOCKS):
            x = Block()(x)
        return nn.Dense(8)(x)


class DecoderLayer(Block):
    pass


class DecoderLM(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(BLOCKS):
            x = DecoderLayer()(x)
        return nn.Dense(8, name="head")(x)


class ListLM(nn.Module):
    """Blocks as a list attribute in setup: Flax names them layers_0, layers_1, ..."""

    def setup(self):
        self.layers = [Block() for _ in range(BLOCKS)]
        self.head = nn.Dense(8)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model_input():
    return jax.random.normal(jax.random.key(1), (2, 16, WIDTH))


def _init_reports_nothing(converted, x) -> None:
    """converted.init traced (not run) with an UnmatchedRuleWarning as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedRuleWarning)
        jax.eval_shape(converted.init, jax.random.key(0), x)


def _run_recording(model, variables, x):
    """model.apply, eagerly (a recorded value must not be a tracer): {path: (module, inputs, output)} of each
    Dense it called."""
    calls = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, nn.Dense):
            calls[module_path(context.module)] = (context.module, args, out)
        return out

    with nn.intercept_methods(record):
        model.apply(variables, x)
    return calls


def test_keep_ends_finds_flax_automatic_block_names_and_reports_the_head_it_misses():
    model, x = AutoNamedLM(), _model_input()
    rules = keep_ends(BLOCKS, first=1, last=1, recipe=RTN)
    converted = quantize_model(model, rules)
    with pytest.warns(UnmatchedRuleWarning, match=r"1 rule\(s\) matched no layer: \['\(\.\*/\)\?head'\]") as got:
        variables = converted.init(jax.random.key(0), x)
    assert "'Dense_0'" in str(got[0].message) and "'Block_3/Dense_1'" in str(got[0].message)  # the paths seen
    with pytest.warns(UnmatchedRuleWarning):  # each call reports it (under jit: when traced)
        calls = _run_recording(converted, variables, x)
    assert sorted(calls) == sorted([f"Block_{i}/Dense_{j}" for i in range(BLOCKS) for j in (0, 1)] + ["Dense_0"])
    for path, (module, args, out) in calls.items():
        plain = module.clone(parent=None).apply({"params": module.variables["params"]}, *args)
        kept = path.startswith(("Block_0/", "Block_3/"))
        assert recipe_for(rules, path) is None if kept else recipe_for(rules, path) == RTN
        if kept:
            assert_same_bytes(out, plain)  # in its input precision: Flax's layer, bit for bit
        else:
            assert not np.array_equal(out, plain), path  # NVFP4 (the head too: the warning's point)
    # Told the head's name, nothing is reported.
    _init_reports_nothing(quantize_model(model, keep_ends(BLOCKS, first=1, last=1, keep=("Dense_0",))), x)


def test_list_attribute_blocks_are_found():
    rules = keep_ends(BLOCKS, first=1, last=1)
    _init_reports_nothing(quantize_model(ListLM(), rules), _model_input())
    kept = {
        p for p in ("layers_0/Dense_0", "layers_1/Dense_1", "layers_3/Dense_0", "head") if recipe_for(rules, p) is None
    }
    assert kept == {"layers_0/Dense_0", "layers_3/Dense_0", "head"}
    # Only at the root: nn.Sequential's children inside a block are named layers_0, layers_1 too.
    assert recipe_for(rules, "Block_2/Sequential_0/layers_0") is not None


def test_unnamed_blocks_raise_naming_the_block_pattern_to_pass():
    converted = quantize_model(DecoderLM(), keep_ends(BLOCKS, first=1, last=1), on_unmatched="raise")
    with pytest.raises(ValueError, match=r"2 rule\(s\) matched no layer.*block='DecoderLayer_\{i\}'"):
        jax.eval_shape(converted.init, jax.random.key(0), _model_input())
    rules = keep_ends(BLOCKS, first=1, last=1, block="DecoderLayer_{i}")
    _init_reports_nothing(quantize_model(DecoderLM(), rules, on_unmatched="raise"), _model_input())
    assert recipe_for(rules, "DecoderLayer_3/Dense_1") is None and recipe_for(rules, "DecoderLayer_2/Dense_1")
    # "ignore": nothing said.
    _init_reports_nothing(
        quantize_model(DecoderLM(), keep_ends(BLOCKS, first=1, last=1), on_unmatched="ignore"), _model_input()
    )


def test_the_rules_context_reports_on_leaving():
    model, x = AutoNamedLM(), _model_input()
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    rules = [Rule("block1/.*", RTN)]
    with pytest.warns(UnmatchedRuleWarning, match="nvfp4_rules.*'block1/.*'"), nvfp4_rules(rules):
        jax.eval_shape(model.apply, variables, x)
    with pytest.raises(ValueError, match="matched no layer"), nvfp4_rules(rules, on_unmatched="raise"):
        jax.eval_shape(model.apply, variables, x)


def test_option_and_pattern_errors():
    with pytest.raises(ValueError, match="on_unmatched must be"):
        quantize_model(AutoNamedLM(), [Rule(".*")], on_unmatched="loud")
    with pytest.raises(ValueError, match=r"with '\{i\}' in it"):
        keep_ends(BLOCKS, block="blocks")


def test_numbered_block_pattern():
    assert numbered_block_pattern(["Block_0/Dense_0", "Block_1/Dense_0", "Block_1/Attn_0/query", "Dense_0"]) == (
        "Block_{i}"
    )
    assert numbered_block_pattern(["decoder/layers/0/mlp/up", "decoder/layers/1/mlp/up", "head"]) == (
        "decoder/layers/{i}"
    )
    assert numbered_block_pattern(["mlp/up", "head"]) is None


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(WIDTH, WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)


class NNXLayersLM(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NNXMLP(rngs) for _ in range(BLOCKS)])
        self.lm_head = nnx.Linear(WIDTH, 8, rngs=rngs)


def _nvfp4_paths(model):
    return {
        "/".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Linear) and isinstance(node.dot_general, nvfp4_nnx.NVFP4DotGeneral)
    }


def test_nnx_rules_find_layers_blocks_and_report_before_converting():
    model = NNXLayersLM(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['blocks/0/\.\*'\].*'lm_head'.*block='layers/\{i\}'"):
        nvfp4_nnx.quantize_model(model, [Rule("blocks/0/.*", None), Rule(".*", RTN)], on_unmatched="raise")
    assert _nvfp4_paths(model) == set()  # nothing converted before the error
    with pytest.warns(UnmatchedRuleWarning, match=r"\['\(\.\*/\)\?head'\]"):  # lm_head is not 'head'
        nvfp4_nnx.quantize_model(model, keep_ends(BLOCKS, first=1, last=1, recipe=RTN))
    assert _nvfp4_paths(model) == {f"layers/{i}/{n}" for i in (1, 2) for n in ("up", "down")} | {"lm_head"}
    x = jax.random.normal(jax.random.key(1), (4, WIDTH))
    up = model.layers[0].up  # kept: Flax's own GEMM
    assert_same_bytes(up(x), jnp.dot(x, up.kernel[...]) + up.bias[...])
