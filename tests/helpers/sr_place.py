"""A shard's stochastic rounding: the seed operand that tells a backend's quantize where its slice of x sits in the
whole tensor (the key, the first batch entry and column, the rows' indices: ``reference.stochastic.Place``), built
here apart from the library's ``ops.partition.placed_seed``, and the parts of the whole tensor's copies that the
slice must reproduce byte for byte."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from jax_nvfp4 import QuantizeSpec

from .core import assert_same_bytes, random_normal

KEY = np.array([0x243F6A88, 0x85A308D3], np.uint32)

# Stochastic rounding with each copy layout that draws from it: 1x16 both copies, the RHT's columnwise copy,
# 16x16 blocks, per-row global scales.
SPECS = {
    "1x16": QuantizeSpec(columnwise=True, stochastic_rounding=True),
    "rht": QuantizeSpec(columnwise=True, rht=True, stochastic_rounding=True),
    "16x16": QuantizeSpec(columnwise=True, block_2d=True, stochastic_rounding=True),
    "row_scaled": QuantizeSpec(columnwise=True, row_scaled=True, stochastic_rounding=True),
}


@st.composite
def shards(draw):
    """(shape [B, *R, N], start, stop): a tensor of one or two row axes and a slice of it whose last row axis and
    columns are cut at whole blocks of 16 (as the partitioner cuts them), the other axes anywhere."""
    rows = [draw(st.integers(1, 4))] * draw(st.booleans()) + [16 * draw(st.integers(1, 3))]
    shape = (draw(st.integers(1, 3)), *rows, 16 * draw(st.integers(1, 4)))
    start, stop = [], []
    for i, size in enumerate(shape):
        unit = 16 if i >= len(shape) - 2 else 1
        lo = unit * draw(st.integers(0, size // unit - 1))
        start.append(lo)
        stop.append(lo + unit * draw(st.integers(1, (size - lo) // unit)))
    return shape, tuple(start), tuple(stop)


def placed_seed(shape, start, stop) -> np.ndarray:
    """KEY, the slice's first batch entry and column, and the flat (row-major) index of each of its rows."""
    grid = np.meshgrid(*[np.arange(a, b) for a, b in zip(start[1:-1], stop[1:-1], strict=True)], indexing="ij")
    rows = np.ravel_multi_index(tuple(grid), shape[1:-1]).ravel()
    return np.concatenate([KEY, [start[0], start[-1]], rows]).astype(np.uint32)


def _slice(start, stop, dims) -> tuple[slice, ...]:
    return tuple(slice(start[d], stop[d]) for d in dims)


def shard_parts(outs, start, stop) -> list:
    """The parts of the whole tensor's copies (data, scale, data_t, scale_t) that the slice start:stop makes:
    rowwise [B, *R, N/2], [B, *R, N/16]; columnwise [B, N, *R[:-1], M/2], [B, N, *R[:-1], M/16] (M = R[-1])."""
    data, scale, data_t, scale_t = outs
    nd = len(start)
    rows = _slice(start, stop, range(nd - 1))  # B and every row axis
    head = (slice(start[0], stop[0]), *_slice(start, stop, [nd - 1, *range(1, nd - 2)]))  # B, N, R[:-1]
    n0, n1, m0, m1 = start[-1], stop[-1], start[-2], stop[-2]
    return [
        data[(*rows, slice(n0 // 2, n1 // 2))],
        scale[(*rows, slice(n0 // 16, n1 // 16))],
        data_t[(*head, slice(m0 // 2, m1 // 2))],
        scale_t[(*head, slice(m0 // 16, m1 // 16))],
    ]


def assert_shard_draws_the_whole(quantize, spec: QuantizeSpec, shape, start, stop, dtype=jnp.bfloat16):
    """``quantize`` (a backend's, [B, *R, N]; both copies) of the slice start:stop with its placed seed gives the
    bytes that the whole tensor's quantization has there."""
    x = random_normal(shape, sum(shape), dtype)
    mag = jnp.abs(x.astype(jnp.float32))
    sl = _slice(start, stop, range(len(shape)))
    if spec.row_scaled:  # per row of x [B, *R] and of x^T [B, N]
        amax, amax_t = mag.max(-1), mag.reshape(shape[0], -1, shape[-1]).max(1)
        amax_s, amax_t_s = amax[sl[:-1]], amax_t[(sl[0], sl[-1])]
    else:
        amax = amax_t = mag.reshape(shape[0], -1).max(-1)
        amax_s = amax_t_s = amax[sl[0]]
    whole = [np.asarray(o) for o in quantize(x, amax, amax_t, jnp.asarray(KEY), spec=spec)]
    got = quantize(x[sl], amax_s, amax_t_s, jnp.asarray(placed_seed(shape, start, stop)), spec=spec)
    for i, (g, w) in enumerate(zip(got, shard_parts(whole, start, stop), strict=True)):
        assert_same_bytes(g, w, f"output {i} of the shard {start}:{stop} of {shape}")
