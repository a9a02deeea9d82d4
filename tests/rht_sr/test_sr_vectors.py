"""The project's stochastic-rounding vectors (tests/golden/sr_*.npz, made by the reference with
tests/golden/make_sr_vectors.py): the reference and the CPU kernels reproduce every byte from the stored inputs,
amaxes and Philox seed. The CUDA kernels' run (on the host model) is tests/cuda/test_cuda_host_sr_vectors.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import GOLDEN_DIR, assert_sr_vector, load_sr, sr_cases, sr_vector_run

from jax_nvfp4.ops import KERNELS
from jax_nvfp4.reference import kernels

BACKENDS = {"kernel": KERNELS, "reference": kernels.REFERENCE}


def test_every_sr_vector_is_present_and_small():
    names = sr_cases()
    families = ("sr_1d_", "sr_rht_", "sr_2d_")
    assert [sum(n.startswith(f) for n in names) for f in families] == [4, 1, 2], names
    assert all((GOLDEN_DIR / n).stat().st_size < 100_000 for n in names)
    # bf16 and float32 inputs, padded shapes (M or N not whole blocks), a batch of 2.
    loaded = [load_sr(n) for n in names]
    assert {str(g["input_dtype"]) for g, *_ in loaded} == {"bfloat16", "float32"}
    assert any(x.shape[1] % 16 for _, x, *_ in loaded) and any(x.shape[0] == 2 for _, x, *_ in loaded)
    assert all(spec.stochastic_rounding and spec.columnwise for *_, spec in loaded)


# The kernels run every vector; the reference (which made them: compiling it costs seconds a case) two,
# enough to pin it, since the kernel tests check it against the kernels everywhere else.
CASES = [(name, "kernel") for name in sr_cases()] + [
    ("sr_1d_pad_40x48_bf16.npz", "reference"),
    ("sr_2d_pad_40x40_bf16.npz", "reference"),
]


@pytest.mark.parametrize(("name", "impl"), CASES)
def test_sr_vector(name, impl):
    """The backend's amaxes and quantize on the kernels' contract [B, M, N] give the stored bytes."""
    g, x, amax, amax_t, seed, spec = load_sr(name)
    run = jax.jit(sr_vector_run(BACKENDS[impl], spec))
    amaxes, outs = run(x, amax, amax_t, seed)
    assert_sr_vector(g, amaxes, outs)
    # Another seed moves codes (the vectors do depend on it), never scales.
    other = run(x, amax, amax_t, seed ^ np.uint32(1))[1]
    assert np.asarray(other[0]).tobytes() != g["data"].tobytes()
    np.testing.assert_array_equal(np.asarray(other[1]).view(np.uint8), g["scale"])
