"""Which quantization options the spec defines, and which combinations of them.

One home for the rule, shared by the public frontend (which checks before any
work) and the reference core (which the kernels must match).
"""

from __future__ import annotations

FOUR_OVER_SIX_MODES = ("mae", "mse")
"""4over6 error measures: the block's candidate with the smaller mean absolute / squared error wins."""

E4M3_MAX_CHOICES = (448, 256)
"""Block-scale ranges the global scale may aim at; 256 only with 4over6."""


def check_options(*, block_2d: bool, stochastic: bool, row_scaled: bool, four_over_six, e4m3_max: int) -> None:
    """Raise ValueError for option combinations the spec does not define."""
    if row_scaled and block_2d:
        raise ValueError("row-scaled NVFP4 has 1x16 blocks only (block_2d=False)")
    if four_over_six is not None and four_over_six not in FOUR_OVER_SIX_MODES:
        raise ValueError(f"four_over_six must be None or one of {FOUR_OVER_SIX_MODES}, got {four_over_six!r}")
    if four_over_six is not None and stochastic:
        raise ValueError("4over6 picks between round-to-nearest candidates: no stochastic rounding with it")
    if isinstance(e4m3_max, bool) or e4m3_max not in E4M3_MAX_CHOICES:
        raise ValueError(f"e4m3_max must be 448 or 256, got {e4m3_max!r}")
    if e4m3_max != 448 and four_over_six is None:
        # TransformerEngine's reference silently uses 448 here; an explicit error instead.
        raise ValueError("e4m3_max=256 applies only with 4over6 (four_over_six='mae' or 'mse')")
