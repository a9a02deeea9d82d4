"""Flax layers with NVFP4 GEMMs (linen). Needs ``pip install "jax_nvfp4[flax]"``."""

from jax_nvfp4.flax.linen import RNG_STREAM, NVFP4Dense, NVFP4DenseGeneral, NVFP4DotGeneral

__all__ = ["RNG_STREAM", "NVFP4Dense", "NVFP4DenseGeneral", "NVFP4DotGeneral"]
