"""jax_nvfp4: NVFP4 (4-bit E2M1 + E4M3 block scales) quantization for JAX.

Public API:
  QuantizeSpec: every option of one quantization (copies, blocks, RHT, stochastic rounding, row scaling,
    4over6, E4M3 range, amax mesh axes); frozen and hashable.
  quantize(x, spec=None, *, amax=None, rng_key=None, **spec_fields) -> NVFP4Tensor
  dequantize(t, dtype=jnp.float32, columnwise=False) -> jax.Array
  amax(x, *, amax_mesh_axes=None) -> float32 scalar (per-row option: one per row, x.shape[:-1])
  fake_quantize(x, spec=None, *, amax=None, rng_key=None, **spec_fields) -> dequantize(quantize(x)) in x's
    dtype with a straight-through (identity) gradient: quantization-aware training
  NVFP4Tensor: a quantized tensor (codes, scales, amax; the columnwise copy), and ``reference``: the pure-JAX
    spec with the same signatures.
  gemm(a, b_t, out_dtype) -> a @ b_t.T of two quantized tensors blocked along K (B quantized transposed)
  dot_general(lhs, rhs, dimension_numbers, ..., recipe=None, rng_key=None): lax.dot_general in NVFP4
  einsum(subscripts, lhs, rhs, ..., recipe=None, rng_key=None): a two-operand jnp.einsum in NVFP4
  ragged_dot(lhs, rhs, group_sizes, ..., recipe=None, rng_key=None): lax.ragged_dot (mixture of experts) in NVFP4
  Recipe: the training recipe's options, and the QuantizeSpec of each GEMM operand;
    FourOverSix: its 4over6 options (which operands, error, fast math, block-scale range).
  MXFP8: a layer's GEMMs in MXFP8 instead (pass it as recipe=; ``jax_nvfp4.mxfp8``).
  quantize_weight(kernel, recipe) -> QuantizedWeight: a kernel stored in NVFP4 for inference (dot_general and
    the Flax layers apply it without quantizing it again; for a Flax model's: ``jax_nvfp4.flax.quantize_weights``,
    ``jax_nvfp4.flax.nnx.quantize_weights``); dequantize_weight(w) decodes it
  cache_weight(kernel, recipe) -> CachedWeight: the kernel with its forward copy quantized once, for
    training with gradient accumulation (dot_general reuses the copy and differentiates the kernel; for a Flax
    model's: ``jax_nvfp4.flax.cache_weights``, ``jax_nvfp4.flax.nnx.cache_weights``)
  remat_policy(*, activations=True, outputs=False, base=None): a jax.checkpoint policy that saves what the
    recipe makes (a weight's quantized copy is saved under every policy; this one saves x's copies too, and
    with outputs=True the GEMMs' results)
  all_gather(t, axis_name, *, axis=0, tiled=True): gather a quantized tensor in shard_map
  build_info() -> dict: the version, the compiled modules' build settings (jaxlib, CUDA architectures)
    and what runs each op on the current devices (``python -m jax_nvfp4`` prints it)
Under jit on a mesh the primitives shard themselves (amax reduced over the mesh,
GEMM operands gathered quantized). Flax layers live in ``jax_nvfp4.flax`` (needs
flax); ``jax_nvfp4.sharding.hlo`` reads the collectives of a compiled program.
"""

from jax_nvfp4 import reference
from jax_nvfp4.build_info import build_info
from jax_nvfp4.core import pipeline
from jax_nvfp4.core.fake_quantize import fake_quantize_fn
from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.core.tensor import CachedWeight, NVFP4Tensor, QuantizedWeight
from jax_nvfp4.linear.dot_general import cache_weight, dequantize_weight, dot_general, quantize_weight
from jax_nvfp4.linear.einsum import einsum
from jax_nvfp4.linear.gemm import gemm
from jax_nvfp4.linear.recipe import FourOverSix, Recipe
from jax_nvfp4.linear.remat import remat_policy
from jax_nvfp4.moe.ragged_dot import ragged_dot
from jax_nvfp4.mxfp8 import MXFP8
from jax_nvfp4.ops import KERNELS
from jax_nvfp4.sharding.all_gather import all_gather

quantize = pipeline.quantize_fn(KERNELS)
dequantize = pipeline.dequantize_fn(KERNELS)
amax = pipeline.amax_fn(KERNELS)
fake_quantize = fake_quantize_fn(quantize, dequantize)

__all__ = [
    "MXFP8",
    "CachedWeight",
    "FourOverSix",
    "NVFP4Tensor",
    "QuantizeSpec",
    "QuantizedWeight",
    "Recipe",
    "all_gather",
    "amax",
    "build_info",
    "cache_weight",
    "dequantize",
    "dequantize_weight",
    "dot_general",
    "einsum",
    "fake_quantize",
    "gemm",
    "quantize",
    "quantize_weight",
    "ragged_dot",
    "reference",
    "remat_policy",
]
__version__ = "0.1.0"
