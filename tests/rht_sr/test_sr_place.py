"""Stochastic rounding's counters are positions in the whole tensor: a slice of it quantized with its place (the
seed operand [4 + M]: ``reference.stochastic.Place``) draws the bytes that the whole tensor's quantization has
there, in the reference and the CPU kernels (the CUDA kernels: tests/cuda/test_cuda_host_sr_place.py); and under
``jit`` on a mesh, where the partitioner gives each shard its place, sharded equals unsharded."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CPUS, assert_same_tensor, examples, needs_8_cpus, sr_place
from helpers.numpy_eval import evaluate
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4
from jax_nvfp4.ops import KERNELS
from jax_nvfp4.reference.kernels import REFERENCE

BACKENDS = ("kernel", "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@given(shard=sr_place.shards(), spec=st.sampled_from(list(sr_place.SPECS)))
@settings(max_examples=examples(40), deadline=None)
def test_a_slice_with_its_place_draws_what_the_whole_tensor_draws(backend, shard, spec):
    if backend == "reference":  # run by NumPy (helpers.numpy_eval): compiling it for each drawn shape took seconds
        quantize = functools.partial(evaluate, REFERENCE.quantize)
    else:
        quantize = jax.jit(KERNELS.quantize, static_argnames="spec")
    sr_place.assert_shard_draws_the_whole(quantize, sr_place.SPECS[spec], *shard)


def test_the_place_changes_the_draws():
    """The place is read: the same slice at another place (batch entry, column, rows) rounds differently."""
    x = jax.random.normal(jax.random.key(0), (1, 64, 64), jnp.bfloat16)
    amax = jnp.abs(x.astype(jnp.float32)).max()[None]
    spec = sr_place.SPECS["1x16"]
    quantize = jax.jit(KERNELS.quantize, static_argnames="spec")
    base = sr_place.placed_seed((1, 64, 64), (0, 0, 0), (1, 64, 64))
    first = [np.asarray(o) for o in quantize(x, amax, amax, jnp.asarray(base), spec=spec)]
    for word, what in [(2, "batch entry"), (3, "column"), (4, "first row")]:
        seed = base.copy()
        seed[word] += 16
        other = quantize(x, amax, amax, jnp.asarray(seed), spec=spec)
        moved = [not np.array_equal(a, np.asarray(b)) for a, b in zip(first, other, strict=True)]
        # The rowwise codes always move; the columnwise ones with the batch entry, the column or a block's row.
        assert moved[0] and moved[2], (what, moved)


def test_a_seed_of_another_length_is_refused():
    x = jnp.ones((1, 32, 16), jnp.bfloat16)
    one = jnp.ones(1, jnp.float32)
    with pytest.raises(ValueError, match=r"seed is uint32 \[2\] or \[4 \+ M\]"):
        KERNELS.quantize(x, one, one, jnp.zeros(5, jnp.uint32), spec=sr_place.SPECS["1x16"])


# Meshes and shardings of x [B, *R, N] that keep every dimension sharded (whole blocks where the copies need them).
SHARDINGS = {
    "rows": ((128, 128), P(("a", "b"), None)),
    "columns": ((64, 128), P(None, ("b", "a"))),
    "rows and columns": ((64, 128), P("a", "b")),
    "batch and sequence": ((4, 64, 128), P("a", "b", None)),
    "sequence and columns": ((2, 64, 128), P(None, "a", "b")),
}


@needs_8_cpus
@pytest.mark.parametrize("spec", list(sr_place.SPECS))
@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_sharded_equals_unsharded(sharding, spec):
    shape, pspec = SHARDINGS[sharding]
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=CPUS[:8], axis_types=(AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(3), shape, jnp.bfloat16)
    quantize = jax.jit(lambda x: jax_nvfp4.quantize(x, sr_place.SPECS[spec], rng_key=jax.random.key(7)))
    t = quantize(jax.device_put(x, NamedSharding(mesh, pspec)))
    assert t.data.sharding.is_equivalent_to(NamedSharding(mesh, pspec), len(shape))  # it ran sharded
    assert_same_tensor(t, quantize(x))
