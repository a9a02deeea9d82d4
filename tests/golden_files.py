"""Loading the golden files (tests/golden/, made by TransformerEngine's reference quantizer)."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"


def applicable(g) -> bool:
    """Cases this library's options cover so far: plain 1x16 / 16x16 NVFP4, and the RHT."""
    return not (bool(g["row_scaled"]) or bool(g["use_4over6"]))


def cases() -> list[str]:
    return sorted(p.name for p in GOLDEN_DIR.glob("*.npz") if "x" in np.load(p) and applicable(np.load(p)))


def load(name: str):
    g = np.load(GOLDEN_DIR / name)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[str(g["input_dtype"])]
    options = {
        "rowwise": bool(g["rowwise"]),
        "columnwise": bool(g["columnwise"]),
        "block_2d": tuple(int(v) for v in g["tile_shape"]) == (16, 16),
    }
    if bool(g["with_rht"]):
        options["rht"] = True
    return g, jnp.asarray(g["x"]).astype(dtype), options
