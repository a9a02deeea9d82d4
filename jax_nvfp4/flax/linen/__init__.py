"""Flax linen: the NVFP4 layers (``layers``), conversion of a model by rules (``convert``), diagnostics and
the mixture-of-experts MLP (``moe``). ``jax_nvfp4.flax`` re-exports the names most users need."""

from jax_nvfp4.core.deprecation import renamed
from jax_nvfp4.flax.linen.convert import NVFP4Model, nvfp4_rules, quantize_model
from jax_nvfp4.flax.linen.layers import (
    CACHE,
    RNG_STREAM,
    NVFP4Dense,
    NVFP4DenseGeneral,
    NVFP4DotGeneral,
    cache_weights,
    quantize_weights,
)
from jax_nvfp4.flax.linen.moe import MoEMLP

__all__ = [
    "CACHE",
    "RNG_STREAM",
    "MoEMLP",
    "NVFP4Dense",
    "NVFP4DenseGeneral",
    "NVFP4DotGeneral",
    "NVFP4Model",
    "cache_weights",
    "nvfp4_rules",
    "quantize_model",
    "quantize_weights",
]

__getattr__ = renamed(__name__, {"quantize_params": "quantize_weights"}, globals())
