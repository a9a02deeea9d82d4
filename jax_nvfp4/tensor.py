"""The NVFP4 tensor: packed E2M1 codes, E4M3 block scales, FP32 global amax (one per tensor or per row)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor of logical shape ``shape`` = [..., N]; M = prod(shape[:-1]).

    Arrays (``None`` where a copy was not requested):
      data    uint8 [..., ceil(N/2)]: rowwise E2M1 codes, element 2i in the low nibble.
      scale   float8_e4m3fn [..., ceil(N/16)]: decode scale of each 1x16 block
              (16x16 blocks: the block's scale repeated on each of its rows).
      amax    float32 []: global amax the scales were computed from;
              row-scaled: float32 [...] (``shape[:-1]``), the amax of each row.
      data_t  uint8 [N, ceil(M/2)]: the columnwise copy, the quantization of x^T.
      scale_t float8_e4m3fn [N, ceil(M/16)].
      amax_t  float32 [] (the columnwise copy's amax); row-scaled: float32 [N],
              the amax of each row of x^T (column of x, of its transform with ``rht``).
    Static metadata: ``shape``, ``dtype`` (of the quantized input), ``block_2d``,
    ``rht`` (the columnwise copy is of the Random Hadamard Transform of x^T),
    ``row_scaled`` (``amax`` / ``amax_t`` are per row), ``e4m3_max`` (E, 448, or
    256 with 4over6: every global decode scale is amax / (6 E)).
    """

    data: jax.Array | None
    scale: jax.Array | None
    amax: jax.Array
    data_t: jax.Array | None
    scale_t: jax.Array | None
    amax_t: jax.Array | None
    shape: tuple[int, ...]
    dtype: np.dtype
    block_2d: bool = False
    rht: bool = False
    row_scaled: bool = False
    e4m3_max: int = 448

    @property
    def rows(self) -> int:
        """M: the product of the leading axes."""
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        """N: the last axis."""
        return self.shape[-1]

    def tree_flatten(self):
        children = (self.data, self.scale, self.amax, self.data_t, self.scale_t, self.amax_t)
        return children, (self.shape, self.dtype, self.block_2d, self.rht, self.row_scaled, self.e4m3_max)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)
