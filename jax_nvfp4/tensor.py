"""The NVFP4 tensor: packed E2M1 codes, E4M3 block scales, FP32 global amax."""

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
      amax    float32 []: global amax the scales were computed from.
      data_t  uint8 [N, ceil(M/2)]: the columnwise copy, the quantization of x^T.
      scale_t float8_e4m3fn [N, ceil(M/16)].
      amax_t  float32 [] (the columnwise copy's amax).
    Static metadata: ``shape``, ``dtype`` (of the quantized input), ``block_2d``,
    ``rht`` (the columnwise copy is of the Random Hadamard Transform of x^T).
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
        return children, (self.shape, self.dtype, self.block_2d, self.rht)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)
