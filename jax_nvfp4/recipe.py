"""The NVFP4 training recipe: which options the quantized dot_general uses."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Options of the NVFP4 recipe for y = x W (frozen, hashable: a static argument).

    Always on: x and dy in 1x16 blocks along the contracting axis of each GEMM,
    one float32 global amax per tensor, round-to-nearest-even everywhere.

    Attributes:
      weight_block_2d: quantize W in 16x16 blocks (the NVIDIA recipe), so the
        dgrad GEMM uses the transpose of the very codes and scales the forward
        GEMM used. ``False``: 1x16 blocks, W is quantized once along each of its
        two axes (two roundings).
      amax_mesh_axes: under ``jit`` on a mesh, the mesh axes over which each
        operand's amax (x, W, dy) is reduced. None (default): every axis the
        operand is sharded on, so sharded training quantizes as unsharded
        training does. Naming fewer (e.g. the FSDP and sequence axes, which
        the GEMM gathers over, as TransformerEngine does) saves the reduction
        along the others, where each shard then keeps its own amax.
    """

    weight_block_2d: bool = True
    amax_mesh_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight_block_2d, bool):
            raise TypeError(f"Recipe.weight_block_2d must be a bool, got {self.weight_block_2d!r}")
        axes = self.amax_mesh_axes
        if axes is not None:
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            if not all(isinstance(a, str) for a in axes):
                raise TypeError(f"Recipe.amax_mesh_axes must be mesh axis names (str), got {self.amax_mesh_axes!r}")
            object.__setattr__(self, "amax_mesh_axes", axes)  # a tuple, so the recipe stays hashable
