"""4over6 adaptive block scaling, in the pure-JAX reference (exact float32 on bit patterns).

Every block is quantized twice: "map-6" with the usual scale, which puts the
block's max on E2M1 6, and "map-4" with a 1.5x larger scale, which puts it on 4
so the values land on the finer lower part of the grid. The candidate with the
smaller error is kept, ties keep map-6. Numerics as ``tests/golden/README.md``:

- base = fp32(bamax / 6) * ges (not bamax * fp32(ges / 6) as without 4over6);
  s6 = E4M3(clamp(base, +-448)), s4 = E4M3(clamp(fp32(base * 1.5), +-448)). The
  clamp stays 448 whatever the spec's range E (which only changes ges and the divisor).
- Per element, with q the candidate's E2M1 value and s its decoded scale (q * s
  is exact: at most 8 significant bits, within [2^-10, 2688]):
  exact mode: d = fp32(fp32(q * s * amax) / fp32(6 E)) - x;
  fast_math:  d = q * s - fp32(x * ges). The kernel forms q * s in FP16, where
  every such product is exact too (normal or subnormal), so it is the exact
  product. Only a NaN scale differs (TransformerEngine's FP16 decode reads it as
  98304, here it is NaN); the choice is the same, since a NaN scale means a NaN
  in the block or in amax, so the block's fp32(x * ges) and its error are NaN.
- A 1x16 chunk's error is the fp32 sum of |d| ("mae") or d * d ("mse") over its
  16 elements, added one by one in element order. A NaN error on either side keeps map-6.
- 16x16 blocks: the 16 chunk errors are summed as a tree (r_i + r_{i+8}, then
  +4, +2, +1) and the choice is the whole block's. The columnwise copy is the
  quantization of x^T, whose chunks are x's columns: it picks on its own.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_nvfp4.core import bits as b
from jax_nvfp4.core.codecs import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode
from jax_nvfp4.core.spec import FOUR_OVER_SIX_ERRORS as ERROR_MODES

_F32_THREE_HALVES = 0x3FC00000
_F32_448 = 0x43E00000


def quantize_blocks(blocks: jnp.ndarray, g, mode: str, fast_math: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """4over6 E2M1 codes and E4M3 scales of bits [..., h, 16]: h = 1 for 1x16 chunks, 16 for 16x16 blocks.

    ``g`` is the ``reference.GlobalScales`` of the blocks, its fields broadcasting
    against the block axes [...] (one per tensor or one per row). Returns codes
    uint8 [..., h, 16] and scale codes uint8 [...].
    """
    if mode not in ERROR_MODES:
        raise ValueError(f"4over6 error mode must be one of {ERROR_MODES}, got {mode!r}")
    bamax = jnp.max(b.magnitude(blocks), axis=(-2, -1))  # NaN bits order above every number
    base = b.mul(b.div_by(bamax, 6.0), g.encode)
    # Both candidates at once, stacked on a leading axis: [map-6, map-4] (one traced graph, half the compile).
    scale = e4m3_encode(b.clamp_magnitude(jnp.stack([base, b.mul(base, _F32_THREE_HALVES)]), _F32_448))
    scale, enc = g.block_encode(scale)
    codes = e2m1_encode(b.mul(blocks, enc[..., None, None]))
    err = tree_sum(chunk_errors(blocks, codes, scale, g, mode, fast_math))
    map4 = less(err[1], err[0])
    return jnp.where(map4[..., None, None], codes[1], codes[0]), jnp.where(map4, scale[1], scale[0])


def chunk_errors(blocks, codes, scale, g, mode: str, fast_math: bool) -> jnp.ndarray:
    """Error bits [..., h] of candidates (codes, scale): the sequential fp32 sum over the last axis (16 elements).

    ``g.amax`` (exact mode) and ``g.encode`` (fast_math) broadcast against ``scale``; ``g.divisor`` is 6 E (a float).
    """
    expand = (..., None, None)
    qs = b.mul(e2m1_decode(codes), e4m3_decode(scale)[expand])  # exact
    if fast_math:
        d = b.add(qs, b.mul(blocks, g.encode[expand]) ^ b.SIGN)
    else:
        value = b.div_by(b.mul(qs, g.amax[expand]), g.divisor)
        d = b.add(value, blocks ^ b.SIGN)
    return sequential_sum(b.magnitude(d) if mode == "mae" else b.mul(d, d))


def sequential_sum(e: jnp.ndarray) -> jnp.ndarray:
    """fp32 sum over the last axis, element by element in order (0 + e_0 == e_0: no error is -0)."""
    # A scan, not unrolled adds: the same sums, a smaller program to compile.
    e = jnp.moveaxis(e, -1, 0)
    return lax.scan(lambda acc, ei: (b.add(acc, ei), None), e[0], e[1:])[0]


def tree_sum(err: jnp.ndarray) -> jnp.ndarray:
    """fp32 sum over the last axis (a power of two) as a tree: halves added pairwise, r_i + r_{i+n/2}."""
    while err.shape[-1] > 1:
        half = err.shape[-1] // 2
        err = b.add(err[..., :half], err[..., half:])
    return err[..., 0]


def less(a: jnp.ndarray, c: jnp.ndarray) -> jnp.ndarray:
    """a < c for non-negative float32 bits (errors); False where either is NaN."""
    return (a < c) & ~b.is_nan(a) & ~b.is_nan(c)
