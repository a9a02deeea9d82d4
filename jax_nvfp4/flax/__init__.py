"""Flax layers with NVFP4 GEMMs (linen), and rules that convert a model you did not write.

Needs ``pip install "jax_nvfp4[flax]"``. The linen modules live in ``jax_nvfp4.flax.linen`` (re-exported
here); NNX lives in ``jax_nvfp4.flax.nnx``.
"""

from jax_nvfp4.core.deprecation import renamed
from jax_nvfp4.flax.linen import (
    CACHE,
    RNG_STREAM,
    MoEMLP,
    NVFP4Dense,
    NVFP4DenseGeneral,
    NVFP4DotGeneral,
    NVFP4Model,
    cache_weights,
    nvfp4_rules,
    quantize_model,
    quantize_weights,
)
from jax_nvfp4.flax.rules import Rule, UnmatchedRuleWarning, keep_ends

__all__ = [
    "CACHE",
    "RNG_STREAM",
    "MoEMLP",
    "NVFP4Dense",
    "NVFP4DenseGeneral",
    "NVFP4DotGeneral",
    "NVFP4Model",
    "Rule",
    "UnmatchedRuleWarning",
    "cache_weights",
    "keep_ends",
    "nvfp4_rules",
    "quantize_model",
    "quantize_weights",
]

__getattr__ = renamed(__name__, {"quantize_params": "quantize_weights"}, globals())
