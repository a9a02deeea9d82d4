"""The pure-JAX NVFP4 reference: the executable spec, with the public signatures.

``quantize`` / ``dequantize`` / ``amax`` here are ``jax_nvfp4``'s, run on the
reference's core ops (``_reference_core``) instead of the kernels, which must
give the same bytes. The core ops and their building blocks are re-exported
for tests and tools.
"""

from jax_nvfp4 import _codecs, _frontend, _reference_core

# The core ops and their building blocks, for tests and tools.
GlobalScales = _reference_core.GlobalScales
amax_core = _reference_core.amax_core
block_encode_scale = _reference_core.block_encode_scale
dequantize_core = _reference_core.dequantize_core
dequantize_scale = _reference_core.dequantize_scale
quantize_core = _reference_core.quantize_core
rht_columns = _reference_core.rht_columns
# The E2M1 / E4M3 codecs on float32 bit patterns.
e2m1_decode, e2m1_encode = _codecs.e2m1_decode, _codecs.e2m1_encode
e4m3_decode, e4m3_encode = _codecs.e4m3_decode, _codecs.e4m3_encode

amax = _frontend.amax_fn(_reference_core.REFERENCE)
quantize = _frontend.quantize_fn(_reference_core.REFERENCE)
dequantize = _frontend.dequantize_fn(_reference_core.REFERENCE)
