"""The NVFP4 training recipe: which options the quantized dot_general uses."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jax_nvfp4.core.checks import check_choice, check_flag, check_mesh_axes, check_positive_factor
from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.spec import E4M3_MAX_CHOICES, FOUR_OVER_SIX_ERRORS, E4M3Max, FourOverSixError, QuantizeSpec
from jax_nvfp4.linear.block_sum import GEMM_IMPLS, GemmImpl

FourOverSixOperands = Literal["weights", "activations", "all"]
FOUR_OVER_SIX_OPERANDS: tuple[FourOverSixOperands, ...] = ("weights", "activations", "all")
"""Which operands ``FourOverSix`` quantizes with 4over6: W, x, or x, W and dy."""


@dataclasses.dataclass(frozen=True)
class FourOverSix:
    """4over6 adaptive block scaling in a ``Recipe``: each block quantized with its max on E2M1 6 and on 4,
    the candidate with the smaller error kept (frozen, hashable).

    Attributes:
      operands: "weights" (W), "activations" (x), or "all" (x, W and the
        gradient dy; dy's 4over6 rounds to nearest, so "all" needs
        ``Recipe(stochastic_rounding=False)``). Both copies of an operand use
        it (with 16x16 blocks each copy chooses on its own error sums, which
        can differ in rare near ties).
      error: "mse" or "mae": the error 4over6 compares.
      fast_math: measure that error in the scaled domain (the CUDA kernel's
        fast path) instead of on the dequantized values.
      e4m3_max: 256 (default) or 448: the block-scale range these operands'
        global scale aims at; 256 leaves room for map-4's 1.5x larger scale
        below E4M3's 448. The other operands use 448, the only range defined
        without 4over6.
    """

    operands: FourOverSixOperands = "weights"
    error: FourOverSixError = "mse"
    fast_math: bool = False
    e4m3_max: E4M3Max = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "fast_math", check_flag("FourOverSix.fast_math", self.fast_math))
        choices = (
            ("operands", FOUR_OVER_SIX_OPERANDS, None),
            ("error", FOUR_OVER_SIX_ERRORS, None),
            ("e4m3_max", E4M3_MAX_CHOICES, "448 or 256"),
        )
        for name, options, expected in choices:
            value = check_choice(f"FourOverSix.{name}", getattr(self, name), options, expected)
            object.__setattr__(self, name, value)

    def applies_to(self, operand: str) -> bool:
        """Whether operand "x", "w" or "dy" is quantized with 4over6."""
        return operand in {"weights": ("w",), "activations": ("x",), "all": ("x", "w", "dy")}[self.operands]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Options of the NVFP4 recipe for y = x W (frozen, hashable: a static argument).

    The defaults are NVIDIA's NVFP4 pretraining recipe: 16x16 weight blocks,
    the Random Hadamard Transform on the weight-gradient operands, and
    stochastic rounding of the gradients. Always on: x and dy in 1x16 blocks
    along the contracting axis of each GEMM. One float32 global amax per tensor
    unless ``row_scaled_*`` gives x or dy one per token.

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
      four_over_six: 4over6 adaptive block scaling for some operands
        (``FourOverSix``: which operands, the error it compares, fast math,
        the block-scale range); None (default): off.
      row_scaled_activations: per-token NVFP4 for x: each token (row) gets its
        own global amax, and x's columnwise copy (the wgrad operand) one per
        feature. The GEMMs run with a neutral global scale and multiply each
        output row (fprop) or column (wgrad) by its float32 scale afterwards.
      row_scaled_gradients: the same for dy (dgrad output rows, wgrad output
        rows per output feature).
      impl: how the three GEMMs sum their blocks: "emulated" (bf16 dot),
        "scaled_dot" (``lax.scaled_dot``: a Triton GEMM on the FP4 tensor
        cores on Blackwell), "cudnn" (``jax.nn.scaled_matmul``: cuDNN's NVFP4
        GEMM on Blackwell), "fused" (a Pallas GEMM decoding the packed
        operands in its tiles, for Hopper) or "auto" (scaled_dot where the
        devices it is compiled for are Blackwell, decided while it lowers;
        emulated elsewhere); see ``jax_nvfp4.gemm``.
    """

    weight_block_2d: bool = True
    rht: bool = True
    rht_amax_estimate: bool = False
    rht_amax_factor_x: float = 2.0
    rht_amax_factor_dy: float = 1.0
    stochastic_rounding: bool = True
    amax_mesh_axes: tuple[str, ...] | None = None
    four_over_six: FourOverSix | None = None
    row_scaled_activations: bool = False
    row_scaled_gradients: bool = False
    impl: GemmImpl = "auto"

    def __post_init__(self) -> None:
        flags = ("weight_block_2d", "rht", "rht_amax_estimate", "stochastic_rounding")
        for name in (*flags, "row_scaled_activations", "row_scaled_gradients"):
            object.__setattr__(self, name, check_flag(f"Recipe.{name}", getattr(self, name)))
        for name in ("rht_amax_factor_x", "rht_amax_factor_dy"):
            check_positive_factor(f"Recipe.{name}", getattr(self, name))
        # A tuple, so the recipe stays hashable.
        object.__setattr__(self, "amax_mesh_axes", check_mesh_axes("Recipe.amax_mesh_axes", self.amax_mesh_axes))
        self._check_choices()

    def _check_choices(self) -> None:
        object.__setattr__(self, "impl", check_choice("Recipe.impl", self.impl, GEMM_IMPLS))
        if not (self.four_over_six is None or isinstance(self.four_over_six, FourOverSix)):
            raise TypeError(
                "Recipe.four_over_six must be a jax_nvfp4.FourOverSix or None, got "
                f"{type(self.four_over_six).__name__}: e.g. four_over_six=FourOverSix(operands='weights')"
            )
        if self.four_over_six is not None and self.four_over_six.applies_to("dy") and self.stochastic_rounding:
            raise ValueError(
                "FourOverSix(operands='all') quantizes dy with 4over6, which rounds to nearest: set "
                "Recipe(stochastic_rounding=False), or operands='weights' / 'activations' to keep dy's stochastic "
                "rounding"
            )

    @property
    def needs_rng_key(self) -> bool:
        """Whether the backward pass draws random bits (stochastic rounding of dy): dot_general needs a key."""
        return self.stochastic_rounding

    def check_rng_key(self, key) -> None:
        """Raise ValueError if the backward pass needs a key and ``key`` is None, saying where one comes from."""
        if self.needs_rng_key and key is None:
            raise ValueError(
                "Recipe(stochastic_rounding=True) rounds the gradients with random bits: pass rng_key= to "
                "jax_nvfp4.dot_general (a fresh key each step), give the Flax layers an 'nvfp4' RNG stream "
                "(linen: apply(..., rngs={'nvfp4': key}); NNX: "
                "dot_general=jax_nvfp4.flax.nnx.NVFP4DotGeneral(rngs=rngs) instead of jax_nvfp4.dot_general), "
                "or use Recipe(stochastic_rounding=False)"
            )

    def four_over_six_for(self, operand: str) -> FourOverSix | None:
        """The 4over6 options of operand "x", "w" or "dy", or None where it is quantized without 4over6."""
        fos = self.four_over_six
        return fos if fos is not None and fos.applies_to(operand) else None

    def spec(self, operand: Literal["x", "w", "dy"], *, columnwise: bool, tokens: int) -> QuantizeSpec:
        """How the recipe quantizes operand "x", "w" or "dy" of y = x W: its ``QuantizeSpec``.

        ``columnwise``: whether its columnwise copy (a backward-pass operand)
        is made too; ``tokens``: the rows of x and dy, whose wgrad copies are
        transformed (``rht``) where they are whole chunks of 16.
        """
        fos = self.four_over_six_for(operand)
        rht = self.rht and operand != "w" and columnwise and tokens % BLOCK == 0
        factor = {"x": self.rht_amax_factor_x, "dy": self.rht_amax_factor_dy}.get(operand)
        return QuantizeSpec(
            rowwise=True,
            columnwise=columnwise,
            block_2d=operand == "w" and self.weight_block_2d,
            rht=rht,
            rht_amax_factor=factor if rht and self.rht_amax_estimate else None,
            stochastic_rounding=operand == "dy" and self.stochastic_rounding,
            row_scaled={"x": self.row_scaled_activations, "dy": self.row_scaled_gradients}.get(operand, False),
            four_over_six_error=None if fos is None else fos.error,
            four_over_six_fast_math=fos is not None and fos.fast_math,
            e4m3_max=448 if fos is None else fos.e4m3_max,
            amax_mesh_axes=self.amax_mesh_axes,
        )
