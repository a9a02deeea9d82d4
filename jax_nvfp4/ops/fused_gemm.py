"""The ``"fused"`` GEMM: a Pallas kernel that reads packed NVFP4 operands and decodes them in its tiles.

For GPUs without FP4 tensor cores (Hopper). ``"emulated"`` writes a bf16 copy of each operand to memory
for XLA's dot to read back (XLA fuses a convert into its GEMM, not the block scale's multiply: checked
offline for sm_90 with jax 0.11.2); this kernel loads the E2M1 codes (4 bits a value) and their E4M3
scales, makes ``code * scale`` in registers and feeds a float16 dot with float32 accumulation, tile by tile,
then applies the GEMM's epilogue (the global decode scale, the cast) to its tile.

The decode is a few bit operations a value (``quarters``): a code's sign and magnitude bits moved to
float16's sign and exponent/mantissa bits give the E2M1 value times 2^-14 (0.5 as a float16 subnormal),
and one float16 multiply by the block scale makes ``code * scale * 2^-14``: exact, on float16's grid
(multiples of 2^-24 with at most 6 significant bits). float16 and not bfloat16 because these subnormals
are normal float32 numbers, which XLA's CPU (interpret mode) does not flush to zero. The dot's float32
products and sums are the emulation's times 2^-28 (a power of two: the same roundings), undone exactly in
the epilogue. The float32 sums equal the emulation's wherever they are exact; elsewhere they differ only
in the order of accumulation.

A variant (``c_transposed``) reads c packed along its rows instead, contracted along its other axis: a weight's
kept 16x16-block copy read as its transpose for dgrad, so that no transposed copy of its bytes is made. There a's
quarters (each holding contraction rows 8 apart) meet c's rows 8 apart, each decoded with its values put back in
order along the output's columns (``in_order``): the same eight dots a step.

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
    step along the contraction ``k_bytes`` (a multiple of 8: whole blocks of 16; compiled for a GPU, of 64:
    each of a step's eight dots then contracts at least 16 values, the float16 MMA's depth), and Triton's
    warps a tile."""

    m: int = 128
    n: int = 128
    k_bytes: int = 32
    num_warps: int = 4

    def __post_init__(self):
        if self.k_bytes % 8:
            raise ValueError(f"k_bytes must be a multiple of 8 (whole blocks of 16 values), got {self.k_bytes}")


TILES = Tiles(m=128, n=256, k_bytes=64, num_warps=8)
"""On a GPU: the blocking with the highest bound in ``benchmarks.fused_gemm_sass``'s static count for sm_90
(4.7 SASS instructions a decoded value: the loop can keep the tensor cores busy); not yet timed."""

INTERPRET_TILES = Tiles()
"""In interpret mode (tests on the CPU): smaller tiles, less padding of small operands. The tiles change no sum."""

BYTES_PER_SCALE = BLOCK // 2
WORDS_PER_SCALE = BYTES_PER_SCALE // 4  # uint32 words of codes a block scale covers
UNSCALE = 2.0**28
"""What the float32 sums are multiplied by before the global decode scale: each operand's values are 2^-14 times
the emulation's."""


def _e4m3_f16(byte: jax.Array) -> jax.Array:
    """E4M3 bytes (uint8) -> float16 values, exact; 0x7F and 0xFF are NaN.

    The byte's exponent and mantissa moved to float16's place (bias 15 against 7) are the value times 2^-8,
    subnormals included; one multiply by 256 corrects it. Paid once per 16 values.
    """
    b = byte.astype(jnp.uint16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    value = lax.bitcast_convert_type(bits, jnp.float16) * jnp.float16(256)
    return jnp.where((b & 0x7F) == 0x7F, jnp.float16(jnp.nan), value)


def quarters(words: jax.Array, scales: jax.Array) -> list[jax.Array]:
    """Packed codes as uint32 words [r, w] (8 codes a word, two blocks of 16 a pair of words) and their E4M3
    bytes [r, w / 2] -> 8 float16 arrays [r, w]: ``code * scale * 2^-14``; array 2j + h holds nibble j + 4h
    of each word.

    Nibbles j and j + 4 of a word sit 16 bits apart, as the two halves of a float16 pair do: one shift and
    mask place both magnitudes (E2M1's exponent and mantissa bits at float16's lowest exponent bits and top
    mantissa bit, which makes the value times 2^-14), one shift and mask both signs. Which nibble lands in
    which array is a permutation of the contraction, the same for both operands: it changes no product.
    """
    rows, nwords = words.shape
    scale = _e4m3_f16(scales)
    scale = jnp.broadcast_to(scale[:, :, None], (rows, nwords // WORDS_PER_SCALE, WORDS_PER_SCALE))
    scale = scale.reshape(rows, nwords)
    out = []
    for j in range(4):
        magnitudes = (words << (9 - 4 * j)) if j < 3 else (words >> 3)
        signs = words << (12 - 4 * j)
        pair = (magnitudes & jnp.uint32(0x0E000E00)) | (signs & jnp.uint32(0x80008000))
        for half in (pair & 0xFFFF, pair >> 16):
            out.append(lax.bitcast_convert_type(half.astype(jnp.uint16), jnp.float16) * scale)
    return out


def _kernel(a_ref, a_scale_ref, c_ref, c_scale_ref, scale_ref, out_ref, *, steps: int, tile_words: int):
    def step(k, acc):
        tile_scales = tile_words // WORDS_PER_SCALE
        words, scales = pl.ds(k * tile_words, tile_words), pl.ds(k * tile_scales, tile_scales)
        a = quarters(a_ref[:, words], a_scale_ref[:, scales])
        c = quarters(c_ref[:, words], c_scale_ref[:, scales])
        for x, y in zip(a, c, strict=True):
            acc = acc + lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))
    # The epilogue of ops.gemm in the kernel: each float32 sum (exactly 2^28 times smaller than the emulation's)
    # times 2^28, times the global decode scale, then the cast.
    out_ref[...] = (acc * UNSCALE * scale_ref[...]).astype(out_ref.dtype)


NIBBLE = tuple(p // 2 + 4 * (p % 2) for p in range(8))
"""The nibble of each word that ``quarters``'s array p holds."""


def in_order(quarters: list[jax.Array]) -> jax.Array:
    """``quarters``'s eight arrays [r, w] -> [r, 8 w], each word's values in their nibbles' order.

    Array 2j + h holds nibble j + 4h. Each join (``jnp.stack`` of two, on a new last axis: Triton's join, which
    moves no data) adds a lower bit of the nibble: (j, j + 4), then (j, j + 2) of those, then (0, 1), so the
    last three axes count the nibble in order and a reshape merges them with the word's axis."""
    pairs = [jnp.stack(quarters[2 * j : 2 * j + 2], axis=-1) for j in range(4)]  # nibbles j + 4 b0
    fours = [jnp.stack([pairs[j], pairs[j + 2]], axis=-1) for j in range(2)]  # nibbles j + 4 b0 + 2 b1
    eights = jnp.stack(fours, axis=-1)  # nibble 4 b0 + 2 b1 + b2
    rows, words = quarters[0].shape
    return eights.reshape(rows, 8 * words)


def _kernel_transposed(a_ref, a_scale_ref, c_ref, c_scale_ref, scale_ref, out_ref, *, steps: int, tile_words: int):
    """``_kernel`` with c packed along its rows (the output's columns) and contracted along its other axis.

    c's words come as [L / 8, 8, tile_n / 8] (row w, sub-row i: contraction row 8w + i) and its scales likewise.
    a's quarter p holds contraction rows 8w + NIBBLE[p]: it meets sub-row NIBBLE[p] of c's step, decoded with
    its values in order along the output's columns (``in_order``): eight float16 dots a step, as ``_kernel``'s.
    """

    def step(k, acc):
        tile_scales = tile_words // WORDS_PER_SCALE
        words, scales = pl.ds(k * tile_words, tile_words), pl.ds(k * tile_scales, tile_scales)
        for x, nibble in zip(quarters(a_ref[:, words], a_scale_ref[:, scales]), NIBBLE, strict=True):
            y = in_order(quarters(c_ref[words, nibble, :], c_scale_ref[words, nibble, :]))
            acc = acc + lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = (acc * UNSCALE * scale_ref[...]).astype(out_ref.dtype)


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    return jnp.pad(x, [(0, extra if i == axis else 0) for i in range(x.ndim)])


def words(x: jax.Array) -> jax.Array:
    """Bytes [..., Kb] -> uint32 words [..., Kb / 4] (little-endian: byte i at bits 8i..8i+7): the decode's input."""
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), jnp.uint32)


def row_groups(c: jax.Array, c_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """c packed along its rows, [B, 2 Kb, Nb] and [B, 2 Kb, Nb / 8], with its contraction rows in groups of 8 (one
    group a word of a's codes): words [B, Kb / 4, 8, Nb / 4] and scales [B, Kb / 4, 8, Nb / 8]."""
    batch, groups = c.shape[0], c.shape[1] // 8
    return words(c.reshape(batch, groups, 8, -1)), c_scale.reshape(batch, groups, 8, -1)


def _call(a, a_scale, c, c_scale, scale, *, out_dtype, interpret: bool, tiles: Tiles, transposed: bool):
    """Padded operands [B, M, Kb], [B, M, Kb / 8], c [B, N, Kb], [B, N, Kb / 8] (``transposed``: packed along its
    rows, [B, 2 Kb, N / 2], [B, 2 Kb, N / 16]) and scales [B, 1, 1] -> [B, M, N]."""
    batch, m, kb = a.shape
    tile_words = tiles.k_bytes // 4
    a_specs = [
        pl.BlockSpec((None, tiles.m, kb // 4), lambda b, i, j: (b, i, 0)),
        pl.BlockSpec((None, tiles.m, kb // BYTES_PER_SCALE), lambda b, i, j: (b, i, 0)),
    ]
    if transposed:
        n, kernel = 2 * c.shape[2], _kernel_transposed
        c, c_scale = row_groups(c, c_scale)
        c_specs = [
            pl.BlockSpec((None, kb // 4, 8, tiles.n // 8), lambda b, i, j: (b, 0, 0, j)),
            pl.BlockSpec((None, kb // 4, 8, tiles.n // 16), lambda b, i, j: (b, 0, 0, j)),
        ]
    else:
        n, kernel, c = c.shape[1], _kernel, words(c)
        c_specs = [
            pl.BlockSpec((None, tiles.n, kb // 4), lambda b, i, j: (b, j, 0)),
            pl.BlockSpec((None, tiles.n, kb // BYTES_PER_SCALE), lambda b, i, j: (b, j, 0)),
        ]
    return pl.pallas_call(
        functools.partial(kernel, steps=kb // tiles.k_bytes, tile_words=tile_words),
        grid=(batch, m // tiles.m, n // tiles.n),
        in_specs=[*a_specs, *c_specs, pl.BlockSpec((None, 1, 1), lambda b, i, j: (b, 0, 0))],
        out_specs=pl.BlockSpec((None, tiles.m, tiles.n), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
        interpret=interpret,
        compiler_params=compiler_params(tiles, interpret),
        name="nvfp4_fused_gemm" + ("_transposed" if transposed else ""),
    )(words(a), a_scale, c, c_scale, scale)


def compiler_params(tiles: Tiles, interpret: bool):
    """Triton's parameters for a GPU kernel of ``tiles`` (None interpreted)."""
    return None if interpret else plgpu.CompilerParams(num_warps=tiles.num_warps)


def tiles_for(tiles: Tiles | None, interpret: bool) -> Tiles:
    """``tiles``, or the default blocking (``TILES`` compiled, ``INTERPRET_TILES`` interpreted); compiled for a GPU
    its steps must be whole float16 MMAs."""
    t = tiles or (INTERPRET_TILES if interpret else TILES)
    if not interpret and t.k_bytes % 64:
        raise ValueError(f"compiled for a GPU, k_bytes must be a multiple of 64 (float16 MMAs), got {t.k_bytes}")
    return t


def on_platform(run, args: tuple, interpret: bool | None):
    """``run(*args, interpret=...)``: as asked, or compiled where lowered for a GPU (CUDA or ROCm) and interpreted
    elsewhere."""
    if interpret is not None:
        return run(*args, interpret=interpret)
    compiled, interpreted = (functools.partial(run, interpret=flag) for flag in (False, True))
    return lax.platform_dependent(*args, cuda=compiled, rocm=compiled, default=interpreted)


def transposed_operand(data: jax.Array, scale: jax.Array, length: int, tile_rows: int):
    """c packed along its rows: codes [B, L, ceil(rows / 2)] and E4M3 bytes [B, L, ceil(rows / 16)] -> the same,
    rows padded with zero codes and scales to whole tiles, L to ``length`` rows (zeros: exact zeros in the sums).
    A byte past an odd row count holds an output column past ``rows``, which is dropped."""
    data, scale = pad_to(data, 2, tile_rows // 2), pad_to(scale, 2, tile_rows // BLOCK)
    pad = [(0, 0), (0, length - data.shape[1]), (0, 0)]
    return jnp.pad(data, pad), jnp.pad(scale, pad)


def operand(data: jax.Array, scale: jax.Array, rows: int, length: int, tile_rows: int, tile_k: int):
    """Packed codes [B, *R, *L] and E4M3 bytes (``length`` values a row of the last L axis) -> [B, R', K'] each.

    The contracting axes merge into one, each row of ``length`` values padded with zero codes to whole
    blocks of 16 (a byte past an odd row's end has its high nibble zeroed); rows and contraction are padded
    with zeros to whole tiles. Zero codes add exact zeros to the sums.
    """
    batch = data.shape[0]
    if length % 2:
        data = data.at[..., -1].set(data[..., -1] & jnp.uint8(0x0F))
    data = pad_to(data, data.ndim - 1, -(-length // BLOCK) * BYTES_PER_SCALE)
    data, scale = data.reshape(batch, rows, -1), scale.reshape(batch, rows, -1)
    data, scale = pad_to(data, 1, tile_rows), pad_to(scale, 1, tile_rows)
    return pad_to(data, 2, tile_k), pad_to(scale, 2, tile_k // BYTES_PER_SCALE)


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
    c_transposed: bool = False,
    interpret: bool | None = None,
    tiles: Tiles | None = None,
) -> jax.Array:
    """fp32(sum * scale) cast to ``out_dtype`` for two packed NVFP4 operands -> [B, rows_a, rows_c].

    The sums run over the merged contracting axes: ``a_data`` [B, *R, *L] uint8 (``rows_a`` = prod(R)) and
    ``a_scale`` its E4M3 bytes (uint8), likewise ``c``; ``length`` values in each row of the last, packed axis.
    ``scale`` [B] float32: the global decode scale each sum is multiplied by, in the kernel, before the cast
    (so the float32 sums never go through memory). ``c_transposed``: c is packed along its rows instead,
    ``c_data`` [B, length, ceil(rows_c / 2)] and ``c_scale`` [B, length, ceil(rows_c / 16)] (a 16x16-block
    copy read as its transpose: a weight's for dgrad), contracted along its axis 1. ``interpret``: Pallas's
    interpret mode; by default the kernel is compiled where it is lowered for a GPU (CUDA or ROCm) and
    interpreted elsewhere. ``tiles``: the blocking (default: ``TILES`` compiled, ``INTERPRET_TILES``
    interpreted); it changes no result.
    """
    scale = jnp.asarray(scale, jnp.float32).reshape(-1, 1, 1)

    def run(a_data, a_scale, c_data, c_scale, scale, *, interpret: bool):
        t = tiles_for(tiles, interpret)
        a, sa = operand(a_data, a_scale, rows_a, length, t.m, t.k_bytes)
        if c_transposed:
            c, sc = transposed_operand(c_data, c_scale, 2 * a.shape[2], t.n)
        else:
            c, sc = operand(c_data, c_scale, rows_c, length, t.n, t.k_bytes)
        options = {"out_dtype": jnp.dtype(out_dtype), "interpret": interpret, "tiles": t, "transposed": c_transposed}
        return _call(a, sa, c, sc, scale, **options)[:, :rows_a, :rows_c]

    return on_platform(run, (a_data, a_scale, c_data, c_scale, scale), interpret)
