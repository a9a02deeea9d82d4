"""Writes the stochastic-rounding test vectors tests/golden/sr_*.npz with the pure-JAX reference.

Run from the repository root: ``PYTHONPATH=. python tests/golden/make_sr_vectors.py``. TransformerEngine's golden
files (the other .npz files here) have no stochastic rounding; these are the project's own, made by
``jax_nvfp4.reference`` (``amax_core`` and ``quantize_core``, on the kernels' contract [B, M, N]) from fixed inputs
(numpy's ``default_rng``) and a fixed Philox key. Regenerate them only when the random stream or the encode
changes on purpose (``jax_nvfp4.reference.stochastic``); tests/rht_sr/test_sr_vectors.py checks that the
reference and the kernels reproduce every byte. Layout: tests/golden/README.md.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_nvfp4 import QuantizeSpec, reference

OUT_DIR = pathlib.Path(__file__).resolve().parent
DTYPE_NAMES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}

# name: (batch, rows, cols, input dtype, options, Philox key, input seed, note). Every case rounds stochastically.
SR_CASES = {
    "sr_1d_pad_40x48_bf16": (
        1, 40, 48, "bfloat16", dict(columnwise=True), (0x00000000, 0x00000000), 2001,
        "1x16, both copies; M = 40 pads the columnwise copy's last block; the all-zero key",
    ),
    "sr_1d_32x64_fp32": (
        1, 32, 64, "float32", dict(columnwise=True), (0xFFFFFFFF, 0xFFFFFFFF), 2002,
        "1x16, both copies, float32 input with zeros, -0.0, subnormals and tiny negatives; the all-ones key",
    ),
    "sr_1d_128x192_bf16": (
        1, 128, 192, "bfloat16", dict(columnwise=True), (0x243F6A88, 0x85A308D3), 2003,
        "1x16, both copies, several blocks and rows of each",
    ),
    "sr_rht_64x128_bf16": (
        1, 64, 128, "bfloat16", dict(columnwise=True, rht=True), (0x13198A2E, 0x03707344), 2004,
        "RHT + SR: the rowwise copy of x and the columnwise copy of the transform of x^T (amax_t: its amax)",
    ),
    "sr_2d_pad_40x40_bf16": (
        1, 40, 40, "bfloat16", dict(columnwise=True, block_2d=True), (0xA4093822, 0x299F31D0), 2005,
        "16x16 blocks, padded both ways: one draw a value (the rowwise stream of the padded tiles), both copies",
    ),
    "sr_2d_64x64_fp32": (
        1, 64, 64, "float32", dict(columnwise=True, block_2d=True), (0x082EFA98, 0xEC4E6C89), 2006,
        "16x16 blocks, float32 input",
    ),
    "sr_1d_b2_48x80_bf16": (
        2, 48, 80, "bfloat16", dict(columnwise=True), (0x452821E6, 0x38D01377), 2007,
        "1x16, both copies, a batch of 2 entries (counter word 2 = the entry), each with its own amax; "
        "entry 1 has zeros, subnormals, tiny values and outliers",
    ),
}  # fmt: skip


def sr_input(rng: np.random.Generator, shape: tuple[int, int, int], dtype, *, specials: bool) -> np.ndarray:
    """Normal values times 10**U(-1.5, 1.5), 1% exact zeros; with ``specials`` (float32 case, batch entry 1)
    also -0.0, subnormals, tiny values and outliers. Exact in ``dtype``, returned as float32."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-1.5, 1.5, shape)
    x = np.where(rng.random(shape) < 0.01, 0.0, x)
    if specials:
        pool = np.array([-0.0, 1e-39, -1e-39, 1e-45, -1e-6, -1e-30, 1e-20, 3e3, -2e4], np.float64)
        mask = (rng.random(shape) < 0.05) & (np.arange(shape[0]) >= shape[0] - 1)[:, None, None]
        x = np.where(mask, rng.choice(pool, size=shape), x)
    return x.astype(np.float32).astype(dtype).astype(np.float32)


def sr_vector(name: str) -> dict[str, np.ndarray]:
    """The arrays of case ``name``: inputs, options and every output byte of the reference."""
    bsz, rows, cols, dtype_name, options, key, input_seed, note = SR_CASES[name]
    dtype = DTYPE_NAMES[dtype_name]
    rng = np.random.default_rng(input_seed)
    x = sr_input(rng, (bsz, rows, cols), dtype, specials=dtype_name == "float32" or bsz > 1)
    spec = QuantizeSpec(stochastic_rounding=True, **options)
    xj = jnp.asarray(x).astype(jnp.dtype(dtype))
    amaxes = jax.jit(reference.amax_core, static_argnames="rht_amax")(xj, rht_amax=spec.rht)
    amax, amax_t = amaxes[0], amaxes[-1]
    seed = np.array(key, np.uint32)
    outs = jax.jit(reference.quantize_core, static_argnames="spec")(xj, amax, amax_t, jnp.asarray(seed), spec=spec)
    data, scale, data_t, scale_t = (np.asarray(o) for o in outs)
    return {
        "x": x,
        "input_dtype": np.array(dtype_name),
        "input_seed": np.array(input_seed),
        "seed": seed,
        "rowwise": np.array(spec.rowwise),
        "columnwise": np.array(spec.columnwise),
        "block_2d": np.array(spec.block_2d),
        "rht": np.array(spec.rht),
        "amax": np.asarray(amax, np.float32),
        "amax_t": np.asarray(amax_t, np.float32),
        "data": data,
        "scale": scale.view(np.uint8),
        "data_t": data_t,
        "scale_t": scale_t.view(np.uint8),
        "note": np.array(note),
    }


def write_sr_vectors() -> None:
    for name in SR_CASES:
        path = OUT_DIR / f"{name}.npz"
        np.savez_compressed(path, **sr_vector(name))
        print(f"{path.relative_to(OUT_DIR.parents[1])}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    write_sr_vectors()
