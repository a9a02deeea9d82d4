"""The shared test helpers' own claims."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_bytes, random_normal


@pytest.mark.parametrize("shape", [(1,), (5, 37), (3, 200, 600), (1024,), (1025,)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_random_normal_is_jax_randoms_draw_of_the_shape(shape, dtype):
    want = jax.random.normal(jax.random.key(7), shape, jnp.float32).astype(dtype)
    assert_same_bytes(random_normal(shape, 7, dtype), want)
