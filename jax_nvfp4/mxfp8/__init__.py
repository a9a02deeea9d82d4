"""MXFP8 (E4M3 values, one E8M0 scale per 32), a per-layer choice beside NVFP4: ``MXFP8`` goes where a ``Recipe``
goes. ``format``: the quantization; ``matmul``: the GEMMs of a training step."""

from jax_nvfp4.mxfp8.format import MX_BLOCK, MXArray, dequantize, quantize
from jax_nvfp4.mxfp8.matmul import MXFP8

__all__ = ["MXFP8", "MX_BLOCK", "MXArray", "dequantize", "quantize"]
