"""cache_weight: a weight quantized once per optimizer step, reused by each micro-batch, differentiated as kernel."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DENSE, assert_same_bytes, dense_problem, eqns_named, quantized_shapes, random_normal
from jax import lax

import jax_nvfp4
from jax_nvfp4 import CachedWeight, Recipe, cache_weight


@pytest.mark.parametrize(
    "recipe", [Recipe(), Recipe(weight_block_2d=False), Recipe(rht=False, stochastic_rounding=False, impl="scaled_dot")]
)
def test_cached_weight_gives_the_same_outputs_and_gradients(recipe):
    """y, dx and dW with the cached copy equal quantizing the kernel in the GEMM, bit for bit (the same key)."""
    x, w, dy = dense_problem(32, 48, 40)
    key = jax.random.key(4)
    dot = functools.partial(jax_nvfp4.dot_general, recipe=recipe, rng_key=key)
    cache = cache_weight(w, recipe)
    want_y, want_vjp = jax.vjp(lambda x, w: dot(x, w, DENSE), x, w)
    got_y, got_vjp = jax.vjp(lambda x, w: dot(x, CachedWeight(w, cache.quantized), DENSE), x, w)
    assert_same_bytes(got_y, want_y)
    for got, want in zip(got_vjp(dy), want_vjp(dy), strict=True):
        assert_same_bytes(got, want)


def test_cached_dense_general_kernel():
    """A DenseGeneral kernel [heads, kv, embed] contracting two axes (contract_ndim=2)."""
    x, w = random_normal((8, 4, 16), 1), random_normal((4, 16, 32), 2)
    dims = (((1, 2), (0, 1)), ((), ()))
    dot = functools.partial(jax_nvfp4.dot_general, recipe=Recipe(stochastic_rounding=False))
    cache = cache_weight(w, Recipe(stochastic_rounding=False), contract_ndim=2)
    want = jax.grad(lambda w: jnp.sum(dot(x, w, dims).astype(jnp.float32) ** 2))(w)
    got = jax.grad(lambda w: jnp.sum(dot(x, CachedWeight(w, cache.quantized), dims).astype(jnp.float32) ** 2))(w)
    assert_same_bytes(got, want)


def _weight_quantizes(hlo: str, shape: str) -> list[bool]:
    """For each quantize custom call of a ``shape`` result in compiled HLO: whether it sits in a while loop's body."""
    computation, found, bodies = None, [], set()
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line.rstrip())
        if header:
            computation = header.group(1)
        bodies.update(re.findall(r"body=%?([\w.\-]+)", line))
        if 'custom_call_target="nvfp4_quantize"' in line and f"({shape}" in line:
            found.append(computation)
    return [c in bodies for c in found]


def _scan_quantizes(jaxpr, shape: tuple[int, ...]) -> int:
    """Quantize equations on a [*shape] input inside the one scan of ``jaxpr``."""
    (scan,) = eqns_named(jaxpr, "scan")
    return sum(s == shape for s in quantized_shapes(scan.params["jaxpr"]))


def test_gradient_accumulation_quantizes_the_weight_once_per_step():
    """A lax.scan over 4 micro-batches, each taking its own gradient: with cache_weight the program quantizes W
    once, outside the loop, and gives the same gradients as quantizing it in each micro-batch."""
    recipe = Recipe()
    xs, w = random_normal((4, 32, 64), 0), random_normal((64, 48), 1) * 0.1
    key = jax.random.key(2)

    def step(w, xs, cached):
        cache = cache_weight(w, recipe) if cached else None

        def micro_batch(acc, i):
            def loss(w):
                rhs = CachedWeight(w, cache.quantized) if cached else w
                y = jax_nvfp4.dot_general(xs[i], rhs, DENSE, recipe=recipe, rng_key=jax.random.fold_in(key, i))
                return jnp.sum(y.astype(jnp.float32) ** 2)

            return acc + jax.grad(loss)(w).astype(jnp.float32), None

        return lax.scan(micro_batch, jnp.zeros(w.shape, jnp.float32), jnp.arange(xs.shape[0]))[0]

    plain, cached = (functools.partial(step, cached=c) for c in (False, True))
    # What we emit: W [1, 64, 48] quantized in the loop body (its columnwise copy, W^T's rowwise one), or not at
    # all there.
    assert _scan_quantizes(jax.make_jaxpr(plain)(w, xs), (1, 64, 48)) == 1
    assert _scan_quantizes(jax.make_jaxpr(cached)(w, xs), (1, 64, 48)) == 0
    # What runs: one quantize of W (W^T's codes u8[1, 48, 32]), outside the loop. Without the cache XLA's
    # loop-invariant code motion may hoist it too (it does on the CPU); with it, that is by construction.
    compiled = jax.jit(cached).lower(w, xs).compile()
    assert _weight_quantizes(compiled.as_text(), "u8[1,48,32]") == [False]
    assert_same_bytes(compiled(w, xs), jax.jit(plain)(w, xs))


def test_cached_weight_errors():
    x, w = random_normal((16, 32), 0), random_normal((32, 16), 1)
    cache = cache_weight(w, Recipe(stochastic_rounding=False))
    with pytest.raises(ValueError, match="another recipe"):
        jax_nvfp4.dot_general(x, CachedWeight(w, cache.quantized), DENSE, recipe=Recipe(weight_block_2d=False))
    with pytest.raises(ValueError, match="quantize_weight of its kernel"):
        jax_nvfp4.dot_general(x, CachedWeight(w[:, :8], cache.quantized), DENSE)
    with pytest.raises(ValueError, match="contracts its first 1 axes"):
        jax_nvfp4.dot_general(x.T, cache, (((0,), (1,)), ((), ())), recipe=Recipe(stochastic_rounding=False))
    with pytest.raises(TypeError, match="not MXFP8"):
        jax_nvfp4.dot_general(x, cache, DENSE, recipe=jax_nvfp4.MXFP8())
    assert np.asarray(cache[...].kernel).shape == (32, 16)
