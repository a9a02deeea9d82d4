"""The CUDA kernels (on the CPU through the host model) draw stochastic rounding's bytes at a slice's place in
the whole tensor (the seed operand [4 + M]), as the reference and the CPU kernels do
(tests/rht_sr/test_sr_place.py), on Hopper's code paths and on sm_100a's."""

from __future__ import annotations

import jax
import pytest
from helpers import cuda_host, examples, sr_place
from helpers.cuda_host import needs_module
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = needs_module


@pytest.mark.parametrize("sm", [90, 100])
@given(shard=sr_place.shards(), spec=st.sampled_from(list(sr_place.SPECS)))
@settings(max_examples=examples(20), deadline=None)
def test_a_slice_with_its_place_draws_what_the_whole_tensor_draws(sm, shard, spec):
    with cuda_host.emulating(sm):
        sr_place.assert_shard_draws_the_whole(
            jax.jit(cuda_host.BACKEND.quantize, static_argnames="spec"), sr_place.SPECS[spec], *shard
        )
