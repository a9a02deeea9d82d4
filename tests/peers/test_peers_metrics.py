"""benchmarks/peers.py: its error metrics, and the round trips it measures (jax_nvfp4's always; Qwix's where
Qwix is installed, which CI does not do)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import peers


def test_error_metrics_of_exact_and_lost_round_trips():
    x = np.arange(1, 65, dtype=np.float32).reshape(2, 32)
    assert peers.error_metrics(x, x) == dict.fromkeys(peers.METRICS, 0.0)
    assert peers.error_metrics(x, np.zeros_like(x)) == dict.fromkeys(peers.METRICS, 1.0)
    # One of the four blocks saturated at 0.5x, one with its max 0.95x (not cut), one zeroed.
    y = x.copy()
    y[0, :16] = np.minimum(x[0, :16], 8.0)
    y[0, 15] = 0.95 * x[0, 15]
    y[0, 16:] = np.minimum(x[0, 16:], 16.0)
    y[1, :16] = 0.0
    m = peers.error_metrics(x, y)
    assert m["blocks zeroed"] == 0.25
    assert m["block max cut"] == 0.5  # the zeroed block and the one at 0.5x
    assert m["max error / amax"] == pytest.approx(48 / 64)
    assert m["rel. RMS error"] == pytest.approx(np.linalg.norm(y - x) / np.linalg.norm(x))


def test_error_metrics_cover_any_float32_magnitude_and_reject_bad_input():
    x = np.full((1, 16), 3e38, np.float32)
    assert peers.error_metrics(x, x * np.float32(0.5))["rel. RMS error"] == pytest.approx(0.5)
    tiny = np.full((1, 16), 1e-30, np.float32)  # its square underflows in float32
    assert peers.error_metrics(tiny, tiny * np.float32(0.5))["rel. RMS error"] == pytest.approx(0.5)
    assert np.isnan(peers.error_metrics(x, np.full_like(x, np.nan))["rel. RMS error"])
    with pytest.raises(ValueError, match="16"):
        peers.error_metrics(np.ones((2, 8)), np.ones((2, 8)))
    with pytest.raises(ValueError, match="zeros"):
        peers.error_metrics(np.zeros((1, 16)), np.zeros((1, 16)))


@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1.0, 1e6, 1e30])
def test_jax_nvfp4_round_trip_error_does_not_depend_on_magnitude(magnitude):
    z = np.asarray(jax.random.normal(jax.random.key(0), (32, 256), jnp.float32))
    x = (z * magnitude).astype(jnp.bfloat16)
    m = peers.error_metrics(x, peers.ours_roundtrip(x))
    assert 0.08 < m["rel. RMS error"] < 0.11, m
    assert m["blocks zeroed"] == 0.0 and m["block max cut"] == 0.0, m


def test_qwix_nvfp4_scales_1x16_blocks_with_no_global_scale():
    pytest.importorskip("qwix")
    z = np.asarray(jax.random.normal(jax.random.key(0), (32, 256), jnp.float32))
    q = peers.qwix_quantize(z.astype(jnp.bfloat16))
    assert q.scale.shape == (32, 256 // 16)  # one scale per row and 16 columns: like for like
    ordinary = peers.error_metrics(z, peers.qwix_roundtrip(z, jnp.float32))
    assert 0.08 < ordinary["rel. RMS error"] < 0.11, ordinary
    tiny = peers.error_metrics(z * 1e-6, peers.qwix_roundtrip(z * 1e-6, jnp.float32))
    assert tiny["blocks zeroed"] == 1.0, tiny
    huge = peers.error_metrics(z * 1e6, peers.qwix_roundtrip(z * 1e6, jnp.float32))
    assert huge["block max cut"] == 1.0, huge
