"""The NVFP4 tensor: packed E2M1 codes, E4M3 block scales, FP32 global amax (one per tensor or per row)."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import numpy as np

from jax_nvfp4.core.spec import QuantizeSpec

_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(QuantizeSpec))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor of logical shape ``shape`` = [..., N]; M = prod(shape[:-1]).

    Arrays (``None`` where a copy was not requested)::

      data    uint8 [..., ceil(N/2)]: rowwise E2M1 codes, element 2i in the low nibble.
      scale   float8_e4m3fn [..., ceil(N/16)]: decode scale of each 1x16 block
              (16x16 blocks: the block's scale repeated on each of its rows).
      amax    float32 []: global amax the scales were computed from;
              row-scaled: float32 [...] (``shape[:-1]``), the amax of each row.
      data_t  uint8 [N, ceil(M/2)]: the columnwise copy, the quantization of x^T.
      scale_t float8_e4m3fn [N, ceil(M/16)].
      amax_t  float32 [] (the columnwise copy's amax); row-scaled: float32 [N],
              the amax of each row of x^T (column of x, of its transform with ``rht``).

    Static metadata: ``shape``, ``dtype`` (of the quantized input) and ``spec``,
    the ``QuantizeSpec`` it was quantized with, which says how it decodes (every
    global decode scale is amax / (6 E), E of ``spec.global_scale``).

    ``batched`` (made by ``dot_general``, not by ``quantize``): ``shape[0]`` is
    a batch of B independent tensors ``[*R, N]``, each with its own columnwise copy:
    data_t ``[B, N, *R[:-1], ceil(R[-1]/2)]`` (scale_t alike), amax and amax_t [B],
    or per row ``[B, *R]`` and [B, N].
    """

    data: jax.Array | None
    scale: jax.Array | None
    amax: jax.Array
    data_t: jax.Array | None
    scale_t: jax.Array | None
    amax_t: jax.Array | None
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: QuantizeSpec = dataclasses.field(default_factory=QuantizeSpec)
    batched: bool = False

    @property
    def rows(self) -> int:
        """M: the product of the leading axes."""
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        """N: the last axis."""
        return self.shape[-1]

    def __getattr__(self, name: str):
        # Four of the spec's fields were the tensor's own shorthands (block_2d, rht, row_scaled, e4m3_max): they
        # warn for one release. Every spec field is forwarded alike, so that no list spells the four again.
        if name.startswith("_") or name not in _SPEC_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(
            f"NVFP4Tensor.{name} is deprecated and will be removed in the next release; use t.spec.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self.spec, name)

    def tree_flatten(self):
        children = (self.data, self.scale, self.amax, self.data_t, self.scale_t, self.amax_t)
        return children, (self.shape, self.dtype, self.spec, self.batched)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def check_tensor(name: str, t) -> NVFP4Tensor:
    """``t`` if it is an NVFP4Tensor quantize made (not a batch), else an error naming the argument."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"{name} must be an NVFP4Tensor (from quantize), got {type(t).__name__}")
    if t.batched:
        raise ValueError(f"{name} is a batch of tensors (dot_general's operands), not one from quantize")
    return t


class _StoredKernel:
    """What a weight that stands in for a layer's kernel (its ``shape``) answers as the kernel would: its rank,
    and ``[...]``."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index):
        # NNX layers read their kernel as ``param[...]``: the whole weight, as it is.
        if index is not Ellipsis:
            raise TypeError(f"a {type(self).__name__} is indexed only as [...] (the whole weight)")
        return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tensor"], meta_fields=["shape", "contract_ndim"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight(_StoredKernel):
    """A layer's kernel stored in NVFP4 for inference (``jax_nvfp4.quantize_weight``).

    ``tensor``: the rowwise copy of W^T [1, N, K] (batched) exactly as the training forward GEMM
    quantizes it: 0.5625 bytes a value. ``shape``: the kernel's own shape ``[*in, *out]``, its first
    ``contract_ndim`` axes contracted (K = their product, N = the rest's). ``jax_nvfp4.dot_general``
    takes it as ``rhs`` (forward only) and the Flax layers apply it as their kernel.
    """

    tensor: NVFP4Tensor
    shape: tuple[int, ...]
    contract_ndim: int

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the kernel it was quantized from (what Flax promotes the layer's inputs with)."""
        return self.tensor.dtype


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kernel", "quantized"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CachedWeight(_StoredKernel):
    """A layer's kernel for training, with its forward copy quantized once (``jax_nvfp4.cache_weight``).

    ``kernel``: the high-precision kernel ``[*in, *out]``, which gradients flow to; ``quantized``: the
    ``QuantizedWeight`` that ``quantize_weight(kernel, recipe)`` made of it. ``jax_nvfp4.dot_general`` takes it
    as ``rhs`` and differentiates it as ``kernel``, but its GEMMs read ``quantized`` instead of quantizing the
    kernel again: with gradient accumulation, each weight is quantized once per optimizer step.
    """

    kernel: jax.Array
    quantized: QuantizedWeight

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.kernel.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.kernel.dtype
