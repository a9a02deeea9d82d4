"""Which quantization options the spec defines, and which combinations of them.

One home for the rule, shared by the public frontend (which checks before any
work) and the reference core (which the kernels must match).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jax_nvfp4.formats import INPUT_DTYPES
from jax_nvfp4.tensor import NVFP4Tensor

FOUR_OVER_SIX_MODES = ("mae", "mse")
"""4over6 error measures: the block's candidate with the smaller mean absolute / squared error wins."""

E4M3_MAX_CHOICES = (448, 256)
"""Block-scale ranges the global scale may aim at; 256 only with 4over6."""


def check_flag(name: str, value) -> bool:
    """An on/off option as a Python bool. Options are static (they pick the kernel), so a traced or
    array value, or a truthy stand-in like "yes" or 1, is a TypeError that names the option, raised
    before anything reaches the FFI."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return bool(value)


def check_choice(name: str, value, choices: tuple, expected: str | None = None):
    """``value`` if it is one of ``choices``, compared with its type (448.0 and True are not 448), else
    ValueError naming the option and ``expected`` (default: the choices)."""
    if isinstance(value, np.integer | np.str_):
        value = value.item()
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{name} must be {expected or f'one of {choices}'}, got {value!r}")
    return value


def check_positive_factor(name: str, value) -> float:
    """A positive finite real number (not a bool) as a float, else ValueError naming the option."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if not (real and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_mesh_axes(name: str, axes) -> tuple[str, ...] | None:
    """None, or mesh axis names (one str or a sequence of them) as a tuple, else TypeError naming the option."""
    if axes is None:
        return None
    axes = tuple(axes) if isinstance(axes, Sequence) and not isinstance(axes, str) else (axes,)
    if not all(isinstance(a, str) for a in axes):
        raise TypeError(f"{name} must be mesh axis names (str), got {axes!r}")
    return axes


def check_out_dtype(dtype, option: str = "dtype", owner: str = "dequantize") -> np.dtype:
    """A result dtype: bfloat16, float16 or float32, else a TypeError naming the option and its owner."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = repr(dtype)
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"{owner} produces bfloat16, float16 or float32: {option} is {dtype}")
    return dtype


def check_real(name: str, value) -> None:
    """TypeError naming the option unless ``value`` is a real number or an array(-like) of them
    (integer or floating; not bool, complex or a string, which jnp.result_type would read as a dtype name)."""
    try:
        dtype = None if isinstance(value, str | bytes) else jnp.result_type(value)
    except TypeError:
        dtype = None
    if dtype is None or not any(jnp.issubdtype(dtype, kind) for kind in (jnp.floating, jnp.integer)):
        raise TypeError(f"{name} must be an array of real numbers (or one number), got {dtype or type(value).__name__}")


def check_tensor(name: str, t) -> NVFP4Tensor:
    """``t`` if it is an NVFP4Tensor, else TypeError naming the argument."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"{name} must be an NVFP4Tensor (from quantize), got {type(t).__name__}")
    return t


def check_options(*, block_2d: bool, stochastic: bool, row_scaled: bool, four_over_six, e4m3_max: int) -> int:
    """Raise ValueError for option combinations the spec does not define; returns e4m3_max as an int."""
    if row_scaled and block_2d:
        raise ValueError("row-scaled NVFP4 has 1x16 blocks only (block_2d=False)")
    if four_over_six is not None:
        check_choice("four_over_six", four_over_six, FOUR_OVER_SIX_MODES, f"None or one of {FOUR_OVER_SIX_MODES}")
    if four_over_six is not None and stochastic:
        raise ValueError("4over6 picks between round-to-nearest candidates: no stochastic rounding with it")
    e4m3_max = check_choice("e4m3_max", e4m3_max, E4M3_MAX_CHOICES, "448 or 256")
    if e4m3_max != 448 and four_over_six is None:
        # TransformerEngine's reference silently uses 448 here; an explicit error instead.
        raise ValueError("e4m3_max=256 applies only with 4over6 (four_over_six='mae' or 'mse')")
    return e4m3_max
