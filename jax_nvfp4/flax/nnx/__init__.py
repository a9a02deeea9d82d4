"""Flax NNX: ``NVFP4DotGeneral`` (an NVFP4 ``dot_general`` that keeps its own RNG stream), the NNX layers,
conversion of a model by rules, diagnostics and the mixture-of-experts MLP.

Importable apart from the linen layers (``jax_nvfp4.flax`` does not import NNX).
"""

from jax_nvfp4.core.deprecation import renamed
from jax_nvfp4.flax.nnx.layers import (
    RNG_STREAM,
    NVFP4DotGeneral,
    NVFP4Einsum,
    NVFP4Linear,
    NVFP4LinearGeneral,
    NVFP4RaggedDot,
    WeightCache,
    cache_weights,
    quantize_model,
    quantize_weights,
)
from jax_nvfp4.flax.nnx.moe import MoEMLP

__all__ = [
    "RNG_STREAM",
    "MoEMLP",
    "NVFP4DotGeneral",
    "NVFP4Einsum",
    "NVFP4Linear",
    "NVFP4LinearGeneral",
    "NVFP4RaggedDot",
    "WeightCache",
    "cache_weights",
    "quantize_model",
    "quantize_weights",
]

__getattr__ = renamed(__name__, {"quantize_params": "quantize_weights", "cached_weights": "cache_weights"}, globals())
