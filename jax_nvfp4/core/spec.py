"""``QuantizeSpec``: every option of one NVFP4 quantization, in one place.

The public ``quantize`` builds one from its keywords, ``Recipe`` hands one to
each operand of the three GEMMs, the quantize primitive carries it as its one
static parameter, and the kernels receive ``kernel_attrs()``, which C++ decodes
into the struct of the same name (ffi/nvfp4/spec.h). ``validate`` is the only
place where combinations of options are checked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.core import bits
from jax_nvfp4.core.checks import check_choice, check_flag, check_key, check_mesh_axes, check_positive_factor
from jax_nvfp4.core.formats import BLOCK, num_blocks, packed_size

FourOverSixError = Literal["mae", "mse"]
FOUR_OVER_SIX_ERRORS: tuple[FourOverSixError, ...] = ("mae", "mse")
"""4over6 error measures: the block's candidate with the smaller mean absolute / squared error wins."""

E4M3Max = Literal[448, 256]
E4M3_MAX_CHOICES: tuple[E4M3Max, ...] = (448, 256)
"""Block-scale ranges the global scale may aim at; 256 only with 4over6."""

Shape = tuple[int, ...]


class CopyShapes(NamedTuple):
    """The shapes of the arrays one quantization holds; None for a copy its spec does not make."""

    data: Shape | None  # uint8 codes of the rowwise copy
    scale: Shape | None  # its float8_e4m3fn block scales
    amax: Shape  # float32: () for the tensor, or one per row when row-scaled
    data_t: Shape | None  # the columnwise copy (of x^T), codes
    scale_t: Shape | None  # and scales
    amax_t: Shape  # float32: () for the tensor, or one per row of x^T (column of x) when row-scaled


class GlobalScale(NamedTuple):
    """How a copy's global decode scales apply, decoded from its spec: what the GEMM epilogues read, so that
    they spell no option. The decode scale of an amax is fp32(amax / (6 E))."""

    per_row: bool  # one amax per row (per-token NVFP4): it scales the GEMM's output rows; else one per tensor
    e4m3_max: int  # E

    @property
    def plain(self) -> bool:
        """One scale for the tensor with E = 448: what a GEMM folds into its alpha (amax_a * amax_c / 2688^2)."""
        return not self.per_row and self.e4m3_max == 448


_FLAGS = ("rowwise", "columnwise", "block_2d", "rht", "stochastic_rounding", "row_scaled", "four_over_six_fast_math")
# Options that change the Python side only (the amax pass, its mesh reduction): not kernel attributes.
_NOT_KERNEL_ATTRS = ("rht_amax_factor", "amax_mesh_axes")


@dataclasses.dataclass(frozen=True)
class QuantizeSpec:
    """How to quantize one tensor (frozen and hashable: a static argument).

    Attributes:
      rowwise: produce ``data``/``scale`` (blocks along the last axis).
      columnwise: produce ``data_t``/``scale_t``, the quantization of the
        [N, M] transpose (blocks along the rows), stored transposed.
      block_2d: 16x16 blocks (for weights) instead of 1x16.
      rht: the columnwise copy is the quantization of the 16-point Random
        Hadamard Transform of x^T (each chunk of 16 rows of a column, see
        ``formats.RHT_SIGNS``), scaled by the amax of the transformed values,
        which a fused pass computes with max|x|. The transform is orthogonal,
        so a GEMM of two such copies contracting over M (the weight gradient)
        is unchanged by it. Needs ``columnwise``, 1x16 blocks and M a multiple
        of 16.
      rht_amax_factor: with ``rht``, skip the pass over the transform: its
        amax is fp32(amax * factor). The transform of a chunk is at most 4x
        its max; a factor that undershoots saturates the largest values to
        +-6 (and their block scale to 448). None: measure it.
      stochastic_rounding: round the E2M1 codes of every copy stochastically
        (unbiased), drawing from a counter-based generator keyed by the
        ``rng_key`` of the call, so that the CPU and CUDA kernels give the same
        bytes for a key. Block scales stay round-to-nearest. The draws are a
        function of the key and the position in the whole tensor, so under
        ``jit`` on a mesh the shards draw the bytes of the unsharded tensor.
      row_scaled: per-token NVFP4: each row of x gets its own global amax and
        each row of x^T (column of x) its own for the columnwise copy (of the
        transform with ``rht``). 1x16 blocks only.
      four_over_six_error: "mae" or "mse": 4over6 adaptive block scaling. Each
        block is quantized with its max on E2M1 6 and, with a 1.5x larger
        scale, on 4; the candidate with the smaller absolute / squared error
        is kept. Round-to-nearest only. None: off.
      four_over_six_fast_math: 4over6 measures the errors in the scaled domain
        (the CUDA kernel's fast path) instead of on the dequantized values; a
        few near ties pick the other candidate.
      e4m3_max: E, 448, or 256 with 4over6: the global scale aims the block
        scales at E4M3 values up to E (6 E / amax), leaving map-4's 1.5x
        headroom below 448; a tensor decodes with amax / (6 E).
      amax_mesh_axes: under ``jit`` on a mesh, where the amax is computed
        from the tensor, the mesh axes it is reduced over (None: every axis
        the tensor is sharded on, so sharded and unsharded quantization
        agree). Along the other axes each shard keeps its own amax.
    """

    rowwise: bool = True
    columnwise: bool = False
    block_2d: bool = False
    rht: bool = False
    rht_amax_factor: float | None = None
    stochastic_rounding: bool = False
    row_scaled: bool = False
    four_over_six_error: FourOverSixError | None = None
    four_over_six_fast_math: bool = False
    e4m3_max: E4M3Max = 448
    amax_mesh_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check each option and every combination, raising an error that names the option.

        Values are normalised to their Python types (numpy scalars accepted),
        so equal specs hash alike.
        """
        normal = {name: check_flag(name, getattr(self, name)) for name in _FLAGS}
        if self.four_over_six_error is not None:
            normal["four_over_six_error"] = check_choice(
                "four_over_six_error",
                self.four_over_six_error,
                FOUR_OVER_SIX_ERRORS,
                f"None or one of {FOUR_OVER_SIX_ERRORS}",
            )
        normal["e4m3_max"] = check_choice("e4m3_max", self.e4m3_max, E4M3_MAX_CHOICES, "448 or 256")
        if self.rht_amax_factor is not None:
            normal["rht_amax_factor"] = check_positive_factor("rht_amax_factor", self.rht_amax_factor)
        normal["amax_mesh_axes"] = check_mesh_axes("amax_mesh_axes", self.amax_mesh_axes)
        for name, value in normal.items():
            object.__setattr__(self, name, value)

        if not (self.rowwise or self.columnwise):
            raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
        if self.rht_amax_factor is not None and not self.rht:
            raise ValueError("rht_amax_factor applies only with rht=True")
        if self.rht and (not self.columnwise or self.block_2d):
            raise ValueError("rht applies to the columnwise copy in 1x16 blocks: pass columnwise=True, block_2d=False")
        if self.row_scaled and self.block_2d:
            raise ValueError("row-scaled NVFP4 has 1x16 blocks only (block_2d=False)")
        four_over_six = self.four_over_six_error is not None
        if four_over_six and self.stochastic_rounding:
            raise ValueError("4over6 picks between round-to-nearest candidates: no stochastic rounding with it")
        if self.four_over_six_fast_math and not four_over_six:
            raise ValueError("four_over_six_fast_math applies only with 4over6 (four_over_six_error='mae' or 'mse')")
        if self.e4m3_max != 448 and not four_over_six:
            # TransformerEngine's reference silently uses 448 here; an explicit error instead.
            raise ValueError("e4m3_max=256 applies only with 4over6 (four_over_six_error='mae' or 'mse')")

    @property
    def blocked_rows(self) -> bool:
        """Whether blocks run along the rows (the columnwise copy, or 16x16 blocks)."""
        return self.columnwise or self.block_2d

    @property
    def blocked_cols(self) -> bool:
        """Whether blocks run along the columns (the rowwise copy, or 16x16 blocks)."""
        return self.rowwise or self.block_2d

    @property
    def block_shape(self) -> tuple[int, int]:
        """A block's (rows, columns) in x: (16, 16) for 16x16 blocks, else (1, 16)."""
        return (BLOCK if self.block_2d else 1, BLOCK)

    @property
    def transposable(self) -> bool:
        """Whether the columnwise copy is the rowwise one transposed (16x16 blocks, one quantization for both):
        either copy then stands for the other, read transposed."""
        return self.block_2d

    @property
    def global_scale(self) -> GlobalScale:
        """How the copies' global decode scales apply (per tensor or per row, and E)."""
        return GlobalScale(self.row_scaled, self.e4m3_max)

    @property
    def draws_random(self) -> bool:
        """Whether the kernels draw random words (stochastic rounding): the bytes then depend on a key and on each
        element's position in the whole tensor, so a shard must be told where it sits."""
        return self.stochastic_rounding

    def seed(self, rng_key: jax.Array | None, name: str = "rng_key") -> jax.Array:
        """The kernels' seed, uint32 [2]: drawn from ``rng_key`` where the spec draws random words (which needs
        a key; ValueError naming ``name`` without one), zeros where it does not."""
        if not self.draws_random:
            return jnp.zeros(2, jnp.uint32)
        if rng_key is None:
            raise ValueError(f"stochastic_rounding=True needs {name}= (a JAX PRNG key)")
        return jax.random.bits(check_key(rng_key, name), (2,), jnp.uint32)

    def rowwise_only(self) -> QuantizeSpec:
        """The spec of the rowwise copy alone: the columnwise copy and its options (the transform) dropped."""
        return dataclasses.replace(self, rowwise=True, columnwise=False, rht=False, rht_amax_factor=None)

    def check_grouped(self) -> None:
        """Raise ValueError unless the grouped quantize (mixture of experts) can run the spec: it makes a
        columnwise copy in 1x16 blocks."""
        if not self.columnwise or self.block_2d:
            raise ValueError(
                "the grouped quantize makes a columnwise copy in 1x16 blocks: columnwise=True, block_2d=False"
            )

    @property
    def four_over_six_choice(self) -> tuple[FourOverSixError, bool] | None:
        """How 4over6 picks a block's candidate, (error measure, fast math), or None where it is off."""
        return None if self.four_over_six_error is None else (self.four_over_six_error, self.four_over_six_fast_math)

    @property
    def measures_rht_amax(self) -> bool:
        """Whether the amax pass also measures the transform's amax (``rht`` without a factor)."""
        return self.rht and self.rht_amax_factor is None

    def check_rows(self, rows: int) -> None:
        """Raise ValueError unless M = ``rows`` suits the spec (the transform takes chunks of 16 rows)."""
        if self.rht and rows % BLOCK:
            raise ValueError(
                f"rht transforms chunks of {BLOCK} rows: the rows (product of the leading axes, {rows}) "
                f"must be a multiple of {BLOCK}"
            )

    def copy_shapes(self, rows: Sequence[int], cols: int) -> CopyShapes:
        """The shapes of the arrays that quantizing x [*rows, cols] gives (the primitives add their batch
        axis in front of each): the rowwise copy [*rows, ceil(cols/2)] codes and [*rows, ceil(cols/16)]
        scales; the columnwise copy, of x^T, [cols, *rows[:-1], ceil(M/2)] and [cols, *rows[:-1],
        ceil(M/16)] with M = rows[-1]; amax and amax_t () each, or ``rows`` and (cols,) when row-scaled.
        The one home of these shapes (the C++ twin: ``copy_sizes`` in ffi/nvfp4/ffi_common.h)."""
        rows = tuple(int(r) for r in rows)
        *lead, m = rows
        return CopyShapes(
            data=(*rows, packed_size(cols)) if self.rowwise else None,
            scale=(*rows, num_blocks(cols)) if self.rowwise else None,
            amax=rows if self.row_scaled else (),
            data_t=(cols, *lead, packed_size(m)) if self.columnwise else None,
            scale_t=(cols, *lead, num_blocks(m)) if self.columnwise else None,
            amax_t=(cols,) if self.row_scaled else (),
        )

    def tensor_shapes(self, shape: Sequence[int]) -> CopyShapes:
        """The shapes of an ``NVFP4Tensor`` of logical shape [..., N]: its rowwise copy keeps the leading axes,
        its columnwise copy merges them into M rows ([N, ceil(M/2)], M = prod(shape[:-1]))."""
        *lead, n = shape
        rowwise, columnwise = self.copy_shapes(lead, n), self.copy_shapes((math.prod(lead),), n)
        return CopyShapes(*rowwise[:3], *columnwise[3:])

    def check_amaxes(
        self, x_shape: tuple[int, ...], amax_shape: tuple[int, ...], amax_t_shape: tuple[int, ...]
    ) -> None:
        """Raise ValueError unless quantize's amax and amax_t suit x [B, *R, N]: [B] each, or per row [B, *R] and
        [B, N] (row-scaled); each checked where its copy is requested."""
        b, *rows, n = x_shape
        shapes = self.copy_shapes(rows, n)
        want = ((b, *shapes.amax), (b, *shapes.amax_t))
        if (self.rowwise and amax_shape != want[0]) or (self.columnwise and amax_t_shape != want[1]):
            raise ValueError(
                f"amax / amax_t must be {want[0]} / {want[1]} (one per row when row-scaled), "
                f"got {amax_shape} / {amax_t_shape}"
            )

    def columnwise_amax(self, amax_t: jax.Array) -> jax.Array:
        """The columnwise copy's amax from the measured one: times ``rht_amax_factor`` where the spec estimates
        the transform's amax, fp32(amax * factor) exactly on every backend (subnormals kept)."""
        if not self.rht or self.rht_amax_factor is None:
            return amax_t
        product = bits.mul(bits.to_bits(amax_t), np.float32(self.rht_amax_factor).view(np.uint32))
        return bits.from_bits(product)

    def kernel_attrs(self) -> dict[str, bool | np.int32]:
        """The FFI attributes of the quantize kernels: the fields C++ decodes into its QuantizeSpec
        (ffi/nvfp4/spec.h), choices as int32 codes (4over6 error: 0 off, 1 MAE, 2 MSE)."""
        attrs = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _NOT_KERNEL_ATTRS:
                continue
            if field.name == "four_over_six_error":
                value = (None, *FOUR_OVER_SIX_ERRORS).index(value)
            attrs[field.name] = np.int32(value) if isinstance(value, int) and not isinstance(value, bool) else value
        return attrs
