"""The golden files (tests/golden/, made by TransformerEngine's reference quantizer): their cases, loading, and
the check of a quantization against one. The project's own stochastic-rounding vectors (sr_*.npz, made by
tests/golden/make_sr_vectors.py) have another layout: ``sr_cases`` lists them, and TransformerEngine's cases
leave them out."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import QuantizeSpec

GOLDEN_DIR = pathlib.Path(__file__).parents[1] / "golden"


def _plain(g) -> bool:
    """Plain 1x16 / 16x16 NVFP4 and the RHT: neither row-scaled nor 4over6."""
    return not (bool(g["row_scaled"]) or bool(g["use_4over6"]))


def _input_files() -> list[str]:
    """TransformerEngine's files with an input (not hadamard16.npz, nor the sr_* vectors)."""
    return sorted(p.name for p in GOLDEN_DIR.glob("*.npz") if not p.name.startswith("sr_") and "x" in np.load(p))


def sr_cases() -> list[str]:
    """The stochastic-rounding vectors (tests/golden/make_sr_vectors.py)."""
    return sorted(p.name for p in GOLDEN_DIR.glob("sr_*.npz"))


def cases() -> list[str]:
    """The plain and RHT cases."""
    return [name for name in _input_files() if _plain(np.load(GOLDEN_DIR / name))]


def option_cases() -> list[str]:
    """The row-scaled and 4over6 cases."""
    return [name for name in _input_files() if not _plain(np.load(GOLDEN_DIR / name))]


def family(name: str) -> tuple[str, str]:
    """A golden file's family: its kind (1d, 2d, edge, rht, rowscaled, 4o6_1d, 4o6sel_2d, ...) and input dtype.
    The files of a family run one program on different shapes and values."""
    parts = name.removesuffix(".npz").split("_")
    return "_".join(parts[:2]) if name.startswith("4o6") else parts[0], parts[-1]


def one_per_family() -> list[str]:
    """The smallest golden file of each family (every kind and input dtype once), and of 4over6's families also
    the last by name (MSE and fast math where the smallest has MAE and exact math)."""
    files: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for name in cases() + option_cases():
        files.setdefault(family(name), []).append((np.load(GOLDEN_DIR / name)["x"].size, name))
    chosen = {min(group)[1] for group in files.values()}
    chosen |= {max(group, key=lambda f: f[1])[1] for kind, group in files.items() if kind[0].startswith("4o6")}
    return sorted(chosen)


def load(name: str):
    """(the file, x in its input dtype, quantize options); options beyond the plain ones only where set."""
    g = np.load(GOLDEN_DIR / name)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[str(g["input_dtype"])]
    options = {
        "rowwise": bool(g["rowwise"]),
        "columnwise": bool(g["columnwise"]),
        "block_2d": tuple(int(v) for v in g["tile_shape"]) == (16, 16),
    }
    if bool(g["with_rht"]):
        options["rht"] = True
    if bool(g["row_scaled"]):
        options["row_scaled"] = True
    if bool(g["use_4over6"]):
        # err_mode, fast_math and e4m3_max take effect only with 4over6 (the reference forces 448 without).
        options["four_over_six_error"] = str(g["err_mode"]).lower()
        options["four_over_six_fast_math"] = bool(g["fast_math"])
        options["e4m3_max"] = int(g["e4m3_max"])
    return g, jnp.asarray(g["x"]).astype(dtype), options


def _as_stored(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def assert_golden(g, columnwise: bool, data, scale, amax, data_t=None, scale_t=None, amax_t=None):
    """A quantization's arrays are golden file ``g``'s, byte for byte."""
    m, n = g["x"].shape
    # The reference crops data to N//2 bytes and keeps padded scale rows; the
    # goldens all have even N, and padded 2D scale rows repeat the last block.
    np.testing.assert_array_equal(_as_stored(data), g["data"])
    np.testing.assert_array_equal(_as_stored(scale), g["scale"][:m])
    # One float32 (a [1] array in the file), or one per row when row-scaled.
    assert np.asarray(amax, np.float32).tobytes() == g["amax_row"].astype(np.float32).tobytes()
    if columnwise:
        np.testing.assert_array_equal(_as_stored(data_t), g["data_t"])
        np.testing.assert_array_equal(_as_stored(scale_t), g["scale_t"][:n])
        assert np.asarray(amax_t, np.float32).tobytes() == g["amax_col"].astype(np.float32).tobytes()


def load_sr(name: str):
    """A stochastic-rounding vector: (the file, x [B, M, N] in its input dtype, amax [B], amax_t [B], the Philox
    seed uint32 [2], its QuantizeSpec), the arguments of a backend's quantize (``core.backend.Backend``)."""
    g = np.load(GOLDEN_DIR / name)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[str(g["input_dtype"])]
    flags = ("rowwise", "columnwise", "block_2d", "rht")
    spec = QuantizeSpec(stochastic_rounding=True, **{k: bool(g[k]) for k in flags})
    x = jnp.asarray(g["x"]).astype(dtype)
    return g, x, jnp.asarray(g["amax"]), jnp.asarray(g["amax_t"]), jnp.asarray(g["seed"]), spec


def sr_vector_run(backend, spec: QuantizeSpec):
    """(x, amax, amax_t, seed) -> (``backend``'s amaxes of x, its quantize of x with the given amaxes and seed),
    for a vector's arguments (``load_sr``) and a backend (``core.backend.Backend``): what ``assert_sr_vector``
    checks."""

    def run(x, amax, amax_t, seed):
        amaxes = backend.amax(x, amax_mesh_axes=None, rht_amax=spec.rht, per_row=False)
        return amaxes, backend.quantize(x, amax, amax_t, seed, spec=spec)

    return run


def assert_sr_vector(g, amaxes, outs):
    """A backend's amaxes (``amax(x, rht_amax=spec.rht)``) and quantize outputs are vector ``g``'s, byte for byte."""
    assert np.asarray(amaxes[0]).tobytes() == g["amax"].tobytes()
    assert np.asarray(amaxes[-1]).tobytes() == g["amax_t"].tobytes()
    names = ["data", "scale"] * bool(g["rowwise"]) + ["data_t", "scale_t"] * bool(g["columnwise"])
    assert len(outs) == len(names)
    for name, out in zip(names, outs, strict=True):
        got = _as_stored(out)
        assert got.shape == g[name].shape and got.dtype == g[name].dtype, (name, got.shape, g[name].shape)
        diff = got != g[name]
        assert not diff.any(), f"{name}: {diff.sum()} of {diff.size} bytes differ"
