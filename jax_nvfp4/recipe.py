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
    """

    weight_block_2d: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not isinstance(getattr(self, field.name), bool):
                raise TypeError(f"Recipe.{field.name} must be a bool, got {getattr(self, field.name)!r}")
