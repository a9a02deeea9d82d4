"""jax_nvfp4.einsum: two-operand einsum as one NVFP4 dot_general (activations first, weights second)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_bytes, examples, normal
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_nvfp4
from jax_nvfp4 import Recipe
from jax_nvfp4.linear.einsum import einsum

# subscripts, lhs shape, rhs shape, the dot_general dims it is, the transpose of dot_general's result.
CASES = [
    ("bld,df->blf", (2, 16, 32), (32, 48), (((2,), (0,)), ((), ())), (0, 1, 2)),
    ("bld,dhk->blhk", (2, 16, 32), (32, 2, 16), (((2,), (0,)), ((), ())), (0, 1, 2, 3)),
    ("blhk,hkd->bld", (2, 16, 2, 16), (2, 16, 32), (((2, 3), (0, 1)), ((), ())), (0, 1, 2)),
    ("...d,df->...f", (2, 3, 16, 32), (32, 48), (((3,), (0,)), ((), ())), (0, 1, 2, 3)),
    ("bld,fd->bfl", (2, 16, 32), (48, 32), (((2,), (1,)), ((), ())), (0, 2, 1)),  # output axes reordered
    ("ebd,edf->ebf", (3, 32, 32), (3, 32, 48), (((2,), (1,)), ((0,), (0,))), (0, 1, 2)),  # a batch axis
]


@pytest.mark.parametrize(("subscripts", "lshape", "rshape", "dims", "perm"), CASES, ids=[c[0] for c in CASES])
def test_einsum_is_the_dot_general_it_spells(subscripts, lshape, rshape, dims, perm):
    x, w = normal(lshape, 0, jnp.bfloat16), normal(rshape, 1)
    recipe, key = Recipe(), jax.random.key(2)
    want = jax_nvfp4.dot_general(x, w, dims, recipe=recipe).transpose(perm)
    assert_same_bytes(einsum(subscripts, x, w, recipe=recipe), want)
    # The backward pass too: the recipe's dgrad and wgrad with the same stochastic-rounding key.
    dy = normal(want.shape, 3)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * dy)

    got = jax.grad(loss(lambda x, w: einsum(subscripts, x, w, recipe=recipe, rng_key=key)), (0, 1))(x, w)
    ref = jax.grad(
        loss(lambda x, w: jax_nvfp4.dot_general(x, w, dims, recipe=recipe, rng_key=key).transpose(perm)), (0, 1)
    )(x, w)
    jax.tree.map(assert_same_bytes, got, ref)


MAX_TERM_SIZE = 1 << 15


@st.composite
def _problems(draw):
    """Random subscripts: batch, contracted and free labels of random sizes, each term in a random order."""
    sizes = st.integers(1, 3)
    n_batch, n_contract, n_lfree, n_rfree = draw(sizes.map(lambda n: n - 1)), draw(sizes), draw(sizes), draw(sizes)
    labels = iter("abcdefghijklmnop")
    batch, contract = [next(labels) for _ in range(n_batch)], [next(labels) for _ in range(n_contract)]
    lfree, rfree = [next(labels) for _ in range(n_lfree)], [next(labels) for _ in range(n_rfree)]
    size = {c: draw(st.sampled_from([2, 3, 16, 20])) for c in batch + contract + lfree + rfree}
    # Up to eight axes a term: unbounded, a draw's operand could hold billions of values (one of 3.4e8 took a
    # worker's 24 GB). The largest axes shrink to 2 until each term holds at most MAX_TERM_SIZE.
    for term in (batch + contract + lfree, batch + contract + rfree, batch + lfree + rfree):
        while math.prod(size[c] for c in term) > MAX_TERM_SIZE:
            size[max(term, key=size.get)] = 2
    lhs = draw(st.permutations(batch + contract + lfree))
    rhs = draw(st.permutations(batch + contract + rfree))
    out = draw(st.permutations(batch + lfree + rfree))
    return "".join(lhs), "".join(rhs), "".join(out), size, (batch, contract, lfree, rfree)


@settings(max_examples=examples(40))
@given(_problems(), st.integers(0, 2**16))
def test_einsum_is_one_canonical_dot_general(problem, seed):
    """Any order of the terms' axes gives the bytes of one canonical dot_general, x [batch, free, contracted]
    . w [batch, contracted, free], then the output's order. The blocks depend on how the contracted axes
    flatten into K (in x's order, for both operands) and w's free axes into N (in w's order); the order of the
    batch axes, of x's free axes and of the output does not change a value."""
    lhs, rhs, out, size, (batch, _, lfree, _) = problem
    contract = [c for c in lhs if c in rhs and c not in out]
    rfree = [c for c in rhs if c not in lhs]
    x = normal([size[c] for c in lhs], seed, jnp.bfloat16)
    w = normal([size[c] for c in rhs], seed + 1)
    got = einsum(f"{lhs},{rhs}->{out}", x, w)
    xc = x.transpose([lhs.index(c) for c in batch + lfree + contract])
    wc = w.transpose([rhs.index(c) for c in batch + contract + rfree])
    nb, nf, nk = len(batch), len(lfree), len(contract)
    dims = ((tuple(range(nb + nf, xc.ndim)), tuple(range(nb, nb + nk))), (tuple(range(nb)), tuple(range(nb))))
    produced = "".join(batch + lfree + rfree)
    want = jax_nvfp4.dot_general(xc, wc, dims).transpose([produced.index(c) for c in out])
    assert_same_bytes(got, want)


def test_a_label_of_one_operand_alone_is_summed_first():
    x, w = normal((2, 4, 16, 32), 0), normal((32, 48), 1)
    want = jax_nvfp4.dot_general(x.sum(1), w, (((2,), (0,)), ((), ())))
    assert_same_bytes(einsum("bsld,df->blf", x, w), want)


def test_einsum_matches_jnp_einsum_in_shape_and_roughly_in_value():
    x, w = normal((2, 16, 64), 0), normal((64, 2, 32), 1)
    got, want = einsum("bld,dhk->bhlk", x, w), jnp.einsum("bld,dhk->bhlk", x, w)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.25  # NVFP4's error, not a wrong layout


@pytest.mark.parametrize(
    ("subscripts", "message"),
    [
        ("bld,df", "explicit output"),
        ("bld,df,fg->blg", "two operands"),
        ("bll,df->blf", "repeated within a term"),
        ("bld,df->blfz", "in neither operand"),
        ("bl1,df->blf", "letters and ellipses"),
        ("bl,df->blf", "does not match an operand of rank 3"),
    ],
)
def test_einsum_errors(subscripts, message):
    with pytest.raises(ValueError, match=message):
        einsum(subscripts, normal((2, 16, 32), 0), normal((32, 48), 1))
    with pytest.raises(ValueError, match="sizes 32 and 16"):
        einsum("bld,df->blf", normal((2, 16, 32), 0), normal((16, 48), 1))
