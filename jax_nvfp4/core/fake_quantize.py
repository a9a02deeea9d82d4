"""``fake_quantize``: NVFP4 quantization as values of x's dtype, with a straight-through gradient.

For quantization-aware training (as Qwix's and torchao's fake quantization): the forward pass sees
what NVFP4 makes of x, ``dequantize(quantize(x))``, and the backward pass the identity (the
straight-through estimator), since rounding's own derivative is zero almost everywhere. Built
over a backend's public ``quantize`` and ``dequantize``, as they are (``core.pipeline``), so the
kernels and the reference give the same values.

The gradient is not masked where values clip, because with the default amax (max|x|) none does:
the FP32 global scale maps max|x| to 6 E, the top of the range (E = 448, the largest E4M3 block
scale; 256 with 4over6), so no block scale exceeds E and every value rounds to the nearest of its
block's (a block's largest value, at most 6 x 17/16 of its scale when that scale rounded down, lands
on 6 x the scale, its nearest value anyway). Rounding is all the error there is, and the estimator
passes it straight through. Only a given ``amax`` below max|x| clips values; their gradient passes too
(a caller who wants it masked multiplies by ``|x| <= amax``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jax_nvfp4.core.checks import check_amax_values, check_real
from jax_nvfp4.core.spec import QuantizeSpec


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _straight_through(forward: Callable, x: jax.Array, amax, rng_key) -> jax.Array:
    return forward(x, amax, rng_key)


@_straight_through.defjvp
def _straight_through_jvp(forward: Callable, primals, tangents):
    x, amax, rng_key = primals
    # The cotangent passes to x unchanged; amax is a constant of the quantization (no gradient).
    return _straight_through(forward, x, amax, rng_key), tangents[0]


def fake_quantize_fn(quantize: Callable, dequantize: Callable) -> Callable:
    """``fake_quantize`` over a backend's public ``quantize`` and ``dequantize``."""

    def fake_quantize(
        x: jax.Array,
        spec: QuantizeSpec | None = None,
        *,
        amax: jax.Array | float | None = None,
        rng_key: jax.Array | None = None,
        **options,
    ) -> jax.Array:
        """``dequantize(quantize(x))`` in x's dtype, with the identity as its gradient (straight-through).

        For quantization-aware training: the forward pass sees NVFP4's values of ``x``, the backward
        pass gets the cotangent unchanged (rounding's own derivative is zero almost everywhere).

        Args:
          x: bfloat16, float16 or float32, rank >= 2, as ``quantize`` takes it.
          spec, amax, rng_key, options: as ``quantize`` takes them. The spec holds one copy: the
            rowwise one (the default), or the columnwise one (``rowwise=False, columnwise=True``:
            blocks of 16 along the rows, not with ``rht``, which ``dequantize`` refuses). Stochastic
            rounding needs ``rng_key``, as in ``quantize``.

        Returns an array of x's shape and dtype: ``dequantize(quantize(x, ...), x.dtype)``, bit for bit.
        The gradient with respect to ``x`` is the cotangent, exactly; ``amax`` gets none (it is a
        constant of the quantization). It is not masked where values clip: with ``amax=None`` none
        does (the global scale maps max|x| to the top of the range); a given ``amax`` below max|x|
        clips the values above it, and their gradient still passes. Forward mode (``jax.jvp``) passes
        the tangent likewise.
        """
        if amax is not None:  # here, where a given value may still be concrete (inside, it is traced)
            check_real("amax", amax)
            check_amax_values(amax)

        def forward(x, amax, rng_key):
            t = quantize(x, spec, amax=amax, rng_key=rng_key, **options)
            if t.spec.rowwise and t.spec.columnwise:
                raise ValueError(
                    "fake_quantize returns one quantization of x: a spec with the rowwise copy alone (the "
                    "default) or the columnwise one alone (rowwise=False, columnwise=True), not both"
                )
            return dequantize(t, dtype=t.dtype, columnwise=t.spec.columnwise)

        return _straight_through(forward, x, amax, rng_key)

    return fake_quantize
