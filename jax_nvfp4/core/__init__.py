"""The NVFP4 format and its one quantize pipeline, shared by every backend.

``formats`` (constants), ``spec`` (``QuantizeSpec``, every option of one quantization), ``tensor`` (the
quantized tensor types), ``checks`` (argument checks), ``bits`` and ``codecs`` (exact float32 arithmetic and
the E2M1/E4M3 codecs on bit patterns), ``backend`` (what a backend provides) and ``pipeline`` (the public
quantize/dequantize/amax built over a backend: the kernels or the pure-JAX reference).
"""
