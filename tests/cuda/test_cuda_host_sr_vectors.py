"""The CUDA kernels (on the CPU through the host model) reproduce the project's stochastic-rounding vectors
(tests/golden/sr_*.npz; the reference and the CPU kernels: tests/rht_sr/test_sr_vectors.py), on Hopper's code
paths and on sm_100a's."""

from __future__ import annotations

import jax
import pytest
from helpers import assert_sr_vector, cuda_host, load_sr, sr_cases, sr_vector_run
from helpers.cuda_host import needs_module

pytestmark = needs_module


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("name", sr_cases())
def test_sr_vector_on_the_cuda_kernels(name, sm):
    g, x, amax, amax_t, seed, spec = load_sr(name)
    with cuda_host.emulating(sm):
        amaxes, outs = jax.jit(sr_vector_run(cuda_host.BACKEND, spec))(x, amax, amax_t, seed)
    assert_sr_vector(g, amaxes, outs)
