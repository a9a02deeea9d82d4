"""The NVFP4 primitives, one file per op: abstract evaluation, lowering (the FFI kernel where one is
built, the pure-JAX reference elsewhere), batching, sharding and the reference that defines the op.

Operands and results carry a leading batch axis [B, ...] (see ``define``). Rows may span several
axes R = (..., M), e.g. batch and sequence kept apart so each can stay sharded; the kernels see them
as one axis of prod(R) rows, which gives the same bytes where M is whole blocks of 16.
``KERNELS`` is the backend (``core.backend.Backend``) the public functions run on.
"""

from jax_nvfp4.core.backend import Backend
from jax_nvfp4.ops import amax, dequantize, gemm, quantize

KERNELS = Backend(amax=amax.amax, quantize=quantize.quantize, dequantize=dequantize.dequantize)

__all__ = ["KERNELS", "amax", "dequantize", "gemm", "quantize"]
