"""The grouped CUDA kernels give the reference's bytes: ``nvfp4_grouped_amax`` and ``nvfp4_grouped_quantize``
run on the CPU by the CUDA host execution model (tests/helpers/cuda_host.py), on Hopper's code paths and on sm_100a's,
against ``jax_nvfp4.reference.grouped`` under jit. The CPU kernels run beside them on the same operands, so
that the sanitizer step (.ci/sanitize), which runs this file, reaches both kernels' code paths.

Compiling the reference takes seconds a spec, shape and dtype (the kernels run in milliseconds here), so every
test draws from the few cases of ``CASES``: the fixed tests run them on the groups of ``SIZES``, the random
ones on random sizes and values of the same shapes, which reuse the compiled reference.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import KERNEL_CASES_ONLY, assert_same_tree, cuda_host, examples, random_tensor
from helpers.counters import traced
from helpers.cuda_host import needs_module
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.ops import grouped as cpu_ops
from jax_nvfp4.reference import grouped as ref

pytestmark = needs_module
SMS = (90, 100)

# Entry 0: rows [0, 5), none, [5, 22) (cutting blocks 0 and 1), [22, 23) (one row), [23, 33); rows 33.. in no
# group. Entry 1: [0, 16), [16, 32) (boundaries on the grid: blocks no group owns), none, [32, 35), none.
SIZES = np.array([[5, 0, 17, 1, 10], [16, 16, 0, 3, 0]], np.int32)
GROUPS = SIZES.shape[1]
ROW_SEED = np.array([7, 0xDEADBEEF], np.uint32)
GROUP_SEEDS = np.arange(2 * GROUPS, dtype=np.uint32).reshape(GROUPS, 2) * np.uint32(0x9E3779B9)


class AmaxFlags(NamedTuple):
    rht_amax: bool
    per_row: bool


# Kernel (the amax's flags or the quantize's spec), dtype and shape [B, M, N]: M = 45 is off the 16-row grid
# (48 with the RHT), N = 300 and 600 end in a partial tile of the kernels' 128 columns. One entry of 600
# columns has fewer layout blocks than the model's GPU holds CUDA blocks: each takes a share of the tiles.
CASES = {
    "amax": (AmaxFlags(False, False), np.float32, (1, 45, 600)),
    "amax_per_row": (AmaxFlags(False, True), np.float16, (2, 45, 300)),
    "amax_rht": (AmaxFlags(True, False), ml_dtypes.bfloat16, (2, 48, 300)),
    "amax_rht_per_row": (AmaxFlags(True, True), ml_dtypes.bfloat16, (2, 48, 300)),
    "nearest": (QuantizeSpec(columnwise=True), np.float32, (1, 45, 600)),
    "stochastic_row_scaled": (
        QuantizeSpec(columnwise=True, stochastic_rounding=True, row_scaled=True),
        np.float16,
        (2, 45, 300),
    ),
    "4over6_mse_fast_256": (
        QuantizeSpec(columnwise=True, four_over_six_error="mse", four_over_six_fast_math=True, e4m3_max=256),
        ml_dtypes.bfloat16,
        (2, 45, 300),
    ),
    "row_scaled_4over6_mae": (
        QuantizeSpec(rowwise=False, columnwise=True, row_scaled=True, four_over_six_error="mae"),
        ml_dtypes.bfloat16,
        (2, 45, 300),
    ),
    "rht_stochastic_row_scaled": (
        QuantizeSpec(rowwise=False, columnwise=True, rht=True, stochastic_rounding=True, row_scaled=True),
        ml_dtypes.bfloat16,
        (2, 48, 300),
    ),
}


@functools.cache
def reference(kernel):
    if isinstance(kernel, QuantizeSpec):
        return jax.jit(functools.partial(ref.grouped_quantize_core, spec=kernel))
    return jax.jit(functools.partial(ref.grouped_amax_core, **kernel._asdict()))


@functools.cache
def jitted(api, kernel):
    """``kernel`` of ``api``: ``cuda_host`` (the CUDA kernels) or ``cpu_ops`` (the CPU kernels), which take the
    same operands."""
    if isinstance(kernel, QuantizeSpec):
        return jax.jit(functools.partial(api.grouped_quantize, spec=kernel))
    return jax.jit(functools.partial(api.grouped_amax, **kernel._asdict()))


def values(shape, dtype, rng: np.random.Generator, sizes: np.ndarray) -> np.ndarray:
    """Wide values and zeros; NaN and inf in groups, and NaN past the last one (where values count as zeros)."""
    x = random_tensor(rng, shape, np.float32, spread=3, specials=("zero",), frac=0.05)
    rows, cols = shape[1:]
    for b, end in enumerate(np.clip(np.cumsum(sizes, axis=1, dtype=np.int64)[:, -1], 0, rows)):
        for special in (np.nan, np.inf, -np.inf):
            x[b, rng.integers(max(end, 1)), rng.integers(cols)] = special
        if end < rows:
            x[b, rng.integers(end, rows), rng.integers(cols)] = np.nan
    return x.astype(dtype)


def check(name: str, sizes: np.ndarray, x: np.ndarray, sms=SMS, amaxes=lambda amax, amax_t: (amax, amax_t)):
    """The CUDA kernel of case ``name`` on x in groups ``sizes`` gives the reference's bytes on each sm, and so
    does the CPU kernel. The quantize takes ``amaxes`` of the grouped amaxes of x's finite values (from the CUDA
    kernel, tested on its own), so that NaN and inf reach only their blocks."""
    kernel = CASES[name][0]
    operands = (x, sizes)
    if isinstance(kernel, QuantizeSpec):
        finite = np.where(np.isfinite(x), x, 0).astype(x.dtype)
        amax, amax_t = jitted(cuda_host, AmaxFlags(kernel.rht, kernel.row_scaled))(finite, sizes)
        operands += (*amaxes(np.asarray(amax), np.asarray(amax_t)), ROW_SEED, GROUP_SEEDS[: sizes.shape[1]])
    runs = [(sm, jitted(cuda_host, kernel)) for sm in sms] + [(None, jitted(cpu_ops, kernel))]
    # .ci/sanitize: the C++ kernels against each other (compiling the reference under ASan was most of its time).
    if KERNEL_CASES_ONLY:
        want, runs = runs[-1][1](*operands), runs[:-1]
    else:
        want = reference(kernel)(*operands)
    for sm, fn in runs:
        with cuda_host.emulating(sm) if sm else contextlib.nullcontext():
            got = fn(*operands)
        assert_same_tree(got, want)


@pytest.mark.parametrize("name", CASES)
def test_grouped_kernels(name):
    """Each case on the groups of ``SIZES``: values in groups that cut blocks, and in one-row groups; empty
    groups; blocks no group owns; NaN and inf in groups and past them."""
    _, dtype, shape = CASES[name]
    sizes = SIZES[: shape[0]]
    check(name, sizes, values(shape, dtype, np.random.default_rng(len(name)), sizes))


# Seven, prime to G: NaN falls on other groups in each entry.
SPECIAL_AMAXES = np.array([np.nan, np.inf, 0.0, 1e-30, 3e38, -2.0, 1.0], np.float32)


@pytest.mark.parametrize("name", ["stochastic_row_scaled", "4over6_mse_fast_256"])
@pytest.mark.parametrize("amaxes", ["below", "special"])
def test_grouped_quantize_any_amax(name, amaxes):
    """amaxes below the values' (block scales clamp at 448, codes at 6), or special ones: NaN, inf, 0, tiny,
    huge, negative, for every group (an empty group's is never read: it owns no block)."""
    _, dtype, shape = CASES[name]
    x = values(shape, dtype, np.random.default_rng(1), SIZES)
    if amaxes == "below":
        change = lambda *a: tuple(v * np.float32(0.25) for v in a)  # noqa: E731
    else:
        change = lambda *a: tuple(np.resize(SPECIAL_AMAXES, v.shape) for v in a)  # noqa: E731
    check(name, SIZES, x, amaxes=change)


@settings(max_examples=examples(40))
@given(
    name=st.sampled_from(list(CASES)),
    sizes=st.lists(st.lists(st.integers(0, 24), min_size=GROUPS, max_size=GROUPS), min_size=2, max_size=2),
    sm=st.sampled_from(SMS),
    seed=st.integers(0, 2**32 - 1),
)
def test_grouped_random_sizes(name, sizes, sm, seed):
    """Random group sizes (their sums past M too) and values, on the cases' shapes."""
    _, dtype, shape = CASES[name]
    sizes = np.array(sizes[: shape[0]], np.int32)
    check(name, sizes, values(shape, dtype, np.random.default_rng(seed), sizes), sms=(sm,))


# The quantize cases on shapes whose rows are whole 16-byte chunks (N a multiple of 8, or of 4 for float32):
# where NVFP4_QUANTIZE_LOAD=ring takes the ring kernel (bulk copies of the owners' rows).
QUANTIZE_CASES = [name for name, case in CASES.items() if isinstance(case[0], QuantizeSpec)]
RING_COLS = {np.float32: 300, np.float16: 264, ml_dtypes.bfloat16: 136}


@settings(max_examples=examples(40))
@given(
    name=st.sampled_from(QUANTIZE_CASES),
    sizes=st.lists(st.lists(st.integers(0, 24), min_size=GROUPS, max_size=GROUPS), min_size=2, max_size=2),
    sm=st.sampled_from(SMS),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_ring_kernel_gives_the_direct_kernels_bytes(name, sizes, sm, seed):
    """grouped_ring_kernel (its steps' values by bulk copies into a ring of stages on mbarriers, which the host
    model checks) against grouped_tiles_kernel and the CPU kernel (both held to the reference by the tests
    above): random sizes (blocks no group owns, groups that cut blocks, rows past the groups) and values. Each
    case's kernel and M, with N a multiple of 8 (4 for float32) ending in a partial tile of 128 columns."""
    spec, dtype, shape = CASES[name]
    shape = (*shape[:2], RING_COLS[dtype])
    sizes = np.array(sizes[: shape[0]], np.int32)
    x = values(shape, dtype, np.random.default_rng(seed), sizes)
    finite = np.where(np.isfinite(x), x, 0).astype(x.dtype)
    amax, amax_t = jitted(cuda_host, AmaxFlags(spec.rht, spec.row_scaled))(finite, sizes)
    operands = (x, sizes, amax, amax_t, ROW_SEED, GROUP_SEEDS[: sizes.shape[1]])
    quantize = jitted(cuda_host, spec)
    with cuda_host.emulating(sm):
        with mock.patch.dict(os.environ, {"NVFP4_QUANTIZE_LOAD": "ring"}), traced() as launches:
            ring = jax.block_until_ready(quantize(*operands))
        direct = quantize(*operands)
    assert [launch.kernel for launch in launches if "grouped_ring_kernel" in launch.kernel] != []
    want = jitted(cpu_ops, spec)(*operands)
    assert_same_tree(ring, want)
    assert_same_tree(direct, want)


def test_the_ring_needs_rows_of_whole_16_byte_chunks():
    """NVFP4_QUANTIZE_LOAD=ring on rows of 300 bfloat16 values (600 bytes, not whole 16-byte chunks: no bulk
    copy fits them) runs the direct kernel, with the CPU kernel's bytes."""
    spec, dtype, shape = CASES["4over6_mse_fast_256"]
    x = values(shape, dtype, np.random.default_rng(3), SIZES)
    finite = np.where(np.isfinite(x), x, 0).astype(x.dtype)
    operands = (x, SIZES, *jitted(cuda_host, AmaxFlags(False, False))(finite, SIZES), ROW_SEED, GROUP_SEEDS)
    with mock.patch.dict(os.environ, {"NVFP4_QUANTIZE_LOAD": "ring"}), traced() as launches:
        got = jax.block_until_ready(jitted(cuda_host, spec)(*operands))
    assert [launch.kernel for launch in launches if "grouped_ring_kernel" in launch.kernel] == []
    assert [launch.kernel for launch in launches if "grouped_tiles_kernel" in launch.kernel] != []
    assert_same_tree(got, jitted(cpu_ops, spec)(*operands))


@pytest.mark.parametrize("name", ["amax_rht", "amax_rht_per_row", "rht_stochastic_row_scaled"])
def test_grouped_negative_and_huge_sizes(name):
    """Sizes the reference clamps: a negative one counts as 0, and a running sum past int32 saturates at M."""
    sizes = np.array([[-3, 10, -20, 40, 5], [2**31 - 1, 5, -(2**31) + 10, 8, 0]], np.int32)
    _, dtype, shape = CASES[name]
    check(name, sizes, values(shape, dtype, np.random.default_rng(5), SIZES), sms=(90,))


def shaped(dtype, *shape):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_grouped_errors():
    """Operands the kernels reject, as FFI errors."""
    x = jnp.zeros((2, 20, 8), jnp.bfloat16)  # a layout of 3 groups has P = 2 + 3 - 1 blocks
    sizes = jnp.ones((2, 3), jnp.int32)
    amaxes = [shaped(jnp.float32, 2), shaped(jnp.float32, 2, 3)]
    flags = dict(rht_amax=False, per_row=False)
    with pytest.raises(Exception, match=r"group_sizes must be int32 \[B, G\]"):
        cuda_host._call("nvfp4_grouped_amax", amaxes, x, jnp.ones((3, 3), jnp.int32), **flags)
    with pytest.raises(Exception, match="grouped amax results must be"):
        cuda_host._call("nvfp4_grouped_amax", amaxes[:1] * 2, x, sizes, **flags)
    with pytest.raises(Exception, match="input must be bfloat16, float16 or float32"):
        cuda_host._call("nvfp4_grouped_amax", amaxes, x.astype(jnp.int32), sizes, **flags)
    with pytest.raises(Exception, match="rht_amax needs M a multiple of 16"):
        cuda_host._call("nvfp4_grouped_amax", amaxes, x, sizes, rht_amax=True, per_row=False)

    def quantize(spec, amax_t=(2, 3), data_t=(2, 8, 32)):
        operands = (x, sizes, jnp.ones(2, jnp.float32), jnp.ones(amax_t, jnp.float32), ROW_SEED, GROUP_SEEDS[:3])
        outs = [shaped(jnp.uint8, *data_t), shaped(jnp.float8_e4m3fn, 2, 8, 4)]
        return cuda_host._call("nvfp4_grouped_quantize", outs, *operands, **spec.kernel_attrs())

    with pytest.raises(Exception, match=r"rht needs M \(the columnwise block axis\) a multiple of 16"):
        quantize(QuantizeSpec(rowwise=False, columnwise=True, rht=True))
    with pytest.raises(Exception, match="amax / amax_t must be"):
        quantize(QuantizeSpec(rowwise=False, columnwise=True), amax_t=(2,))
    with pytest.raises(Exception, match="a columnwise copy in 1x16 blocks"):
        quantize(QuantizeSpec(rowwise=True))
    with pytest.raises(Exception, match="output is missing or has the wrong dtype or size"):
        quantize(QuantizeSpec(rowwise=False, columnwise=True), data_t=(2, 8, 31))
    assert len(quantize(QuantizeSpec(rowwise=False, columnwise=True))) == 2  # the same call, valid operands
