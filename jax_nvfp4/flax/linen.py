"""Flax linen layers: ``nn.Dense`` / ``nn.DenseGeneral`` with NVFP4 GEMMs.

The layers subclass Flax's, so constructor arguments, parameter names, shapes
and initializers are exactly Flax's (a checkpoint of ``nn.Dense`` loads
unchanged); only the GEMM differs. ``NVFP4DotGeneral`` plugs the same GEMM
into any Flax module that takes a ``dot_general_cls``.
"""

from __future__ import annotations

import functools

import flax.linen as nn

from jax_nvfp4.dot import dot_general
from jax_nvfp4.recipe import Recipe


class NVFP4DotGeneral(nn.Module):
    """``lax.dot_general`` in NVFP4, as a module for ``dot_general_cls=``.

    For ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.MultiHeadDotProductAttention``
    (``qkv_dot_general_cls`` / ``out_dot_general_cls``); pass
    ``functools.partial(NVFP4DotGeneral, recipe=...)`` to change the recipe.
    It holds no variables.
    """

    recipe: Recipe = Recipe()

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        """``jax_nvfp4.dot_general`` with this module's recipe."""
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=self.recipe, **kwargs)


class _NVFP4Layer:
    """Mixin: route the parent layer's GEMM through ``NVFP4DotGeneral(recipe)``."""

    def __post_init__(self) -> None:
        ours = isinstance(self.dot_general_cls, functools.partial) and self.dot_general_cls.func is NVFP4DotGeneral
        if self.dot_general is not None or (self.dot_general_cls is not None and not ours):
            raise ValueError(f"{type(self).__name__} computes its GEMM in NVFP4; do not pass dot_general(_cls)")
        # Flax modules are frozen dataclasses; set the field before Module initializes.
        object.__setattr__(self, "dot_general_cls", functools.partial(NVFP4DotGeneral, recipe=self.recipe))
        super().__post_init__()


class NVFP4Dense(_NVFP4Layer, nn.Dense):
    """``nn.Dense`` whose GEMM (forward and backward) runs in NVFP4.

    Same arguments and parameters as ``nn.Dense``, plus ``recipe``.
    """

    recipe: Recipe = Recipe()


class NVFP4DenseGeneral(_NVFP4Layer, nn.DenseGeneral):
    """``nn.DenseGeneral`` whose GEMM (forward and backward) runs in NVFP4.

    Same arguments and parameters as ``nn.DenseGeneral``, plus ``recipe``.
    """

    recipe: Recipe = Recipe()
