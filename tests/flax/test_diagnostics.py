"""Diagnostics: per layer and operand quantization statistics, sown only when asked for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal

import jax_nvfp4
from jax_nvfp4 import QuantizeSpec, Recipe
from jax_nvfp4.diagnostics import quantization_stats

nn = pytest.importorskip("flax.linen")
from jax_nvfp4.flax import NVFP4Dense, Rule, quantize_model  # noqa: E402
from jax_nvfp4.flax.linen import diagnostics  # noqa: E402


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_quantization_stats_measure_the_quantized_tensor(block_2d):
    x = normal((64, 96), 0)
    x = x.at[5, 16:32].multiply(1e-7)  # one block far below the amax: its scale underflows
    x = x.at[40:48, 0:16].set(0.0)  # zero values: not counted as values or blocks that vanish
    spec = QuantizeSpec(block_2d=block_2d)
    stats = quantization_stats(x, spec)
    back = jax_nvfp4.dequantize(jax_nvfp4.quantize(x, spec))
    np.testing.assert_allclose(stats["rel_error"], jnp.linalg.norm(back - x) / jnp.linalg.norm(x), rtol=1e-6)
    assert float(stats["amax"]) == float(jnp.max(jnp.abs(x)))
    assert float(stats["saturated"]) == 0.0  # the tensor's own amax: no block above it
    np.testing.assert_allclose(stats["zero"], np.sum((back == 0) & (x != 0)) / np.sum(x != 0), rtol=1e-6)
    if not block_2d:
        nonzero_blocks = 64 * 6 - 8  # rows 40..47 of the first column block are zero
        assert float(stats["underflow"]) == pytest.approx(1 / nonzero_blocks)
        assert bool(jnp.all(back[5, 16:32] == 0))
    else:  # the tiny block shares its 16x16 tile with normal values: no tile underflows
        assert float(stats["underflow"]) == 0.0


def test_the_stats_of_a_transformed_operand_are_of_its_rowwise_copy():
    """A wgrad operand's spec (the transform, its amax estimated by a factor) measures its rowwise copy."""
    x = normal((64, 96), 1)
    spec = QuantizeSpec(columnwise=True, rht=True, rht_amax_factor=2.0)
    got, want = ({k: float(v) for k, v in quantization_stats(x, s).items()} for s in (spec, QuantizeSpec()))
    assert got == want


def test_per_token_scales_measure_each_row_against_its_own_amax():
    """A row far below the others underflows against the tensor's amax, not against its own (row-scaled)."""
    x = normal((32, 64), 2).at[3].multiply(1e-7)
    per_tensor, per_row = (quantization_stats(x, QuantizeSpec(row_scaled=r)) for r in (False, True))
    assert float(per_tensor["underflow"]) == pytest.approx(4 / (32 * 4))  # row 3's four blocks
    assert float(per_row["underflow"]) == 0.0 and float(per_row["saturated"]) == 0.0
    given = jnp.max(jnp.abs(x), axis=1).at[0].divide(2)  # row 0 given half its amax: its largest block clips
    assert float(quantization_stats(x, QuantizeSpec(row_scaled=True), amax=given)["saturated"]) > 0


def test_a_given_amax_below_the_tensors_saturates_blocks():
    x = normal((32, 64), 1)
    stats = quantization_stats(x, QuantizeSpec(), amax=jnp.max(jnp.abs(x)) / 2)
    blocks = jnp.abs(x).reshape(32, 4, 16).max(-1)
    assert float(stats["saturated"]) == pytest.approx(float(jnp.mean(blocks > jnp.max(jnp.abs(x)) / 2)))
    assert float(stats["saturated"]) > 0


class _TwoLayerMLP(nn.Module):
    recipe: Recipe = Recipe(stochastic_rounding=False)

    @nn.compact
    def __call__(self, x):
        h = NVFP4Dense(64, recipe=self.recipe, name="up")(x)
        return NVFP4Dense(32, recipe=self.recipe, name="down")(nn.gelu(h))


def test_collect_stats_gives_each_layers_x_w_and_dy():
    model, x = _TwoLayerMLP(), normal((4, 16, 32), 2)
    variables = model.init(jax.random.key(0), x)
    c = normal((4, 16, 32), 3)
    stats = diagnostics.collect_stats(model, variables, lambda y: jnp.sum(y * c), x)
    assert set(stats) == {"up", "down"} and all(set(s) == {"x", "w", "dy"} for s in stats.values())
    p, recipe = variables["params"], _TwoLayerMLP.recipe
    want = {
        "x": quantization_stats(x.reshape(-1, 32), recipe.spec("x", columnwise=False, tokens=64)),
        "w": quantization_stats(p["up"]["kernel"].T, recipe.spec("w", columnwise=False, tokens=64)),
        # The loss's gradient with respect to down's output is c.
    }
    for operand, values in want.items():
        for stat, value in values.items():
            assert stats["up"][operand][stat] == float(value), (operand, stat)
    dy = quantization_stats(c.reshape(-1, 32), recipe.spec("dy", columnwise=False, tokens=64))
    assert all(stats["down"]["dy"][k] == float(v) for k, v in dy.items())


def test_rule_converted_layers_are_observed_too():
    model, x = nn.Dense(32, name="proj"), normal((4, 16, 32), 2)
    converted = quantize_model(model, [Rule(".*", Recipe(stochastic_rounding=False))])
    variables = converted.init(jax.random.key(0), x)
    stats = diagnostics.collect_stats(converted, variables, jnp.sum, x)
    assert set(stats) == {""} and set(stats[""]) == {"x", "w", "dy"}  # the root layer's path is empty


def test_without_the_collections_the_program_is_unchanged(monkeypatch):
    model, x = _TwoLayerMLP(Recipe()), normal((4, 16, 32), 2)
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params"}  # init sows nothing

    def step_text():
        def loss(p):
            return jnp.sum(model.apply({"params": p}, x, rngs={"nvfp4": jax.random.key(1)}))

        return jax.jit(jax.grad(loss)).lower(variables["params"]).as_text()

    with_hooks = step_text()
    # With the collection mutable the statistics of x and W are sown (dy's need collect_stats' passes).
    _, state = model.apply(variables, x, mutable=[diagnostics.STATS_COLLECTION])
    sown = state[diagnostics.STATS_COLLECTION]
    assert {name: set(s["NVFP4DotGeneral_0"]) for name, s in sown.items()} == {"up": {"x", "w"}, "down": {"x", "w"}}
    monkeypatch.setattr(diagnostics, "observe", lambda module, lhs, rhs, dims, recipe, y: y)
    assert step_text() == with_hooks  # the hooks add nothing to a training step without the collections


def test_stats_table_and_plot(tmp_path):
    model, x = _TwoLayerMLP(), normal((4, 16, 32), 2)
    variables = model.init(jax.random.key(0), x)
    stats = diagnostics.collect_stats(model, variables, jnp.sum, x)
    table = diagnostics.stats_table(stats)
    assert table.count("\n") == 2 + 2 * 3 - 1 and "| up | dy |" in table
    pytest.importorskip("matplotlib")
    diagnostics.plot_stats(stats, str(tmp_path / "stats.png"))
    assert (tmp_path / "stats.png").stat().st_size > 0
    with pytest.raises(ValueError, match="stat must be one of"):
        diagnostics.plot_stats(stats, str(tmp_path / "x.png"), stat="bogus")


def test_nnx_collect_stats_gives_each_layers_x_w_and_dy():
    nnx = pytest.importorskip("flax.nnx")
    from jax_nvfp4.flax import nnx as nvfp4_nnx
    from jax_nvfp4.flax.nnx import diagnostics

    recipe = Recipe(stochastic_rounding=False)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nvfp4_nnx.NVFP4Linear(32, 64, recipe=recipe, rngs=rngs)
            self.down = nnx.Linear(64, 32, rngs=rngs)  # converted by a rule below

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))

    model = nvfp4_nnx.quantize_model(MLP(nnx.Rngs(0)), [Rule("down", recipe)])
    x, c = normal((4, 16, 32), 2), normal((4, 16, 32), 3)
    stats = diagnostics.collect_stats(model, lambda y: jnp.sum(y * c), x)
    assert set(stats) == {"up", "down"} and all(set(s) == {"x", "w", "dy"} for s in stats.values())
    want_x = quantization_stats(x.reshape(-1, 32), recipe.spec("x", columnwise=False, tokens=64))
    want_w = quantization_stats(model.up.kernel[...].T, recipe.spec("w", columnwise=False, tokens=64))
    want_dy = quantization_stats(c.reshape(-1, 32), recipe.spec("dy", columnwise=False, tokens=64))
    assert all(stats["up"]["x"][k] == float(v) for k, v in want_x.items())
    assert all(stats["up"]["w"][k] == float(v) for k, v in want_w.items())
    assert all(stats["down"]["dy"][k] == float(v) for k, v in want_dy.items())  # down's output gradient is c
    from jax_nvfp4.flax.nnx.layers import observer_of

    assert observer_of(model.up.dot_general) is None and observer_of(model.down.dot_general) is None  # it ended
    assert "| down | dy |" in diagnostics.stats_table(stats)
