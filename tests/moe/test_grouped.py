"""The grouped quantize of mixture-of-experts layers: its reference (the spec) gives each group exactly the bytes
of a per-group quantization of the whole tensor (the other groups' rows zero), and the CPU kernels give the
reference's bytes, for every option of the columnwise 1x16 copy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DTYPES, SPECIAL_VALUES, assert_same_bytes, assert_same_tree, examples, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_nvfp4 import QuantizeSpec, quantize
from jax_nvfp4.moe.grouped import quantize_grouped
from jax_nvfp4.ops import grouped as ops
from jax_nvfp4.reference import grouped as ref
from jax_nvfp4.sharding.hlo import collectives

BLOCK = 16

# Cut blocks (5 | 0 | 27 ...), an empty group, a one-row group, rows past the last group.
SIZES = {
    "cut blocks": (64, [5, 0, 27, 1, 19]),
    "rows past, ragged M": (37, [0, 16, 3, 15]),
    "aligned": (48, [16, 16, 16]),
}
OPTIONS = {
    "plain": {},
    "rht": {"rht": True},
    "rht+sr": {"rht": True, "stochastic_rounding": True},
    "row-scaled+rht+sr": {"row_scaled": True, "rht": True, "stochastic_rounding": True},
    "4over6 mse": {"four_over_six_error": "mse"},
    "row-scaled 4over6 fast e256": {
        "row_scaled": True,
        "four_over_six_error": "mae",
        "four_over_six_fast_math": True,
        "e4m3_max": 256,
    },
}


def _seeds(groups: int, key=3):
    keys = jax.random.split(jax.random.key(key), groups + 1)
    return keys, jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)


def _amax_and_quantize(impl_amax, impl_quantize, x, sizes, spec: QuantizeSpec, seeds):
    amax, amax_t = impl_amax(x, sizes, rht_amax=spec.rht, per_row=spec.row_scaled)
    return (amax, amax_t), impl_quantize(x, sizes, amax, amax_t, seeds[0], seeds[1:], spec=spec)


def _kernels_and_reference(x, sizes, spec, seeds):
    """(kernel outputs, reference outputs), each (amaxes, quantize outputs), under jit."""
    impls = ((ops.grouped_amax, ops.grouped_quantize), (ref.grouped_amax_core, ref.grouped_quantize_core))
    return tuple(
        jax.jit(functools.partial(_amax_and_quantize, *impl, spec=spec))(x, sizes, seeds=seeds) for impl in impls
    )


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", SIZES)
def test_each_group_gets_its_per_group_copy(case, option):
    """The reference's blocks j + g of group g are the blocks j of quantize(x with the other rows zero)."""
    rows, sizes = SIZES[case]
    opts = OPTIONS[option]
    if opts.get("rht") and rows % BLOCK:
        pytest.skip("the RHT takes whole 16-row chunks")
    groups, cols = len(sizes), 40
    x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(jnp.bfloat16)
    keys, _ = _seeds(groups)
    sr = opts.get("stochastic_rounding", False)
    t = quantize_grouped(
        x, jnp.asarray(sizes), QuantizeSpec(columnwise=True, **opts), row_key=keys[0], group_keys=keys[1:]
    )
    ends = np.minimum(np.cumsum(sizes), rows)
    starts = np.concatenate([[0], ends[:-1]])
    ids = np.searchsorted(ends, np.arange(rows), side="right")
    owned = np.zeros(t.scale_t.shape[1], bool)
    for g in range(groups):
        if ends[g] == starts[g]:
            continue
        alone = quantize(
            jnp.where((ids == g)[:, None], x, 0),
            QuantizeSpec(rowwise=False, columnwise=True, **opts),
            rng_key=keys[1 + g] if sr else None,
        )
        assert_same_bytes(t.amax_t[g], alone.amax_t)
        for j in range(starts[g] // BLOCK, -(-ends[g] // BLOCK)):
            width = alone.data_t[:, j * 8 : (j + 1) * 8].shape[1]
            assert_same_bytes(t.data_t[:, (j + g) * 8 : (j + g) * 8 + width], alone.data_t[:, j * 8 : (j + 1) * 8])
            assert_same_bytes(t.scale_t[:, j + g], alone.scale_t[:, j])
            owned[j + g] = True
    assert not np.any(np.asarray(t.scale_t).view(np.uint8)[:, ~owned]) and not np.any(
        np.asarray(t.data_t).reshape(cols, -1, 8)[:, ~owned]
    )
    # The rowwise copy is the tensor's, with the rows past the groups zero.
    rows_spec = QuantizeSpec(**{k: v for k, v in opts.items() if k != "rht"})
    whole = quantize(jnp.where((ids < groups)[:, None], x, 0), rows_spec, rng_key=keys[0] if sr else None)
    for name in ("data", "scale", "amax"):
        assert_same_bytes(getattr(t, name), getattr(whole, name))
    # Each group's segment holds its blocks, and the segments tile the layout.
    seg = np.asarray(ref.segment_sizes(jnp.asarray(sizes), rows))
    assert seg.sum() == BLOCK * ref.grouped_blocks(rows, groups) and np.all(seg % BLOCK == 0)


@st.composite
def _grouped_problems(draw):
    rows = draw(st.integers(1, 70))
    cuts = np.sort(draw(st.lists(st.integers(0, rows + 5), min_size=0, max_size=5)))
    sizes = np.diff(np.concatenate([[0], cuts, [draw(st.integers(rows - 3, rows + 3))]])).clip(0)
    cols = draw(st.integers(1, 40))
    batch = draw(st.integers(1, 2))
    specials = tuple(draw(st.sets(st.sampled_from(sorted(SPECIAL_VALUES)))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = random_tensor(rng, (batch, rows, cols), draw(st.sampled_from(DTYPES)), spread=2.0, specials=specials, frac=0.05)
    opts = draw(st.sampled_from(list(OPTIONS.values())))
    if opts.get("rht") and rows % BLOCK:
        opts = {k: v for k, v in opts.items() if k != "rht"}
    rowwise = draw(st.booleans())
    return x, np.tile(sizes.astype(np.int32), (batch, 1)), QuantizeSpec(rowwise=rowwise, columnwise=True, **opts)


@settings(max_examples=examples(12), deadline=None)
@given(problem=_grouped_problems())
def test_kernels_are_the_reference(problem):
    x, sizes, spec = problem
    assert_same_tree(*_kernels_and_reference(jnp.asarray(x), jnp.asarray(sizes), spec, _seeds(sizes.shape[1])[1]))


def test_negative_and_huge_sizes_are_clamped():
    """A negative size counts as 0, and the running sum saturates at M (no int32 wrap): the kernels agree."""
    sizes = jnp.array([[-3, 10, -20, 40, 5], [2**31 - 1, 5, -(2**31) + 10, 8, 0]], jnp.int32)
    x = jax.random.normal(jax.random.key(2), (2, 48, 24), jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(ref.bounds(sizes, 48)[1], [[0, 10, 10, 48, 48], [48, 48, 48, 48, 48]])
    assert_same_tree(*_kernels_and_reference(x, sizes, QuantizeSpec(columnwise=True, rht=True), _seeds(5)[1]))


def test_kernels_run_as_custom_calls():
    x, sizes = jnp.ones((1, 32, 16), jnp.bfloat16), jnp.array([[10, 22]], jnp.int32)
    spec = QuantizeSpec(columnwise=True)
    f = jax.jit(functools.partial(_amax_and_quantize, ops.grouped_amax, ops.grouped_quantize, spec=spec))
    hlo = f.lower(x, sizes, seeds=_seeds(2)[1]).compile().as_text()
    for target in ("nvfp4_grouped_amax", "nvfp4_grouped_quantize"):
        assert f'custom_call_target="{target}"' in hlo, target


def test_bad_input():
    x, sizes = jnp.ones((1, 32, 16), jnp.bfloat16), jnp.array([[10, 22]], jnp.int32)
    seeds = _seeds(2)[1]
    with pytest.raises(ValueError, match="columnwise copy in 1x16 blocks"):
        ops.grouped_quantize(x, sizes, jnp.ones(1), jnp.ones((1, 2)), seeds[0], seeds[1:], spec=QuantizeSpec())
    with pytest.raises(ValueError, match="group_sizes"):
        ops.grouped_amax(x, sizes[0])
    with pytest.raises(ValueError, match=r"amax / amax_t must be"):
        ops.grouped_quantize(
            x, sizes, jnp.ones(1), jnp.ones(2), seeds[0], seeds[1:], spec=QuantizeSpec(columnwise=True)
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        spec = QuantizeSpec(columnwise=True, rht=True)
        ops.grouped_quantize(x[:, :30], sizes, jnp.ones(1), jnp.ones((1, 2)), seeds[0], seeds[1:], spec=spec)


@pytest.mark.parametrize(
    "spec",
    [QuantizeSpec(columnwise=True, rht=True), QuantizeSpec(rowwise=True, columnwise=True, stochastic_rounding=True)],
    ids=["rht", "both copies, stochastic rounding"],
)
def test_shards_over_features_with_the_unsharded_bytes(spec):
    """Features (and the batch) stay sharded: the same bytes (stochastic rounding draws at each shard's place), and
    no token moves (amaxes reduced as bits)."""
    mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    x = jax.random.normal(jax.random.key(1), (1, 48, 128), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.array([[20, 0, 28]], jnp.int32)
    f = jax.jit(functools.partial(_amax_and_quantize, ops.grouped_amax, ops.grouped_quantize, spec=spec))
    want = f(x, sizes, seeds=_seeds(3)[1])
    sharded = jax.device_put(x, NamedSharding(mesh, P(None, None, "model")))
    got = f(sharded, sizes, seeds=_seeds(3)[1])
    assert_same_tree(got, want)
    found = collectives(f.lower(sharded, sizes, seeds=_seeds(3)[1]).compile().as_text())
    assert {(c.op, c.dtype) for c in found} <= {("all-reduce", "s32")}, found
