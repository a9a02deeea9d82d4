"""The ``"fused"`` GEMM: a Pallas kernel that reads packed NVFP4 operands and decodes them in its tiles.

For GPUs without FP4 tensor cores (Hopper). ``"emulated"`` writes a bf16 copy of each operand to memory
for XLA's dot to read back (XLA fuses a convert into its GEMM, not the block scale's multiply: checked
offline for sm_90 with jax 0.11.2); this kernel loads the E2M1 codes (4 bits a value) and their E4M3
scales, makes ``code * scale`` in registers (exact in bfloat16, as ``block_values``), and feeds a
bf16 dot with float32 accumulation, tile by tile, then applies the GEMM's epilogue (the global decode
scale, the cast) to its tile. The float32 sums equal the emulation's wherever they are exact; elsewhere
they differ only in the order of accumulation.

The kernel uses Pallas's generic operations only: on a GPU it lowers through Triton; elsewhere (the CPU)
it runs in Pallas's interpret mode, which is how CI tests it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_nvfp4.core.formats import BLOCK


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernel's blocking: output tile rows ``m`` and columns ``n``, packed bytes (two values each) of one
    step along the contraction ``k_bytes`` (a multiple of 8: whole blocks of 16), and Triton's warps a tile."""

    m: int = 128
    n: int = 128
    k_bytes: int = 32
    num_warps: int = 4


TILES = Tiles(m=128, n=256, k_bytes=32, num_warps=8)
"""On a GPU: the blocking with the highest bound in ``benchmarks.fused_gemm_sass``'s static count for sm_90 (42% of
the bf16 tensor peak, against 30% for 128 x 128 with 4 warps); not yet timed."""

INTERPRET_TILES = Tiles()
"""In interpret mode (tests on the CPU): smaller tiles, less padding of small operands. The tiles change no sum."""

_BYTES_PER_SCALE = BLOCK // 2


_TWICE_E2M1 = 0xC8643210
"""Twice the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, four bits each (magnitude code m at bits 4m..4m+3)."""


def _e4m3(byte: jax.Array) -> jax.Array:
    """E4M3 bytes (uint32, 0..255) -> float32 values; 0x7F and 0xFF are NaN."""
    exponent, mantissa = (byte >> 3) & 0xF, (byte & 7).astype(jnp.float32)
    power = lax.bitcast_convert_type((jnp.maximum(exponent, 1) + 120) << 23, jnp.float32)  # 2^(e - 7)
    value = jnp.where(exponent == 0, mantissa * 2.0**-9, power * (1.0 + 0.125 * mantissa))
    value = jnp.where((byte & 0x7F) == 0x7F, jnp.nan, value)
    return jnp.where((byte & 0x80) != 0, -value, value)


def _decode(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """Packed codes [r, k] and E4M3 bytes [r, k / 8] -> bf16 values [r, 2 k] (element 2i in byte i's low nibble).

    Per value, a few integer operations: the magnitude's double from a table held in one 32-bit constant, times
    half the block scale (exact in float32), the code's sign bit flipped into the product's, and the cast to
    bf16 (exact: at most 6 significant bits). The scale's decode is paid once per 16 values.
    """
    rows, nbytes = codes.shape
    codes = codes.astype(jnp.uint32)
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(rows, 2 * nbytes)
    half_scale = 0.5 * _e4m3(scales.astype(jnp.uint32))
    half_scale = jnp.broadcast_to(half_scale[:, :, None], (rows, nbytes // _BYTES_PER_SCALE, BLOCK))
    twice = (jnp.uint32(_TWICE_E2M1) >> ((nibbles & 7) << 2)) & 0xF
    product = twice.astype(jnp.float32) * half_scale.reshape(rows, 2 * nbytes)
    signed = lax.bitcast_convert_type(product, jnp.uint32) ^ ((nibbles & 8) << 28)
    return lax.bitcast_convert_type(signed, jnp.float32).astype(jnp.bfloat16)


def _kernel(a_ref, a_scale_ref, c_ref, c_scale_ref, scale_ref, out_ref, *, steps: int, tile_k: int):
    def step(k, acc):
        at, ct = pl.ds(k * tile_k, tile_k), pl.ds(k * (tile_k // _BYTES_PER_SCALE), tile_k // _BYTES_PER_SCALE)
        a = _decode(a_ref[:, at], a_scale_ref[:, ct])
        c = _decode(c_ref[:, at], c_scale_ref[:, ct])
        return acc + lax.dot_general(a, c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))
    # The epilogue of ops.gemm in the kernel: each float32 sum times the global decode scale, then the cast.
    out_ref[...] = (acc * scale_ref[...]).astype(out_ref.dtype)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    return jnp.pad(x, [(0, extra if i == axis else 0) for i in range(x.ndim)])


def _call(a, a_scale, c, c_scale, scale, *, out_dtype, interpret: bool, tiles: Tiles):
    """Padded operands [B, M, Kb], [B, M, Kb / 8], [B, N, Kb], [B, N, Kb / 8] and scales [B, 1, 1] -> [B, M, N]."""
    batch, m, kb = a.shape
    n = c.shape[1]
    kernel = functools.partial(_kernel, steps=kb // tiles.k_bytes, tile_k=tiles.k_bytes)

    def spec(rows, cols, which):
        return pl.BlockSpec((None, rows, cols), lambda b, i, j: (b, (i, j)[which], 0))

    scale_cols = kb // _BYTES_PER_SCALE
    a_specs = [spec(tiles.m, kb, 0), spec(tiles.m, scale_cols, 0)]
    c_specs = [spec(tiles.n, kb, 1), spec(tiles.n, scale_cols, 1)]
    return pl.pallas_call(
        kernel,
        grid=(batch, m // tiles.m, n // tiles.n),
        in_specs=[*a_specs, *c_specs, pl.BlockSpec((None, 1, 1), lambda b, i, j: (b, 0, 0))],
        out_specs=pl.BlockSpec((None, tiles.m, tiles.n), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps),
        name="nvfp4_fused_gemm",
    )(a, a_scale, c, c_scale, scale)


def _operand(data: jax.Array, scale: jax.Array, rows: int, length: int, tile_rows: int, tile_k: int):
    """Packed codes [B, *R, *L] and E4M3 bytes (``length`` values a row of the last L axis) -> [B, R', K'] each.

    The contracting axes merge into one, each row of ``length`` values padded with zero codes to whole
    blocks of 16 (a byte past an odd row's end has its high nibble zeroed); rows and contraction are padded
    with zeros to whole tiles. Zero codes add exact zeros to the sums.
    """
    batch = data.shape[0]
    if length % 2:
        data = data.at[..., -1].set(data[..., -1] & jnp.uint8(0x0F))
    data = _pad_to(data, data.ndim - 1, -(-length // BLOCK) * _BYTES_PER_SCALE)
    data, scale = data.reshape(batch, rows, -1), scale.reshape(batch, rows, -1)
    data, scale = _pad_to(data, 1, tile_rows), _pad_to(scale, 1, tile_rows)
    return _pad_to(data, 2, tile_k), _pad_to(scale, 2, tile_k // _BYTES_PER_SCALE)


def fused_gemm(
    a_data,
    a_scale,
    c_data,
    c_scale,
    scale,
    *,
    rows_a: int,
    rows_c: int,
    length: int,
    out_dtype,
    interpret: bool | None = None,
    tiles: Tiles | None = None,
) -> jax.Array:
    """fp32(sum * scale) cast to ``out_dtype`` for two packed NVFP4 operands -> [B, rows_a, rows_c].

    The sums run over the merged contracting axes: ``a_data`` [B, *R, *L] uint8 (``rows_a`` = prod(R)) and
    ``a_scale`` its E4M3 bytes (uint8), likewise ``c``; ``length`` values in each row of the last, packed axis.
    ``scale`` [B] float32: the global decode scale each sum is multiplied by, in the kernel, before the cast
    (so the float32 sums never go through memory). ``interpret``: Pallas's interpret mode; by default the
    kernel is compiled where it is lowered for a GPU (CUDA or ROCm) and interpreted elsewhere. ``tiles``:
    the blocking (default: ``TILES`` compiled, ``INTERPRET_TILES`` interpreted); it changes no result.
    """
    scale = jnp.asarray(scale, jnp.float32).reshape(-1, 1, 1)

    def run(a_data, a_scale, c_data, c_scale, scale, *, interpret: bool):
        t = tiles or (INTERPRET_TILES if interpret else TILES)
        a, sa = _operand(a_data, a_scale, rows_a, length, t.m, t.k_bytes)
        c, sc = _operand(c_data, c_scale, rows_c, length, t.n, t.k_bytes)
        y = _call(a, sa, c, sc, scale, out_dtype=jnp.dtype(out_dtype), interpret=interpret, tiles=t)
        return y[:, :rows_a, :rows_c]

    args = (a_data, a_scale, c_data, c_scale, scale)
    if interpret is not None:
        return run(*args, interpret=interpret)
    compiled, interpreted = (functools.partial(run, interpret=flag) for flag in (False, True))
    return lax.platform_dependent(*args, cuda=compiled, rocm=compiled, default=interpreted)
