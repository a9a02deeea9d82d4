"""The CUDA host execution model itself (ffi/cuda/host): what each warp exchange returns, a real
__syncthreads(), atomics across blocks, the launch limits of sm_90, the misuse it fails a launch on (a
GPU would hang or corrupt), and the host equivalents of sm_100a's E2M1 convert and of the float16
truncation of the sm_90 pair table against the instructions' documented semantics. The probe
kernels are ffi/cuda/host/probes.cu.
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import cuda_host
from helpers.cuda_host import module, needs_module
from hypothesis import given
from hypothesis import strategies as st

import jax_nvfp4

pytestmark = needs_module
FULL = 0xFFFFFFFF
WARPS = 2  # the shuffle probe runs 64 threads


def expected_shuffle(op: str, arg: int, width: int, mask: int) -> list[int]:
    """What thread t of the probe receives from value 1000 + t, as the CUDA programming guide
    defines each exchange (-1 for lanes outside the mask, which do not call)."""
    out = []
    for t in range(32 * WARPS):
        lane, warp_base = t % 32, t - t % 32
        if not mask >> lane & 1:
            out.append(-1)
            continue
        segment, offset = lane - lane % width, lane % width
        if op == "idx":
            src = segment + arg % width
        elif op == "up":
            src = lane - arg if offset >= arg else lane
        elif op == "down":
            src = lane + arg if offset + arg < width else lane
        else:  # xor: a lane of a later segment gives the own value
            src = lane ^ arg if (lane ^ arg) < segment + width else lane
        out.append(1000 + warp_base + src)
    return out


OPS = {"idx": 0, "up": 1, "down": 2, "xor": 3}


@given(
    op=st.sampled_from(sorted(OPS)),
    arg=st.integers(0, 40),
    width=st.sampled_from([1, 2, 4, 8, 16, 32]),
)
def test_shuffles_over_the_whole_warp(op, arg, width):
    if op == "xor":
        arg %= 32
    got = module.probe("shuffles", 32 * WARPS, OPS[op], arg, width, FULL)
    assert got == expected_shuffle(op, arg, width, FULL)


@pytest.mark.parametrize(
    "op,arg,width,mask",
    [("xor", 1, 32, 0x0000FFFF), ("xor", 8, 16, 0xFFFF0000), ("idx", 3, 8, 0x00FF00FF), ("down", 4, 8, 0xFF00FF00)],
)
def test_shuffles_within_a_partial_mask(op, arg, width, mask):
    assert module.probe("shuffles", 32 * WARPS, OPS[op], arg, width, mask) == expected_shuffle(op, arg, width, mask)


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 33])
def test_ballot(divisor):
    got = module.probe("shuffles", 32 * WARPS, 4, divisor, 32, FULL)
    ballot = sum(1 << lane for lane in range(32) if lane % divisor == 0)
    # Each warp votes on its thread indices: warp 1's threads are 32..63.
    warp1 = sum(1 << lane for lane in range(32) if (32 + lane) % divisor == 0)
    as_int32 = lambda u: u - (1 << 32) if u >> 31 else u  # noqa: E731 (the probe's output is int)
    assert got == [as_int32(ballot)] * 32 + [as_int32(warp1)] * 32


@pytest.mark.parametrize("threads", [32, 100, 1024])
def test_syncthreads_is_a_barrier(threads):
    """Thread 0 sums what every thread wrote before the barrier, in each of 5 blocks on 3 workers."""
    with cuda_host.threads(3):
        assert module.probe("barrier_sum", 5, 5, threads) == [threads * (threads - 1) // 2] * 5


def test_atomics_across_blocks():
    blocks, threads = 37, 96
    with cuda_host.threads(4):
        got = module.probe("atomics", 2 + blocks, blocks, threads)
    assert got == [blocks * threads, blocks * threads - 1, *range(1, blocks + 1)]


@pytest.mark.parametrize(
    "grid_y,grid_z,threads,ok",
    [(2, 3, 1024, True), (1, 1, 1025, False), (65536, 1, 32, False), (1, 65536, 32, False), (1, 1, 0, False)],
)
def test_launch_limits(grid_y, grid_z, threads, ok):
    """Block <= 1024 threads and grid y, z <= 65535, as on the GPU: a launch error, not a crash."""
    run = lambda: module.probe("launch", 6, grid_y, grid_z, threads)  # noqa: E731
    if ok:
        assert run() == [threads * (threads - 1) // 2] * 1 + [-1] * 5
    else:
        with pytest.raises(RuntimeError, match="probe launch failed: invalid configuration argument"):
            run()


def test_dynamic_shared_memory_limit():
    """48 KiB without opting in, up to sm_90's 227 KiB with cudaFuncSetAttribute."""
    assert module.probe("shared", 1, 48 * 1024) == [32 * 31 // 2]
    with pytest.raises(RuntimeError, match="probe launch failed: invalid argument"):
        module.probe("shared", 1, 48 * 1024 + 1)
    assert module.probe("shared_opt_in", 32, 100 * 1024, 100 * 1024) == [1] * 32
    with pytest.raises(RuntimeError, match="probe launch failed: invalid argument"):
        module.probe("shared_opt_in", 32, 100 * 1024 + 1, 100 * 1024)
    assert module.probe("shared_opt_in", 32, 227 * 1024, 227 * 1024) == [1] * 32
    with pytest.raises(RuntimeError, match="cudaFuncSetAttribute: invalid argument"):
        module.probe("shared_opt_in", 32, 0, 227 * 1024 + 1)


# Misuse a GPU hangs or corrupts on: the launch fails, naming the kernel, block, thread and cause.
MISUSE = {
    "mask_leaves_out_caller": r"thread 5 \(warp 0, lane 5\): __shfl_xor_sync at .*probes.cu:\d+ with mask "
    "0xffffffdf: the mask leaves out the calling lane 5",
    "lane_exits_before_shuffle": r"thread \d+ .*: __shfl_xor_sync at .*probes.cu:\d+ with mask 0xffffffff: "
    "lane 7 named in the mask (has exited|does not arrive: it exited)",
    "barrier_in_branch": r"thread \d+ .*: __syncthreads\(\) at .*probes.cu:\d+ is never reached by thread 40: "
    "it exited",
    "shuffle_reads_outside_mask": r"thread 0 .* with mask 0x0000ffff: reads lane 16, which the mask leaves out",
    "divergent_sites": r"thread \d+ .*: __shfl_xor_sync .*: lane \d+ named in the mask does not arrive: "
    r"it waits at __shfl_xor_sync at .*probes.cu:\d+",
    "mask_names_missing_lanes": r"thread 32 \(warp 1, lane 0\).*the mask names lanes the warp does not have",
}


@pytest.mark.parametrize("probe", sorted(MISUSE))
def test_misuse_fails_the_launch_naming_kernel_block_and_thread(probe):
    with pytest.raises(
        RuntimeError,
        match=rf"probe launch failed: nvfp4 CUDA host model: kernel .*{probe}, "
        rf"block \(0, 0, 0\), {MISUSE[probe]}",
    ):
        module.probe(probe, 64)
    assert module.probe("barrier_sum", 1, 1, 32) == [32 * 31 // 2]  # the next launch runs


def test_the_default_stream_fails_the_launch():
    with pytest.raises(RuntimeError, match=r"kernel .*barrier_sum: on the default stream; use the stream XLA passes"):
        module.probe("default_stream", 1)


def _e2m1_documented(x: float) -> int:
    """cvt.rn.satfinite.e2m1x2.f32 of one value, from cuda_fp4.h's description: round to nearest
    even, saturate to +-6 (max norm) keeping the sign, NaN -> +6, sign kept on zero results."""
    if np.isnan(x):
        return 0x7
    sign = 8 if np.signbit(x) else 0
    grid = [fractions.Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
    a = abs(x)
    if a >= 6:
        return sign | 7
    a = fractions.Fraction(a)
    best = min(range(8), key=lambda c: (abs(grid[c] - a), c % 2))  # nearest; a tie to the even code
    return sign | best


def test_e2m1_convert_equivalent_on_every_bfloat16():
    """Every bfloat16 value (as float32), in both halves of the byte."""
    x = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    codes = np.array([_e2m1_documented(float(v)) for v in x], np.uint8)
    got = np.frombuffer(module.cvt_rn_satfinite_e2m1x2(x, x[::-1].copy()), np.uint8)
    np.testing.assert_array_equal(got >> 4, codes)
    np.testing.assert_array_equal(got & 0xF, codes[::-1])


@given(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))
def test_e2m1_convert_equivalent_on_float32(v):
    x = np.array([v], np.float32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0], np.float32)
    for value in (x, ties):
        got = np.frombuffer(module.cvt_rn_satfinite_e2m1x2(value, -value), np.uint8)
        np.testing.assert_array_equal(got >> 4, [_e2m1_documented(float(a)) for a in value])
        np.testing.assert_array_equal(got & 0xF, [_e2m1_documented(float(-a)) for a in value])


def _f16_rz_documented(x: np.ndarray) -> np.ndarray:
    """cvt.rz.f16x2.f32 of each value: IEEE round toward zero, so an overflow gives the largest
    finite float16 and inf stays inf. From numpy's correctly rounded conversion to nearest: where
    that went away from zero, the float16 next to it toward zero."""
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = x.astype(np.float16)
        away = np.abs(nearest.astype(np.float64)) > np.abs(x.astype(np.float64))
    bits = nearest.view(np.uint16).copy()
    bits[away] -= 1  # sign and magnitude: one step toward zero
    return bits


def test_float16_truncation_equivalent():
    """Random float32 bit patterns of every exponent, the float16 boundaries and the specials; a
    NaN only needs to stay a NaN (the pair table reads any NaN the same)."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array(
        [0.0, -0.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 65504, 65519.99, 65520, 1e30, np.inf, -np.inf],
        np.float32,
    )
    x = np.concatenate([patterns.view(np.float32), edges, -edges, np.nextafter(edges, np.float32(0))])
    got = np.frombuffer(module.f16_rz(x), np.uint16)
    want = _f16_rz_documented(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


def _prmt_documented(a: int, b: int, sel: int) -> int:
    """prmt.b32 in its default mode (PTX ISA): result byte k is byte (sel >> 4k) & 7 of b:a, or with
    bit 3 of that selector nibble set, the sign bit of that byte replicated over the byte."""
    source = a | (b << 32)
    out = 0
    for k in range(4):
        s = (sel >> (4 * k)) & 0xF
        byte = (source >> (8 * (s & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << (8 * k)
    return out


def test_prmt_equivalent():
    """Random words under random selectors, the sign-replicating nibbles included."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32)
    for sel in [0x3210, 0x7654, 0xF1D0, 0xF3D2, 0x7351, 0x5410, *rng.integers(0, 1 << 16, 30).tolist()]:
        got = np.frombuffer(module.prmt(a.tobytes(), b.tobytes(), sel), np.uint32)
        want = [_prmt_documented(int(x), int(y), sel) for x, y in zip(a, b, strict=True)]
        np.testing.assert_array_equal(got, want)


def test_the_tests_run_the_cuda_kernels():
    """cuda_host's ops lower to the CUDA handlers' custom calls, not to the CPU kernels or the reference."""
    x = jnp.ones((32, 48), jnp.bfloat16)
    hlo = jax.jit(lambda x: cuda_host.dequantize(cuda_host.quantize(x, columnwise=True))).lower(x).as_text()
    for op in ("amax", "quantize", "dequantize"):
        assert f"{cuda_host.PREFIX}nvfp4_{op}" in hlo, op
    assert "nvfp4_quantize" in jax.jit(lambda x: jax_nvfp4.quantize(x).data).lower(x).as_text()


def test_sm100_path_differs_only_where_the_reference_overrides_it():
    """The convert keeps -0.0's sign and maps NaN to +6; float_to_e2m1 maps both to code 0 on sm_100a too."""
    x = np.array([[-0.0, np.nan, -1e-30, 0.1, -7.0, 5.0] + [1.0] * 10], np.float32)
    with cuda_host.emulating(100):
        got = jax.jit(lambda x: cuda_host.quantize(x, amax=jnp.float32(6.0)))(x)
    want = jax_nvfp4.quantize(x, amax=jnp.float32(6.0))
    np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
