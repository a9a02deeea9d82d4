"""The NVFP4 training recipe: which options the quantized dot_general uses."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Options of the NVFP4 recipe for y = x W (frozen, hashable: a static argument).

    The defaults are NVIDIA's NVFP4 pretraining recipe: 16x16 weight blocks,
    the Random Hadamard Transform on the weight-gradient operands, and
    stochastic rounding of the gradients. Always on: x and dy in 1x16 blocks
    along the contracting axis of each GEMM, one float32 global amax per tensor.

    Attributes:
      weight_block_2d: quantize W in 16x16 blocks, so the dgrad GEMM uses the
        transpose of the very codes and scales the forward GEMM used.
        ``False``: 1x16 blocks, W is quantized once along each of its two axes.
      rht: the wgrad GEMM dW = dy^T x contracts the Random Hadamard Transform
        of both operands along the tokens (the transform is orthogonal, so the
        product is unchanged but outliers are spread over 16 tokens before
        quantization). Applies where the token count is a multiple of 16;
        otherwise that GEMM runs without it.
      rht_amax_estimate: take the transformed copies' amax as the pre-RHT
        amax times a factor instead of a pass over the transform (one pass
        over the input instead of two).
      rht_amax_factor_x, rht_amax_factor_dy: those factors for x and dy.
      stochastic_rounding: round dy's codes (dgrad and wgrad operands)
        stochastically. The backward pass then needs a key:
        ``dot_general(..., rng_key=)``, or the Flax layers' RNG stream
        ``"nvfp4"``.
      amax_mesh_axes: under ``jit`` on a mesh, the mesh axes over which each
        operand's amax (x, W, dy) is reduced. None (default): every axis the
        operand is sharded on, so sharded training quantizes as unsharded
        training does. Naming fewer (e.g. the FSDP and sequence axes, which
        the GEMM gathers over, as TransformerEngine does) saves the reduction
        along the others, where each shard then keeps its own amax.
    """

    weight_block_2d: bool = True
    rht: bool = True
    rht_amax_estimate: bool = False
    rht_amax_factor_x: float = 2.0
    rht_amax_factor_dy: float = 1.0
    stochastic_rounding: bool = True
    amax_mesh_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("weight_block_2d", "rht", "rht_amax_estimate", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Recipe.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("rht_amax_factor_x", "rht_amax_factor_dy"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Recipe.{name} must be a positive finite number, got {value!r}")
        axes = self.amax_mesh_axes
        if axes is not None:
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            if not all(isinstance(a, str) for a in axes):
                raise TypeError(f"Recipe.amax_mesh_axes must be mesh axis names (str), got {self.amax_mesh_axes!r}")
            object.__setattr__(self, "amax_mesh_axes", axes)  # a tuple, so the recipe stays hashable
