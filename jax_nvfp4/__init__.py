"""jax_nvfp4: NVFP4 (4-bit E2M1 + E4M3 block scales) quantization for JAX.

Public API:
  quantize(x, *, rowwise=True, columnwise=False, block_2d=False, amax=None, ..., row_scaled=False,
           four_over_six=None, four_over_six_fast_math=False, e4m3_max=448) -> NVFP4Tensor
  dequantize(t, dtype=jnp.float32, columnwise=False) -> jax.Array
  amax(x, *, row_scaled=False) -> float32 scalar (per row: x.shape[:-1])
  NVFP4Tensor, and ``reference``: the pure-JAX spec with the same signatures.
  gemm(a, c, out_dtype) -> a @ c.T of two quantized tensors (exact emulation)
  dot_general(lhs, rhs, dimension_numbers, ..., recipe=None): lax.dot_general in NVFP4
  Recipe: the training recipe's options.
  all_gather(t, axis_name, *, axis=0, tiled=True): gather a quantized tensor in shard_map
Under jit on a mesh the primitives shard themselves (amax reduced over the mesh,
GEMM operands gathered quantized).
Flax layers live in ``jax_nvfp4.flax`` (needs flax).
"""

from jax_nvfp4 import _frontend, reference
from jax_nvfp4.dot import dot_general
from jax_nvfp4.gemm import gemm
from jax_nvfp4.primitives import KERNELS
from jax_nvfp4.recipe import Recipe
from jax_nvfp4.sharding import all_gather
from jax_nvfp4.tensor import NVFP4Tensor

quantize = _frontend.quantize_fn(KERNELS)
dequantize = _frontend.dequantize_fn(KERNELS)
amax = _frontend.amax_fn(KERNELS)

__all__ = ["NVFP4Tensor", "Recipe", "all_gather", "amax", "dequantize", "dot_general", "gemm", "quantize", "reference"]
__version__ = "0.1.0"
