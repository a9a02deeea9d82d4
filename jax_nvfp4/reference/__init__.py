"""The pure-JAX NVFP4 reference: the executable spec, with the public signatures.

``quantize`` / ``dequantize`` / ``amax`` / ``fake_quantize`` here are ``jax_nvfp4``'s, run on the
reference's core ops (``reference.kernels``) instead of the kernels, which must
give the same bytes. The core ops and their building blocks are re-exported
for tests and tools.
"""

from jax_nvfp4.core import codecs, pipeline
from jax_nvfp4.core.fake_quantize import fake_quantize_fn
from jax_nvfp4.reference import kernels

# The core ops and their building blocks, for tests and tools.
GlobalScales = kernels.GlobalScales
amax_core = kernels.amax_core
block_encode_scale = kernels.block_encode_scale
dequantize_core = kernels.dequantize_core
dequantize_scale = kernels.dequantize_scale
quantize_core = kernels.quantize_core
rht_columns = kernels.rht_columns
# The E2M1 / E4M3 codecs on float32 bit patterns.
e2m1_decode, e2m1_encode = codecs.e2m1_decode, codecs.e2m1_encode
e4m3_decode, e4m3_encode = codecs.e4m3_decode, codecs.e4m3_encode

amax = pipeline.amax_fn(kernels.REFERENCE)
quantize = pipeline.quantize_fn(kernels.REFERENCE)
dequantize = pipeline.dequantize_fn(kernels.REFERENCE)
fake_quantize = fake_quantize_fn(quantize, dequantize)
