"""The pure-JAX NVFP4 reference's three core ops on canonical [B, R, C] arrays: the executable spec.

The primitives lower to these where no kernel exists, and the C++ and CUDA
kernels must give the same bytes. ``jax_nvfp4.reference`` puts the public
signatures on top. It follows
``tests/golden/README.md`` (TransformerEngine's reference quantizer) step by
step, in exact float32 arithmetic on bit patterns (see ``core.bits``), so it does
not depend on how a backend treats subnormals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_nvfp4.core import bits as b
from jax_nvfp4.core.autodiff import without_derivative
from jax_nvfp4.core.backend import Backend, amax_on_rows, quantize_on_rows
from jax_nvfp4.core.codecs import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode
from jax_nvfp4.core.formats import BLOCK, RHT_SIGNS
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.reference import four_over_six as _fos
from jax_nvfp4.reference.stochastic import e2m1_encode_stochastic, random_bytes

# float32 bit patterns of the constants the spec uses.
_F32_ONE_SIXTH = int(np.float32(1.0 / 6.0).view(np.uint32))
_F32_ONE = 0x3F800000
_F32_448 = 0x43E00000


def rht_columns(u: jnp.ndarray, dtype) -> jnp.ndarray:
    """The Random Hadamard Transform of x^T: bits [B, R, C] (R a multiple of 16) -> bits [B, C, R].

    Each chunk of 16 rows of a column is multiplied by the fixed signs, then by
    H16 in four butterfly stages of exact float32 adds (pairs 1, 2, 4 and 8
    apart), then by 1/4, and rounded once to the input ``dtype``. For bf16
    input the butterflies are exact unless a chunk spans more than 12 binades,
    so the result is the exact transform rounded once (TransformerEngine's).
    """
    bsz, rows, cols = u.shape
    chunks = jnp.swapaxes(u, 1, 2).reshape(bsz, cols, rows // BLOCK, BLOCK)
    flip = np.array([0 if s > 0 else 0x80000000 for s in RHT_SIGNS], np.uint32)
    v = chunks ^ flip
    for h in (1, 2, 4, 8):
        pairs = v.reshape(*v.shape[:-1], BLOCK // (2 * h), 2, h)
        lo, hi = pairs[..., 0, :], pairs[..., 1, :]
        v = jnp.stack([b.add(lo, hi), b.add(lo, hi ^ b.SIGN)], axis=-2).reshape(chunks.shape)
    v = b.mul(v, 0x3E800000)  # * 0.25
    if dtype == jnp.bfloat16:
        v = b.to_bits(b.f32_to_bf16(v))
    elif dtype == jnp.float16:
        v = b.to_bits(b.f32_to_f16(v))
    return v.reshape(bsz, cols, rows)


def _six_times(e4m3_max: int) -> int:
    """float32 bits of 6 * e4m3_max: the global encode scale's numerator and the dequantize divisor."""
    return int(np.float32(6 * e4m3_max).view(np.uint32))


class GlobalScales:
    """Global scales from amax bits: one per tensor ([B, 1, 1]) or per row (row-scaled, [B, R, 1]).

    Shaped to broadcast against the block amaxes [B, R, blocks]. ``e4m3_max`` (E,
    448 or 256 with 4over6) is the block-scale range the global scale aims at:
    ges = fp32(6 E) / amax; the blocks' clamp stays 448.
    """

    def __init__(self, amax_bits: jnp.ndarray, e4m3_max: int = 448):
        self.amax = amax_bits
        self.divisor = 6.0 * e4m3_max  # exact in float32
        ges = b.minimum(b.div(_six_times(e4m3_max), amax_bits), b.FLT_MAX)
        self.encode = jnp.where(ges == 0, b.u32(_F32_ONE), ges)  # only when amax is inf
        self.encode_div6 = b.mul(self.encode, _F32_ONE_SIXTH)
        self.decode = b.div(_F32_ONE, self.encode)
        # Computed once, then read: without this barrier and block_encode's, XLA's CPU compiler copies the
        # integer division chains into each fusion that reads a scale (a 1x16 quantize's optimized program:
        # 8332 lines without them, 4111 with them; XLA's compile time falls more than half).
        self.encode, self.encode_div6, self.decode = lax.optimization_barrier(
            (self.encode, self.encode_div6, self.decode)
        )

    def block_encode(self, scale: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(scale, encode scales as bits) of E4M3 block scale codes shaped like the block amaxes: both computed
        once a block, behind a barrier (see above), for the codes and the scale output to read."""
        return lax.optimization_barrier((scale, block_encode_scale(scale, self.decode)))


def dequantize_scale(amax_bits: jnp.ndarray, e4m3_max: int = 448) -> jnp.ndarray:
    """Global decode scale of dequantization and of the GEMM: amax / (6 * e4m3_max), as bits.

    The reference GEMM's scale; unlike the quantizer's 1 / ges it stays inf for an
    infinite amax, so a tensor that held inf never dequantizes to finite values.
    """
    return b.div_by(amax_bits, 6.0 * e4m3_max)


def block_scale(block_amax: jnp.ndarray, g_encode_div6: jnp.ndarray) -> jnp.ndarray:
    """E4M3 decode scale of blocks from their max magnitude (bits)."""
    s = b.minimum(b.mul(block_amax, g_encode_div6), b.FLT_MAX)
    return e4m3_encode(b.clamp_magnitude(s, _F32_448))


def block_encode_scale(scale: jnp.ndarray, g_decode: jnp.ndarray) -> jnp.ndarray:
    """min(1 / (s * gds), FLT_MAX) as bits."""
    enc = b.div(_F32_ONE, b.mul(e4m3_decode(scale), g_decode))
    return b.minimum(enc, b.FLT_MAX)


def _pad_to(u: jnp.ndarray, axis: int, multiple: int) -> jnp.ndarray:
    extra = -u.shape[axis] % multiple
    if extra == 0:
        return u
    widths = [(0, 0)] * u.ndim
    widths[axis] = (0, extra)
    return jnp.pad(u, widths)


def pack(codes: jnp.ndarray, cols: int) -> jnp.ndarray:
    """Pack codes [..., >=cols] into bytes, element 2i in the low nibble."""
    codes = _pad_to(codes[..., :cols], -1, 2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def as_e4m3(codes: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)


def max_magnitude_bits(u: jnp.ndarray, axes) -> jnp.ndarray:
    return b.canonical_nan(jnp.max(b.magnitude(u), axis=axes))


def _encode(v: jnp.ndarray, seed: jnp.ndarray | None, stream: int) -> jnp.ndarray:
    """E2M1 codes of scaled bits [B, R, whole blocks]: round to nearest even, or stochastically with ``seed``."""
    if seed is None:
        return e2m1_encode(v)
    return e2m1_encode_stochastic(v, random_bytes(seed, v.shape, stream))


def quantize_1d(u: jnp.ndarray, g: GlobalScales, seed=None, stream: int = 0, fos: tuple[str, bool] | None = None):
    """Rowwise 1x16 quantization of bits [B, R, C] -> (data, scale); ``fos``: 4over6 (mode, fast_math)."""
    bsz, rows, cols = u.shape
    blocks = _pad_to(u, 2, BLOCK).reshape(bsz, rows, -1, BLOCK)
    if fos is not None:
        codes, scale = _fos.quantize_blocks(blocks[..., None, :], g, *fos)
        return pack(codes.reshape(bsz, rows, -1), cols), scale
    scale = block_scale(max_magnitude_bits(blocks, -1), g.encode_div6)
    scale, enc = g.block_encode(scale)
    codes = _encode(b.mul(blocks, enc[..., None]).reshape(bsz, rows, -1), seed, stream)
    return pack(codes, cols), scale


def _tiles_4over6(padded: jnp.ndarray, g: GlobalScales, fos: tuple[str, bool]):
    """4over6 16x16 quantization of padded bits [B, R, C] and of their transpose, which picks on its own.

    -> codes [B, R, C], scale [B, R/16, C/16], codes_t [B, C, R], scale_t [B, C/16, R/16].
    """
    bsz, rows, cols = padded.shape
    tiles = jnp.swapaxes(padded.reshape(bsz, rows // BLOCK, BLOCK, -1, BLOCK), 2, 3)  # [B, R/16, C/16, 16, 16]
    # x^T's block (j, i) is x's block (i, j) transposed: both copies in one call.
    codes, scale = _fos.quantize_blocks(jnp.stack([tiles, jnp.swapaxes(tiles, -1, -2)]), g, *fos)
    codes_t = jnp.transpose(codes[1], (0, 2, 3, 1, 4)).reshape(bsz, cols, rows)
    return jnp.swapaxes(codes[0], 2, 3).reshape(padded.shape), scale[0], codes_t, jnp.swapaxes(scale[1], 1, 2)


def _quantize_2d(u: jnp.ndarray, g: GlobalScales, seed=None, fos: tuple[str, bool] | None = None):
    """16x16 quantization of bits [B, R, C] -> (data, scale, data_t, scale_t).

    Both copies are one quantization (data_t is data transposed), so stochastic
    rounding draws once per element, from the rowwise stream. Not with 4over6:
    the columnwise copy is the quantization of x^T, whose error sums run in the
    other order, so a near tie may pick the other candidate for a block."""
    bsz, rows, cols = u.shape
    padded = _pad_to(_pad_to(u, 1, BLOCK), 2, BLOCK)
    if fos is not None:
        codes, scale, codes_t, scale_t = _tiles_4over6(padded, g, fos)
    else:
        tiles = padded.reshape(bsz, padded.shape[1] // BLOCK, BLOCK, -1, BLOCK)
        scale = block_scale(max_magnitude_bits(tiles, (2, 4)), g.encode_div6)
        scale, enc = g.block_encode(scale)
        codes = _encode(b.mul(tiles, enc[:, :, None, :, None]).reshape(padded.shape), seed, 0)
        codes_t, scale_t = jnp.swapaxes(codes, 1, 2), jnp.swapaxes(scale, 1, 2)
    row_scale = jnp.repeat(scale, BLOCK, axis=1)[:, :rows]
    col_scale = jnp.repeat(scale_t, BLOCK, axis=1)[:, :cols]
    return pack(codes[:, :rows], cols), row_scale, pack(codes_t[:, :cols], rows), col_scale


# ---- the three core ops on canonical [B, R, C] arrays (the kernels' contract) ----


def amax_core(x: jnp.ndarray, *, rht_amax: bool = False, per_row: bool = False) -> tuple[jnp.ndarray, ...]:
    """Global amax per batch entry: [B, R, C] -> (float32 [B],), NaN canonical; with ``rht_amax`` also the amax
    of the Random Hadamard Transform of x^T (R a multiple of 16).

    ``per_row``: the per-row amaxes of both copies instead, (float32 [B, R], float32 [B, C]): of the
    rows of x and of the rows of x^T (of its transform with ``rht_amax``)."""
    u = b.to_bits(x)
    if per_row:
        u_t = rht_columns(u, x.dtype) if rht_amax else jnp.swapaxes(u, 1, 2)
        return b.from_bits(max_magnitude_bits(u, 2)), b.from_bits(max_magnitude_bits(u_t, 2))
    amax = b.from_bits(max_magnitude_bits(u, (1, 2)))
    if not rht_amax:
        return (amax,)
    return amax, b.from_bits(max_magnitude_bits(rht_columns(u, x.dtype), (1, 2)))


def global_scales(amax: jnp.ndarray, e4m3_max: int) -> GlobalScales:
    """GlobalScales of amaxes [B] or per row [B, R], shaped [B, 1, 1] / [B, R, 1] for the blocks."""
    bits = b.to_bits(amax.astype(jnp.float32))
    return GlobalScales(bits.reshape(*bits.shape, *(1,) * (3 - bits.ndim)), e4m3_max)


def quantize_core(x, amax, amax_t, seed, *, spec: QuantizeSpec):
    """[B, R, C] input, [B] amaxes, seed -> (data, scale) if rowwise + (data_t, scale_t) if columnwise.

    ``amax`` scales the rowwise copy (and 16x16 blocks), ``amax_t`` the columnwise
    1x16 copy, which with ``spec.rht`` is the quantization of the transform of x^T.
    Stochastic rounding draws from ``seed``: uint32 [2], or [4 + R] with the copy's place in a whole tensor
    (``reference.stochastic.split_seed``). Row-scaled (1x16 only): ``amax``
    is per row of x, [B, R], and ``amax_t`` per row of x^T, [B, C] (``amax_core(...,
    per_row=True)``); each row has its own global scales. 4over6 follows
    ``reference.four_over_six``; E = ``spec.e4m3_max`` sets the global scales.
    """
    rowwise, columnwise = spec.rowwise, spec.columnwise
    spec.check_amaxes(x.shape, amax.shape, amax_t.shape)
    u = b.to_bits(x)
    g = global_scales(amax, spec.e4m3_max)
    seed = seed if spec.draws_random else None
    fos = spec.four_over_six_choice
    if spec.block_2d:
        data, scale, data_t, scale_t = _quantize_2d(u, g, seed, fos)
        copies = [(data, scale)] * rowwise + [(data_t, scale_t)] * columnwise
    else:
        copies = [quantize_1d(u, g, seed, 0, fos)] if rowwise else []
        if columnwise:
            u_t = rht_columns(u, x.dtype) if spec.rht else jnp.swapaxes(u, 1, 2)
            copies.append(quantize_1d(u_t, global_scales(amax_t, spec.e4m3_max), seed, 1, fos))
    return tuple(out for data, scale in copies for out in (data, as_e4m3(scale)))


def dequantize_core(data, scale, amax, *, cols: int, dtype, e4m3_max: int = 448) -> jnp.ndarray:
    """Packed [B, R, ceil(C/2)] codes and [B, R, ceil(C/16)] scales -> [B, R, C] values.

    value = fp32(E2M1 * scale) * (amax / (6 * e4m3_max)), with ``amax`` [B] or per row [B, R] (row-scaled).
    """
    codes = jnp.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:2], -1)[..., :cols]
    scales = jnp.repeat(lax.bitcast_convert_type(scale, jnp.uint8), BLOCK, axis=-1)[..., :cols]
    gds = dequantize_scale(b.to_bits(amax.astype(jnp.float32)), e4m3_max)
    gds = gds.reshape(*gds.shape, *(1,) * (3 - gds.ndim))
    # b.mul makes any NaN canonical.
    value = b.mul(b.mul(e2m1_decode(codes), e4m3_decode(scales)), gds)
    if dtype == jnp.bfloat16:
        return b.f32_to_bf16(value)
    if dtype == jnp.float16:
        return b.f32_to_f16(value)
    return b.from_bits(value)


def _amax(x, *, amax_mesh_axes, rht_amax, per_row):
    del amax_mesh_axes  # the reference's amax is always that of the whole array
    return amax_core(x, rht_amax=rht_amax, per_row=per_row)


# Jitted so that eager calls run as one compiled program, not op by op; differentiated, each raises the
# kernels' error (core.autodiff) rather than give the zero gradient of its integer arithmetic. The guard is
# inside the jit, so an eager call pays for it once, when the jit traces.
REFERENCE = Backend(
    amax=amax_on_rows(
        jax.jit(without_derivative("nvfp4_amax", _amax), static_argnames=("amax_mesh_axes", "rht_amax", "per_row"))
    ),
    quantize=quantize_on_rows(jax.jit(without_derivative("nvfp4_quantize", quantize_core), static_argnames="spec")),
    dequantize=jax.jit(
        without_derivative("nvfp4_dequantize", dequantize_core), static_argnames=("cols", "dtype", "e4m3_max")
    ),
)
