"""GPU against CPU quantize bytes, case by case: a table that localizes a mismatch in seconds.

Every case (dtype x shape x copies) runs the public ``quantize`` twice on the GPU and once on the CPU and
prints, per output field that differs, how many bytes differ (NONDET: the two GPU runs differ), then the
rows and byte columns of the first few mismatching fields. Shapes end in partial tiles and partial
warps (rows not a multiple of 16 or 64) on purpose. tests/cuda/test_cuda.py is the pass/fail check;
this is the map a fix starts from (`.ci/gpu bytes`).
"""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4

SHAPES = [(1, 16), (16, 16), (17, 16), (40, 48), (63, 256), (64, 256), (65, 272), (2, 33, 48)]
MODES = {
    "row": {"columnwise": False},
    "col": {"rowwise": False, "columnwise": True},
    "both": {"columnwise": True},
    "both2d": {"columnwise": True, "block_2d": True},
    "colSR": {"rowwise": False, "columnwise": True, "rng_key": jax.random.key(5)},
}


def _fields(out) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(out)[0]}


def _raw(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def main() -> None:
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    print("devices:", gpu, cpu, flush=True)
    start, shown, failed = time.time(), 0, 0
    for dtype, shape, (mode, opts) in itertools.product([jnp.bfloat16, jnp.float32], SHAPES, MODES.items()):
        x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
        fn = jax.jit(lambda x, o=opts: jax_nvfp4.quantize(x, **o))
        g1, g2, c = (_fields(fn(jax.device_put(x, d))) for d in (gpu, gpu, cpu))
        bad = []
        for k, want in c.items():
            diff = _raw(g1[k]) != _raw(want)
            nondet = bool((_raw(g1[k]) != _raw(g2[k])).any())
            if not (diff.any() or nondet):
                continue
            bad.append(f"{k}:{diff.sum()}/{diff.size}{' NONDET' if nondet else ''}")
            if shown < 8 and diff.any():
                got2, want2 = g1[k].reshape(-1, g1[k].shape[-1]), want.reshape(-1, want.shape[-1])
                rows, cols = np.nonzero(_raw(got2).reshape(got2.shape[0], -1) != _raw(want2).reshape(got2.shape[0], -1))
                print(
                    f"  {np.dtype(dtype).name} {shape} {mode} {k}: rows {sorted(set(rows.tolist()))[:32]}, "
                    f"bytes {sorted(set(cols.tolist()))[:32]}"
                )
                shown += 1
        failed += bool(bad)
        print(f"{np.dtype(dtype).name:9s} {shape!s:12s} {mode:7s} {' '.join(bad) or 'same bytes'}", flush=True)
    print(f"{failed} cases differ; {time.time() - start:.0f} s")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
