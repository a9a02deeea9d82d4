"""NVFP4 format constants: E2M1 values, E4M3 block scales, 16-value blocks."""

import jax.numpy as jnp

BLOCK = 16
"""Values per 1D block, and the side of a 2D block."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
"""High-precision dtypes that can be quantized and that dequantize can produce."""


def packed_size(n: int) -> int:
    """Bytes holding n E2M1 codes (two a byte; an odd n keeps its last code)."""
    return (n + 1) // 2


def num_blocks(n: int) -> int:
    """1x16 blocks covering n values (the last one zero-padded)."""
    return -(-n // BLOCK)


RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""The fixed random sign vector of the 16-point Random Hadamard Transform (TransformerEngine's): the transform
of a 16-value chunk v is y = (v * signs) @ H16 / 4, H16 the Sylvester Hadamard matrix."""
