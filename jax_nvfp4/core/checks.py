"""Checks of single arguments, each raising an error that names the argument.

Options are static (they pick the kernel), so each is checked in Python before
anything is traced. Combinations of quantization options are the business of
``QuantizeSpec.validate`` alone.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.core.formats import INPUT_DTYPES


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


def mesh_axis_names(x) -> tuple[str, ...] | None:
    """The axes of the mesh ``x`` is computed on, where that is known while tracing: the current mesh
    (``jax.set_mesh``, ``shard_map``), else the mesh of ``x``'s sharding (of a concrete array: () if it
    has none). None where it is not known yet: a traced ``x`` typed with no mesh may still run on one
    (``jit(..., in_shardings=...)``), which ``unknown_mesh_axes`` checks when the op is partitioned."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return tuple(context.axis_names)
    if isinstance(x, jax.core.Tracer):
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        return None if mesh is None or mesh.empty else tuple(mesh.axis_names)
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.mesh.axis_names) if isinstance(sharding, jax.sharding.NamedSharding) else ()


def unknown_mesh_axes(name: str, axes: tuple[str, ...] | None, mesh_axes: tuple[str, ...] | None) -> None:
    """ValueError naming the axes of ``axes`` that ``mesh_axes`` (the mesh's axis names; () with no mesh)
    lacks, and the mesh's axes; nothing if ``mesh_axes`` is None (not known yet)."""
    if axes is None or mesh_axes is None:
        return
    missing = tuple(a for a in axes if a not in mesh_axes)
    if not missing:
        return
    if not mesh_axes:
        raise ValueError(
            f"{name}={axes!r} names mesh axes, but there is no mesh here (mesh axes: none): it scopes the "
            "amax reduction under jit on a mesh (jax.set_mesh, shard_map, or x sharded over one); pass None"
        )
    raise ValueError(f"{name}={axes!r}: the mesh has no axis {', '.join(map(repr, missing))} (its axes: {mesh_axes})")


def check_amax_values(amax) -> None:
    """ValueError naming ``amax`` where a concrete given amax (a scalar, or per-row amaxes) is negative
    (-0.0 included: its sign would reach the block scales) or NaN. A traced amax cannot be read, so it is
    not checked: it quantizes as the kernels do with its value (docs/quantization.md, "What bad input does")."""
    if isinstance(amax, jax.core.Tracer):
        return
    values = np.asarray(amax, np.float32)
    bad = np.isnan(values) | np.signbit(values)
    if not bad.any():
        return
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    value = float(values[index])
    where = f" at index {index}" if index else ""
    why = " (negative zero: its sign bit would reach the block scales; pass 0.0)" if value == 0 else ""
    raise ValueError(f"amax must be >= 0 and not NaN (it stands for max|x|), got {value!r}{where}{why}")


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


def check_key(key, name: str) -> jax.Array:
    """One JAX PRNG key (typed, or a raw uint32 [2] key), else an error naming the option ``name``."""
    if not isinstance(key, jax.Array | np.ndarray):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key), got {type(key).__name__}")
    key = jnp.asarray(key)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and (key.dtype != jnp.uint32 or key.shape != (2,)):
        raise TypeError(f"{name} must be a JAX PRNG key (jax.random.key), got {key.dtype}{key.shape}")
    if key.shape != () and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name} must be one key, got shape {key.shape}")
    return key
