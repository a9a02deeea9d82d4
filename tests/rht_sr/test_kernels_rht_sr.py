"""The FFI kernels' RHT and stochastic rounding give the reference's bytes.

Calls the FFI targets directly (the kernel contract: canonical [B, M, N]
inputs), so it does not depend on the Python primitives that bind them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DTYPES,
    SPECIAL_VALUES,
    assert_same_bytes,
    examples,
    random_tensor,
    reference_amax,
    reference_quantize,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_nvfp4 import QuantizeSpec, reference
from jax_nvfp4.ops import ffi
from jax_nvfp4.reference import stochastic


@functools.cache
def _platform() -> str:
    platforms = ffi.platforms_with("nvfp4_quantize")  # registers the targets
    assert platforms, "no compiled nvfp4 kernels"
    return jax.default_backend()


def ffi_amax(x, *, rht: bool):
    _platform()
    out = [jax.ShapeDtypeStruct((x.shape[0],), jnp.float32)] * (2 if rht else 1)
    return jax.jit(lambda x: jax.ffi.ffi_call("nvfp4_amax", out)(x, rht_amax=rht, per_row=False))(x)


def ffi_quantize(x, amax, amax_t, seed, **opts):
    _platform()
    bsz, rows, cols = x.shape
    out = []
    if opts["rowwise"]:
        out += [
            jax.ShapeDtypeStruct((bsz, rows, -(-cols // 2)), jnp.uint8),
            jax.ShapeDtypeStruct((bsz, rows, -(-cols // 16)), jnp.float8_e4m3fn),
        ]
    if opts["columnwise"]:
        out += [
            jax.ShapeDtypeStruct((bsz, cols, -(-rows // 2)), jnp.uint8),
            jax.ShapeDtypeStruct((bsz, cols, -(-rows // 16)), jnp.float8_e4m3fn),
        ]
    call = jax.ffi.ffi_call("nvfp4_quantize", out)
    attrs = QuantizeSpec(**opts).kernel_attrs()
    return jax.jit(lambda *a: call(*a, **attrs))(x, amax, amax_t, seed)


_reference_rht = jax.jit(reference.rht_columns, static_argnums=1)


@st.composite
def batched_tensors(draw, *, rht: bool):
    bsz = draw(st.integers(1, 2))
    rows = 16 * draw(st.integers(1, 4)) if rht else draw(st.integers(1, 70))
    cols = draw(st.integers(1, 80))
    dtype = draw(st.sampled_from(DTYPES))
    specials = tuple(draw(st.sets(st.sampled_from(sorted(SPECIAL_VALUES)))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 2.0, 12.0, 40.0]))
    frac = draw(st.sampled_from([0.01, 0.3]))
    return jnp.asarray(random_tensor(rng, (bsz, rows, cols), dtype, spread=spread, specials=specials, frac=frac))


seeds = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(
    lambda s: jnp.asarray(np.array(s, np.uint32))
)


@given(x=batched_tensors(rht=True))
@settings(max_examples=examples(30))
def test_amax_rht(x):
    got = ffi_amax(x, rht=True)
    want = reference_amax(x, rht_amax=True)
    assert len(got) == len(want) == 2
    for a, b in zip(got, want, strict=True):
        assert_same_bytes(a, b)
    assert_same_bytes(ffi_amax(x, rht=False)[0], want[0])


@st.composite
def quantize_cases(draw):
    rht = draw(st.booleans())
    block_2d = False if rht else draw(st.booleans())
    opts = {
        "rowwise": draw(st.booleans()),
        "columnwise": True if rht else draw(st.booleans()),
        "block_2d": block_2d,
        "rht": rht,
        "stochastic_rounding": draw(st.booleans()),
    }
    if not (opts["rowwise"] or opts["columnwise"]):
        opts["rowwise"] = True
    x = draw(batched_tensors(rht=rht))
    # amax_t: the tensor's own amax (of the transform with rht), or another
    # number (a different global scale for the columnwise copy only).
    amax_t_kind = draw(st.sampled_from(["own", "scaled"]))
    return x, opts, draw(seeds), amax_t_kind


@given(case=quantize_cases())
@settings(max_examples=examples(60))
def test_quantize(case):
    x, opts, seed, amax_t_kind = case
    amax, amax_rht = reference_amax(x, rht_amax=True) if opts["rht"] else (reference_amax(x)[0], None)
    amax_t = amax_rht if opts["rht"] else amax
    if amax_t_kind == "scaled":
        amax_t = amax_t * np.float32(3.0)
    got = ffi_quantize(x, amax, amax_t, seed, **opts)
    want = reference_quantize(x, amax, amax_t, seed, **opts)
    assert len(got) == len(want) == 2 * (opts["rowwise"] + opts["columnwise"])
    for a, b in zip(got, want, strict=True):
        assert_same_bytes(a, b)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_every_step(dtype, block_2d):
    """Values spread over every E2M1 step (and beyond 6), many seeds: the Philox bytes and the
    stochastic encode match the reference bit for bit."""
    rng = np.random.default_rng(7)
    base = np.linspace(-7.0, 7.0, 2 * 33 * 48, dtype=np.float32).reshape(2, 33, 48)
    x = jnp.asarray((base * rng.uniform(0.9, 1.1, base.shape)).astype(dtype))
    amax = jnp.full((2,), 6.0, jnp.float32)  # encode scale near 448: the values land on all steps
    opts = dict(rowwise=True, columnwise=True, block_2d=block_2d, rht=False, stochastic_rounding=True)
    for _ in range(3):
        seed = jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
        got = ffi_quantize(x, amax, amax, seed, **opts)
        want = reference_quantize(x, amax, amax, seed, **opts)
        for a, b in zip(got, want, strict=True):
            assert_same_bytes(a, b)
    # Different seeds give different codes; the same seed gives the same codes.
    s0, s1 = jnp.asarray(np.array([1, 2], np.uint32)), jnp.asarray(np.array([1, 3], np.uint32))
    a0 = ffi_quantize(x, amax, amax, s0, **opts)[0]
    assert_same_bytes(a0, ffi_quantize(x, amax, amax, s0, **opts)[0])
    assert np.asarray(a0).tobytes() != np.asarray(ffi_quantize(x, amax, amax, s1, **opts)[0]).tobytes()


def test_rht_needs_rows_multiple_of_16():
    x = jnp.ones((1, 20, 16), jnp.bfloat16)
    # block_until_ready: a GPU reports a kernel's error when its result is awaited, not at the call.
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(ffi_amax(x, rht=True))
    amax = jnp.ones((1,), jnp.float32)
    seed = jnp.zeros((2,), jnp.uint32)
    opts = dict(rowwise=False, columnwise=True, block_2d=False, rht=True, stochastic_rounding=False)
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(ffi_quantize(x, amax, amax, seed, **opts))


# ---- the CUDA kernels' per-thread helpers, run on the host ----
# Philox-4x32-10 (numerics.h's philox4x32_10, every backend's random stream) against the Random123 known
# answers and the reference, and rht16 (the CUDA kernel's transform of one column's chunk in registers,
# which the CPU kernels do not use): a small host program built from ffi/nvfp4/numerics.h runs them.

_HELPER = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "nvfp4/numerics.h"
int main(int argc, char** argv) {
  uint32_t head[4];  // k0, k1, unused, count
  if (std::fread(head, 4, 4, stdin) != 4) return 1;
  const uint32_t n = head[3];
  const bool philox = argv[1][0] == 'p';
  std::vector<uint32_t> in(size_t(n) * (philox ? 4 : 16)), out(size_t(n) * (philox ? 4 : 16));
  if (std::fread(in.data(), 4, in.size(), stdin) != in.size()) return 1;
  for (uint32_t i = 0; i < n; ++i) {
    if (philox) {
      const uint32_t* c = &in[size_t(i) * 4];
      uint32_t w[4];
      nvfp4::philox4x32_10(nvfp4::Seed{head[0], head[1]}, c[0], c[1], c[2], c[3], w);
      std::memcpy(&out[size_t(i) * 4], w, sizeof(w));
    } else {
      float v[nvfp4::kBlock];
      std::memcpy(v, &in[size_t(i) * 16], sizeof(v));
      nvfp4::rht16(v);
      std::memcpy(&out[size_t(i) * 16], v, sizeof(v));
    }
  }
  std::fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
"""


@functools.cache
def _helper_binary(tmp_dir: str) -> str:
    import os
    import shutil
    import subprocess

    ffi_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ffi")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or not os.path.isdir(ffi_dir):
        pytest.skip("needs a C++ compiler and the ffi/ sources")
    src, exe = os.path.join(tmp_dir, "helper.cc"), os.path.join(tmp_dir, "helper")
    with open(src, "w") as f:
        f.write(_HELPER)
    subprocess.run(
        [compiler, "-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-I", ffi_dir, src, "-o", exe],
        check=True,
    )
    return exe


def _run_helper(tmp_path_factory, mode: str, head, payload: np.ndarray) -> np.ndarray:
    import subprocess

    exe = _helper_binary(str(tmp_path_factory.mktemp("helper")))
    data = np.asarray(head, np.uint32).tobytes() + payload.astype(np.uint32).tobytes()
    out = subprocess.run([exe, mode], input=data, capture_output=True, check=True).stdout
    return np.frombuffer(out, np.uint32).reshape(-1, 4 if mode == "philox" else 16)


# Random123's known answers for Philox-4x32-10 (its kat_vectors): (counter, key, output).
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def test_philox_is_random123s(tmp_path_factory):
    """The kernels' and the reference's Philox-4x32-10 give Random123's known answers, and agree on random counters."""
    for counter, key, want in PHILOX_KATS:
        got = _run_helper(tmp_path_factory, "philox", (*key, 0, 1), np.array(counter, np.uint32))
        np.testing.assert_array_equal(got[0], np.array(want, np.uint32))
        ref = stochastic.philox4x32_10(jnp.asarray(np.array(key, np.uint32)), *(jnp.uint32(c) for c in counter))
        np.testing.assert_array_equal(np.array([int(w) for w in ref], np.uint32), np.array(want, np.uint32))
    rng = np.random.default_rng(3)
    counters = rng.integers(0, 2**32, (256, 4), dtype=np.uint64).astype(np.uint32)
    key = rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32)
    got = _run_helper(tmp_path_factory, "philox", (*key, 0, counters.shape[0]), counters)
    want = np.stack(stochastic.philox4x32_10(jnp.asarray(key), *jnp.asarray(counters.T)), axis=-1)
    np.testing.assert_array_equal(got, np.asarray(want))


@given(x=batched_tensors(rht=True))
@settings(max_examples=examples(20))
def test_rht16_is_the_reference_transform(tmp_path_factory, x):
    # float32 input: rht16 without the final rounding is the whole transform.
    u = np.asarray(x.astype(jnp.float32)).view(np.uint32)
    chunks = np.swapaxes(u, 1, 2).reshape(-1, 16)  # [B, N, M / 16, 16]
    got = _run_helper(tmp_path_factory, "rht", (0, 0, 0, chunks.shape[0]), chunks)
    want = np.asarray(_reference_rht(jnp.asarray(u), jnp.float32)).reshape(-1, 16)
    # NaN payloads may differ (hardware vs the reference's canonical NaN); any NaN quantizes alike.
    nan_got = (got & 0x7FFFFFFF) > 0x7F800000
    nan_want = (want & 0x7FFFFFFF) > 0x7F800000
    np.testing.assert_array_equal(nan_got, nan_want)
    np.testing.assert_array_equal(np.where(nan_got, 0, got), np.where(nan_want, 0, want))
