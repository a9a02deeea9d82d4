"""Quantize real tensors to NVFP4 and report the error.

Two tensors that every machine has offline: the Grace Hopper photograph that
ships with matplotlib (a [600, 512*3] image, smooth with sharp edges), and the
byte-bigram log-count matrix of the Python standard library's source files
(heavy-tailed, like activations). Each is quantized with 1x16 blocks and with
16x16 blocks, and compared with a per-tensor FP8 E4M3 cast and a bf16 cast.
Writes a PNG of the photograph before and after NVFP4.

    python -m examples.quantize_tensor [--out nvfp4_example.png]
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import jax_nvfp4

matplotlib.use("Agg")
import matplotlib.cbook as cbook
import matplotlib.image as mpimg
import matplotlib.pyplot as plt


def photograph() -> np.ndarray:
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        image = mpimg.imread(f).astype(np.float32) / 255.0  # [600, 512, 3]
    return image.reshape(image.shape[0], -1)


def stdlib_bigrams() -> np.ndarray:
    """log1p of byte-bigram counts over the standard library's .py files, centred."""
    counts = np.zeros((256, 256), np.int64)
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for path in files:
        b = np.frombuffer(path.read_bytes(), np.uint8)
        np.add.at(counts, (b[:-1], b[1:]), 1)
    x = np.log1p(counts.astype(np.float32))
    return x - x.mean()


def error_stats(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    err = y.astype(np.float64) - x
    rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    return {
        "rel RMSE": float(np.sqrt(np.mean(err**2))) / rms,
        "SNR dB": 10 * np.log10(np.mean(x.astype(np.float64) ** 2) / max(np.mean(err**2), 1e-300)),
        "max |err|": float(np.abs(err).max()),
        "zeroed": float(np.mean((y == 0) & (x != 0))),
    }


def fp8_per_tensor(x: jax.Array) -> jax.Array:
    scale = jnp.max(jnp.abs(x)) / 448.0
    return (x / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="nvfp4_example.png", help="where to write the before/after picture")
    args = parser.parse_args()

    nvfp4_1d = jax.jit(lambda x: jax_nvfp4.dequantize(jax_nvfp4.quantize(x.astype(jnp.bfloat16))))
    nvfp4_2d = jax.jit(lambda x: jax_nvfp4.dequantize(jax_nvfp4.quantize(x.astype(jnp.bfloat16), block_2d=True)))
    methods = {
        "NVFP4 1x16": nvfp4_1d,
        "NVFP4 16x16": nvfp4_2d,
        "FP8 E4M3 per-tensor": jax.jit(fp8_per_tensor),
        "bf16": jax.jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)),
    }
    tensors = {"photograph": photograph(), "stdlib bigrams": stdlib_bigrams()}
    for name, x in tensors.items():
        print(f"\n{name}: shape {x.shape}, amax {np.abs(x).max():.4g}, bits/value: NVFP4 4.5, FP8 8, bf16 16")
        print(f"  {'method':<22}{'rel RMSE':>10}{'SNR dB':>9}{'max |err|':>11}{'zeroed':>9}")
        for method, fn in methods.items():
            s = error_stats(x, np.asarray(fn(jnp.asarray(x))))
            print(f"  {method:<22}{s['rel RMSE']:>10.4f}{s['SNR dB']:>9.2f}{s['max |err|']:>11.4f}{s['zeroed']:>9.2%}")

    x = tensors["photograph"]
    y = np.asarray(nvfp4_1d(jnp.asarray(x)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 5.5))
    panels = [(x, "original"), (y, "NVFP4 1x16 (dequantized)"), (np.abs(y - x) * 10, "|error| x 10")]
    for ax, (img, title) in zip(axes, panels, strict=True):
        ax.imshow(np.clip(img.reshape(600, 512, 3), 0, 1))
        ax.set_title(title)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(args.out, dpi=80, bbox_inches="tight")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
