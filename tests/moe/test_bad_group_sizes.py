"""``ragged_dot``'s group_sizes a user gets wrong (issue 38): concrete ones are refused, traced ones do what
the docstring and docs/moe.md say."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes

import jax_nvfp4

LHS = jax.random.normal(jax.random.key(0), (48, 32), jnp.bfloat16)
RHS = jax.random.normal(jax.random.key(1), (3, 32, 16), jnp.bfloat16)


@pytest.mark.parametrize(
    "sizes,message",
    [
        ([16, -2, 20], r"group_sizes must be >= 0, got -2 for group 1 \(group_sizes=\[16, -2, 20\]\)"),
        ([16, 21, 12], r"group_sizes sum to 49, past lhs's 48 rows \(group_sizes=\[16, 21, 12\]\)"),
        (np.array([2**31 - 1, 2**31 - 1, 2], np.int32), r"group_sizes sum to 4294967296, past lhs's 48 rows"),
    ],
    ids=["negative", "past M", "past M in int64"],
)
def test_concrete_bad_group_sizes_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        jax_nvfp4.ragged_dot(LHS, RHS, jnp.asarray(sizes))


def test_sizes_that_fill_m_exactly_pass():
    assert jax_nvfp4.ragged_dot(LHS, RHS, jnp.array([16, 0, 32])).shape == (48, 16)


def test_traced_bad_group_sizes_count_negative_as_zero_and_cut_at_m():
    ragged = jax.jit(jax_nvfp4.ragged_dot)
    # A negative size counts as zero.
    assert_same_bytes(ragged(LHS, RHS, jnp.array([16, -2, 20])), ragged(LHS, RHS, jnp.array([16, 0, 20])))
    # A sum past M cuts the last groups at M.
    assert_same_bytes(ragged(LHS, RHS, jnp.array([16, 21, 30])), ragged(LHS, RHS, jnp.array([16, 21, 11])))
