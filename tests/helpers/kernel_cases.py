"""The cases that compare kernels with the reference, and kernels with kernels (CPU, CUDA on the host model, GPU):
random inputs and options, the row-scaled and 4over6 option table, the recipe's option table, the jitted
reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from jax_nvfp4 import QuantizeSpec, reference
from jax_nvfp4.core import bits

from .core import DTYPES, SPECIAL_VALUES, random_tensor
from .numpy_eval import evaluate

# ---- the public quantize: random tensors and options ----


@st.composite
def tensors(draw, max_dim: int = 70):
    """Tensors of rank 2 to 4, of any dtype, spread and special values."""
    rank = draw(st.integers(2, 4))
    lead = [draw(st.integers(1, 5)) for _ in range(rank - 2)]
    shape = (*lead, draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim)))
    dtype = draw(st.sampled_from(DTYPES))
    specials = tuple(draw(st.sets(st.sampled_from(sorted(SPECIAL_VALUES)))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 2.0, 12.0]))
    return random_tensor(rng, shape, dtype, spread=spread, specials=specials, frac=draw(st.sampled_from([0.01, 0.3])))


# quantize()'s layout options: either copy or both, 1x16 or 16x16 blocks.
quantize_options = st.fixed_dictionaries(
    {
        "rowwise": st.booleans(),
        "columnwise": st.booleans(),
        "block_2d": st.booleans(),
    }
).filter(lambda o: o["rowwise"] or o["columnwise"])

# The recipe's options on the quantize kernels; "stochastic_rounding" takes a fixed key.
RECIPE_OPTIONS = {
    "rht": {"rht": True},
    "rht-estimate": {"rht": True, "rht_amax_factor": 2.0},
    "sr": {"stochastic_rounding": True},
    "rht-sr": {"rht": True, "stochastic_rounding": True},
    "sr-16x16": {"block_2d": True, "stochastic_rounding": True},
}

# ---- the kernels' contract (canonical [B, M, N] inputs): row-scaled and 4over6 ----

# The dtypes in the order the option combinations take them.
OPTION_DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32]
SEED = jnp.zeros(2, jnp.uint32)
LAYOUTS = {
    "1x16": {"block_2d": False},
    "16x16": {"block_2d": True},
    "row_scaled": {"block_2d": False, "row_scaled": True},
}
MODES = ("mae", "mse")


def kernel_options(layout: str, fos, *, rowwise=True, columnwise=True, rht=False) -> dict:
    """quantize_core's keyword options: a layout of ``LAYOUTS`` and 4over6 (mode, fast_math, e4m3_max) or None."""
    opts = {"rowwise": rowwise, "columnwise": columnwise, "rht": rht, "stochastic_rounding": False, "row_scaled": False}
    opts |= LAYOUTS[layout]
    if fos is not None:
        mode, fast_math, e4m3_max = fos
        opts |= {"four_over_six_error": mode, "four_over_six_fast_math": fast_math, "e4m3_max": e4m3_max}
    return opts


def option_entries(rng, shape, dtype) -> jax.Array:
    """Three batch entries: wide-range values; with zeros, subnormals, tiny values and outliers; with inf and NaN."""
    plain = random_tensor(rng, shape, dtype, spread=3.0, specials=(), frac=0)
    small = random_tensor(rng, shape, dtype, spread=6.0, specials=("zero", "subnormal", "tiny", "outlier"), frac=0.2)
    bad = random_tensor(rng, shape, dtype, spread=2.0, specials=("inf", "nan"), frac=0.01)
    return jnp.asarray(np.stack([plain, small, bad]))


# Every pair of settings at least once (a covering array): 1x16 (row_scaled, mode, fast_math, e4m3_max), then
# 16x16 (mode, fast_math, e4m3_max); and each layout without 4over6.
_PAIRWISE_1D = [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)]
_PAIRWISE_2D = [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
COMBINATIONS = (
    [(layout, None) for layout in LAYOUTS]
    + [("row_scaled" if rs else "1x16", (MODES[m], bool(f), (448, 256)[e])) for rs, m, f, e in _PAIRWISE_1D]
    + [("16x16", (MODES[m], bool(f), (448, 256)[e])) for m, f, e in _PAIRWISE_2D]
)
COMBINATION_IDS = [f"{lay}-{fos}" for lay, fos in COMBINATIONS]


@st.composite
def option_quantize_cases(draw):
    """(x [B, M, N], kernel options, amax scale): a layout, 4over6 or not, either copy or both, the RHT on some
    columnwise 1x16 copies; random values; the tensor's own amaxes, or other numbers (each copy scaled
    differently, or a special value)."""
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    fos = draw(
        st.one_of(st.none(), st.tuples(st.sampled_from(["mae", "mse"]), st.booleans(), st.sampled_from([448, 256])))
    )
    rowwise, columnwise = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    rht = layout != "16x16" and columnwise and draw(st.booleans())
    opts = kernel_options(layout, fos, rowwise=rowwise, columnwise=columnwise, rht=rht)
    rows = 16 * draw(st.integers(1, 3)) if rht else draw(st.integers(1, 70))
    shape = (draw(st.integers(1, 2)), rows, draw(st.integers(1, 80)))
    specials = tuple(draw(st.sets(st.sampled_from(sorted(SPECIAL_VALUES)))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 2.0, 12.0]))
    frac = draw(st.sampled_from([0.01, 0.3]))
    dtype = draw(st.sampled_from(OPTION_DTYPES))
    x = jnp.asarray(random_tensor(rng, shape, dtype, spread=spread, specials=specials, frac=frac))
    # The amaxes: the tensor's own, or other numbers (each copy scaled differently, or a special value).
    scale = draw(st.sampled_from([None, (0.25, 3.0), (0.0, np.inf), (np.nan, 1.0)]))
    return x, opts, scale


def quantize_with_options(opts: dict, scale=None):
    """(backend, x [B, M, N]) -> (amax, amax_t, *quantize outputs): the backend's amaxes (each scaled by
    ``scale``, if given), then its quantize with these options."""

    def run(backend, x):
        amaxes = backend.amax(x, amax_mesh_axes=None, rht_amax=opts["rht"], per_row=opts["row_scaled"])
        amax, amax_t = amaxes if len(amaxes) == 2 else amaxes * 2
        if scale is not None:
            # inf * 0 is a NaN whose bits are the backend's (x86 and a GPU differ): made the canonical one,
            # so that the NaN bytes compared are the kernels' own.
            amax, amax_t = (
                bits.from_bits(bits.canonical_nan(bits.to_bits(a * np.float32(s))))
                for a, s in zip((amax, amax_t), scale, strict=True)
            )
        return amax, amax_t, *backend.quantize(x, amax, amax_t, SEED, spec=QuantizeSpec(**opts))

    return run


# ---- the reference on the kernels' contract, run by NumPy (numpy_eval: no XLA compile for each drawn shape) ----


def reference_amax(x, *, rht_amax: bool = False, per_row: bool = False):
    """reference.amax_core, run by NumPy."""
    return evaluate(reference.amax_core, x, rht_amax=rht_amax, per_row=per_row)


def reference_quantize(x, amax, amax_t, seed, **opts):
    """reference.quantize_core with these keyword options, run by NumPy."""
    return evaluate(reference.quantize_core, x, amax, amax_t, seed, spec=QuantizeSpec(**opts))
