"""Inputs, byte-exact comparisons and program inspection that tests of several features use."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings

import jax_nvfp4
from jax_nvfp4 import reference


def examples(thorough: int) -> int:
    """A test's example count: ``thorough`` under the hypothesis profile "thorough", scaled as the active
    profile scales the default count (tests/conftest.py: a share of thorough's, at least 3)."""
    share = settings.default.max_examples / settings.get_profile("thorough").max_examples
    return max(3, round(thorough * share))


# The input dtypes, in the order the kernel tests draw them.
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
# NVFP4_KERNEL_CASES_ONLY=1 (.ci/sanitize): only the cases that run C++ (tests/conftest.py drops those that run
# only the pure-JAX reference; a test that compares a kernel with the reference compares it with another kernel).
KERNEL_CASES_ONLY = os.environ.get("NVFP4_KERNEL_CASES_ONLY") == "1"
# The public API on the CPU kernels and on the pure-JAX reference (KERNEL_CASES_ONLY drops the reference's cases).
IMPLEMENTATIONS = {"kernel": jax_nvfp4, "reference": reference}
IMPLS = pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))

# The CPU devices; the sharding tests take 8 (tests/conftest.py asks XLA for them).
CPUS = jax.devices("cpu")
needs_8_cpus = pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (XLA_FLAGS, set in conftest.py)")
# Tests whose mesh is the example's (examples/lm/mesh.py: over jax.devices(), the default backend's): 8 of those, which
# the CPU backend has under conftest.py's flag and a machine with fewer GPUs does not (there they skip, not fail).
needs_8_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason="builds its mesh over jax.devices(): needs 8 devices of the default backend"
)

SPECIAL_VALUES = {
    "zero": [0.0, -0.0],
    "inf": [np.inf, -np.inf],
    "nan": [np.nan],
    # float32/bfloat16 subnormals, and values whose scaled products underflow.
    "subnormal": [1e-39, -1e-39, 3e-45, -5.9e-39, 1e-40],
    "outlier": [1e30, -3e38, 6.5e4, -1e20],
    "tiny": [1e-30, -1e-30, -1e-6, 2.0**-126],
}


def random_tensor(rng: np.random.Generator, shape, dtype, *, spread: float, specials: tuple[str, ...], frac: float):
    """Normal values times 10**U(-spread, spread), with a fraction of special values."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, size=shape)
    pool = [v for name in specials for v in SPECIAL_VALUES[name]]
    if pool:
        mask = rng.random(shape) < frac
        x = np.where(mask, rng.choice(pool, size=shape), x)
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(dtype)


def normal(shape, seed, dtype=jnp.float32) -> jax.Array:
    """Standard normal values from numpy's generator ``seed``, as ``dtype``."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def random_normal(shape, seed, dtype=jnp.bfloat16) -> jax.Array:
    """``jax.random.normal(jax.random.key(seed), shape, float32).astype(dtype)``, compiled once a length.

    Drawn flat at a power-of-two length (1024 at least) and cut to ``shape``: with partitionable Threefry
    (jax's default) each value depends on its index alone, so these are the values of ``shape``'s own draw
    (tests/build_checks/test_helpers.py), without a compile of the draw and the cast for every shape.
    """
    size = math.prod(shape)
    return jnp.asarray(
        _normal_draw(seed, max(1024, 1 << (size - 1).bit_length()), jnp.dtype(dtype))[:size].reshape(shape)
    )


@functools.cache
def _normal_draw(seed: int, length: int, dtype: np.dtype) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(seed), (length,), jnp.float32).astype(dtype))


# ---- byte-exact comparisons ----


def raw_bytes(a) -> np.ndarray:
    """An array's bytes, flat."""
    return np.asarray(a).reshape(-1).view(np.uint8)


def assert_same_bytes(got, want, what: str = ""):
    """The same shape, dtype and raw bytes (NaN bit patterns included)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    diff = raw_bytes(got) != raw_bytes(want)
    assert not diff.any(), f"{what}: {diff.sum()} of {diff.size} bytes differ"


def assert_same_tree(got, want):
    """The same pytree structure, and the same bytes in each leaf (``assert_same_bytes``)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_same_bytes(g, w)


FIELDS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t")


def assert_same_tensor(t, u):
    """Two NVFP4Tensors with the same metadata and the same bytes in each array."""
    decoding = ("block_2d", "rht", "row_scaled", "e4m3_max")  # the spec fields that say how the bytes decode
    assert (t.shape, t.dtype) == (u.shape, u.dtype)
    assert [getattr(t.spec, k) for k in decoding] == [getattr(u.spec, k) for k in decoding]
    for name in FIELDS:
        a, b = getattr(t, name), getattr(u, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert_same_bytes(a, b, name)


def unpack(data) -> np.ndarray:
    """Packed E2M1 codes [..., n] (two a byte, low nibble first) as one code a value [..., 2n]."""
    d = np.asarray(data)
    return np.stack([d & 0xF, d >> 4], axis=-1).reshape(*d.shape[:-1], -1)


def canonical_zero_codes(data):
    """Code 8 (-0) and code 0 (+0) both decode to zero: compare them as one."""
    lo, hi = np.asarray(data) & 0xF, np.asarray(data) >> 4
    return np.where(lo == 8, 0, lo) | (np.where(hi == 8, 0, hi) << 4)


def columnwise_as_rowwise(t):
    """The columnwise copy of a quantized [M, N] tensor as the rowwise tensor of its [N, M] transpose."""
    return jax_nvfp4.NVFP4Tensor(
        t.data_t, t.scale_t, t.amax_t, None, None, None, t.shape[::-1], t.dtype,
        spec=jax_nvfp4.QuantizeSpec(row_scaled=t.spec.row_scaled, four_over_six_error=t.spec.four_over_six_error,
                                    e4m3_max=t.spec.e4m3_max),
    )  # fmt: skip


# ---- what a program runs ----


def eqns_named(jaxpr, name: str) -> list:
    """Every equation of primitive ``name`` that a (closed) jaxpr runs, nested jaxprs included, one per call."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += eqns_named(sub, name)
    return found


def quantized_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The input shape of every quantize a (closed) jaxpr runs (``nvfp4_quantize`` equations, nested included)."""
    return [tuple(e.invars[0].aval.shape) for e in eqns_named(jaxpr, "nvfp4_quantize")]


_FUNC = re.compile(r"^  func\.func (?:public |private )?@([\w.$-]+)", re.M)


def stablehlo_functions(module: str) -> dict[str, str]:
    """A StableHLO module's functions by name."""
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(module)]
    ends = [s for s, _ in starts[1:]] + [len(module)]
    return {name: module[s:e] for (s, name), e in zip(starts, ends, strict=True)}


_DECODE_SCALE_RESULT = re.compile(r"-> tensor<[\dx]*x1xf32>|= f32\[[\d,]*,1\]")


def dequantized_blocks(text: str) -> list[str]:
    """The lines of StableHLO or HLO ``text`` that dequantize blocks of values: its nvfp4_dequantize calls
    other than the GEMMs' global decode scales (``ops.gemm.decode_scale``: one float32 value a row)."""
    return [
        line
        for line in text.splitlines()
        if ("@nvfp4_dequantize" in line or '"nvfp4_dequantize"' in line) and not _DECODE_SCALE_RESULT.search(line)
    ]


def cuda_tool(name: str) -> str | None:
    """A CUDA binary tool (``cuobjdump``, ``nvdisasm``) on PATH, or the nvidia-cuda-* wheel's (the test extra
    has both), or None."""
    found = shutil.which(name)
    spec = importlib.util.find_spec("nvidia")
    for root in [] if found or spec is None else spec.submodule_search_locations:
        found = next((str(p) for p in pathlib.Path(root).glob(f"cu*/bin/{name}")), None)
        if found:
            break
    return found
