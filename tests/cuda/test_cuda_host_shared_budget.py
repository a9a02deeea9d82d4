"""The quantize kernels fit every GPU's shared memory (ffi/cuda/quantize.cu, dynamic_shared_of): on sm_120
(consumer Blackwell, 99 KB a block) float32's values take 64 KB beside the static tables, so those kernels
stage one tile instead of two, and the ring falls back on the direct kernel where it does not fit beside
them (stochastic rounding's 64 KB position table did the same until its positions became arithmetic). Same
bytes as the CPU kernels, on the host model, which holds each launch to the emulated GPU's opt-in maximum
(ffi/cuda/host/runtime.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_same_tree, random_normal
from helpers.counters import quantize_launches
from helpers.cuda_host import needs_module

import jax_nvfp4

pytestmark = needs_module

MODES = {
    "nearest": dict(columnwise=True),
    "stochastic": dict(columnwise=True, rng_key=jax.random.key(4)),
    "4over6": dict(columnwise=True, four_over_six_error="mse", e4m3_max=256),
    "16x16": dict(columnwise=True, block_2d=True),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def quantize_paths(x, sm, **options):
    """cuda_host.quantize(x) on emulated sm: (result, {kernel name: its code paths})."""
    got, launches = quantize_launches(x, sm, **options)
    return got, {launch.kernel: launch.paths for launch in launches if "quantize" in launch.kernel}


def staging(paths: dict[str, dict[str, int]]) -> set[str]:
    return {p for kernel_paths in paths.values() for p in kernel_paths if p.startswith("staging")}


@pytest.mark.parametrize("ring", [False, True], ids=["direct", "ring asked"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", list(MODES))
def test_sm120_quantizes_every_mode_in_its_99_kb(mode, dtype, ring, monkeypatch):
    if ring:
        monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", "ring")
    options = MODES[mode]
    x = random_normal((3, 200, 600), 21, DTYPES[dtype])  # several tiles a block, ragged edges
    got, paths = quantize_paths(x, 120, **options)
    assert_same_tree(got, jax.jit(lambda x: jax_nvfp4.quantize(x, **options))(x))
    # The ring (two 32 KB stages) fits beside one staged tile in every mode; float32's (two 64 KB stages, its
    # values) does not.
    big_table = dtype == "float32"
    ring_ran = any("quantize_ring_kernel" in kernel for kernel in paths)
    assert ring_ran == (ring and not big_table), paths
    # 64 KB of values or ring leave room for one staged tile; the others keep two.
    assert staging(paths) == {"staging: one tile" if big_table or ring_ran else "staging: two tiles"}, paths


@pytest.mark.parametrize("sm", [90, 100])
def test_hopper_and_datacenter_blackwell_stage_two_tiles(sm, monkeypatch):
    monkeypatch.setenv("NVFP4_QUANTIZE_LOAD", "ring")
    x = random_normal((256, 1024), 22, jnp.bfloat16)
    _, paths = quantize_paths(x, sm, columnwise=True, rng_key=jax.random.key(5))
    assert staging(paths) == {"staging: two tiles"}, paths
    assert any("quantize_ring_kernel" in kernel for kernel in paths), paths
