"""Sample text from a model that ``python -m examples.train_lm --save DIR`` trained, its NVFP4 layers' weights in NVFP4.

    python -m examples.train_lm --runs full --save ckpt
    python -m examples.generate ckpt --prompt "def "

Loads DIR/<run> (``--run``; by default the one NVFP4 run saved there) with ``jax_nvfp4.checkpoint.restore``: the
NVFP4 layers' kernels come back as ``jax_nvfp4.QuantizedWeight`` (the forward GEMM's rowwise copy, 0.5625 bytes a
value) and the same layers apply them without quantizing them again; only the activations are quantized, as in
training. Prints the weights' bytes against bf16, streams the first sample as it is drawn, prints the others, and
the generation speed in tokens/s, next to the same loop on a bf16 copy of the model (the NVFP4 weights dequantized:
the same values, run through a bf16 dot) as the baseline (``--no-baseline`` skips it).

Each step runs the model on a window of the last ``seq_len`` bytes (no key-value cache: the model is the training
example's). While the text is shorter than the window, the window is padded with spaces after it: causal attention
hides them, but they take part in each NVFP4 layer's per-tensor global scale (the amax of the window's activations),
as a training batch's rows do; once the text fills the window there is no padding.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from examples.lm.model import RECIPES, TransformerLM, build_model, describe
from jax_nvfp4 import checkpoint

PAD = ord(" ")  # fills the window after the text while it is shorter than the window


def find_run(root: pathlib.Path, run: str | None) -> pathlib.Path:
    """The saved model's directory: ``root`` itself if it holds one, else ``root/run`` (by default the one
    NVFP4 run saved under root). ValueError naming what is there otherwise."""
    if (root / "config.json").exists():
        return root
    saved = sorted(p.parent.name for p in root.glob("*/config.json"))
    if not saved:
        raise ValueError(f"{root} holds no model saved by python -m examples.train_lm --save")
    if run is None:
        nvfp4 = [r for r in saved if r in RECIPES]
        if len(nvfp4) != 1:
            raise ValueError(f"{root} holds the runs {', '.join(saved)}: choose one with --run")
        run = nvfp4[0]
    if run not in saved:
        raise ValueError(f"{root} has no run {run!r}; it holds {', '.join(saved)}")
    return root / run


def load(directory: pathlib.Path) -> tuple[TransformerLM, Any, dict[str, Any]]:
    """The model, its parameters (NVFP4 layers' kernels as QuantizedWeight) and its config, from ``directory``."""
    config = json.loads((directory / "config.json").read_text())
    model = build_model(config["run"], argparse.Namespace(**config))
    return model, checkpoint.restore(directory / "params"), config


def is_quantized(x: Any) -> bool:
    return isinstance(x, jax_nvfp4.QuantizedWeight)


def weight_bytes(params: Any) -> dict[str, int]:
    """Values and bytes of the quantized kernels (as stored, and in bf16) and of every other parameter."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    quantized = [w for w in leaves if is_quantized(w)]
    other = [p for p in leaves if not is_quantized(p)]
    return {
        "layers": len(quantized),
        "nvfp4_values": sum(math.prod(w.shape) for w in quantized),
        "nvfp4_bytes": sum(a.nbytes for w in quantized for a in jax.tree.leaves(w)),
        "other_values": sum(p.size for p in other),
        "other_bytes": sum(p.nbytes for p in other),
    }


def dequantized(params: Any) -> Any:
    """``params`` with every QuantizedWeight replaced by the float32 kernel its codes and scales decode to."""

    decode = lambda w: jax_nvfp4.dequantize_weight(w) if is_quantized(w) else w  # noqa: E731
    return jax.tree.map(decode, params, is_leaf=is_quantized)


def make_step(model: Any, window: int, temperature: float, top_k: int) -> Callable[..., jax.Array]:
    """A jitted step: (params, text [S, T] int32 with ``length`` bytes written, length, key) -> the text with
    byte ``length`` drawn from the model's prediction on the window that ends at it."""

    @jax.jit
    def step(params: Any, text: jax.Array, length: jax.Array, key: jax.Array) -> jax.Array:
        start = jnp.clip(length - window, 0, text.shape[1] - window)
        logits = model.apply({"params": params}, jax.lax.dynamic_slice_in_dim(text, start, window, axis=1))
        logits = jax.lax.dynamic_index_in_dim(logits, length - 1 - start, axis=1, keepdims=False)  # [S, VOCAB]
        if temperature == 0:
            token = jnp.argmax(logits, axis=-1)
        else:
            logits = logits / temperature
            if top_k:
                kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            token = jax.random.categorical(jax.random.fold_in(key, length), logits)
        return jax.lax.dynamic_update_index_in_dim(text, token.astype(text.dtype), length, axis=1)

    return step


def generate(
    step: Callable[..., jax.Array],
    params: Any,
    prompt: bytes,
    tokens: int,
    samples: int,
    window: int,
    key: jax.Array,
    on_byte: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, float]:
    """``samples`` continuations of ``prompt``, ``tokens`` bytes each, as [samples, len(prompt) + tokens] bytes,
    and the tokens/s of every step after the first (which compiles). ``on_byte`` gets each byte of sample 0."""
    total = max(len(prompt) + tokens, window)
    text = np.full((samples, total), PAD, np.int32)
    text[:, : len(prompt)] = np.frombuffer(prompt, np.uint8)
    text = jnp.asarray(text)
    t0 = None
    for i, length in enumerate(range(len(prompt), len(prompt) + tokens)):
        text = step(params, text, jnp.int32(length), key)
        byte = int(text[0, length])  # waits for the step: the next one needs its byte anyway
        if on_byte is not None:
            on_byte(byte)
        if i == 0:
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - t0
    rate = samples * (tokens - 1) / elapsed if tokens > 1 else float("nan")
    return np.asarray(text[:, : len(prompt) + tokens]), rate


def stream() -> Callable[[int], None]:
    """Print bytes to stdout as they come, decoded as UTF-8 (invalid bytes as U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(byte: int) -> None:
        sys.stdout.write(decoder.decode(bytes([byte])))
        sys.stdout.flush()

    return write


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "directory", type=pathlib.Path, help="what python -m examples.train_lm --save wrote (or one run in it)"
    )
    parser.add_argument("--run", default=None, help="which saved run (default: the one NVFP4 run there)")
    parser.add_argument("--prompt", default="def ", help="the text to continue (UTF-8)")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to generate per sample")
    parser.add_argument("--samples", type=int, default=4, help="samples drawn in parallel (one batch)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the bf16 copy's speed")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    prompt = args.prompt.encode()
    if not prompt or min(args.tokens, args.samples) < 1 or args.temperature < 0 or not 0 <= args.top_k <= 256:
        parser.error("--prompt must not be empty; --tokens, --samples >= 1; --temperature >= 0; --top-k in [0, 256]")
    try:
        directory = find_run(args.directory, args.run)
    except ValueError as e:
        parser.error(str(e))
    model, params, config = load(directory)
    window = config["seq_len"]
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"model: {directory} ({describe(config['run'], argparse.Namespace(**config))})")

    sizes = weight_bytes(params)
    if sizes["layers"]:
        n, nbytes = sizes["nvfp4_values"], sizes["nvfp4_bytes"]
        print(
            f"NVFP4 layers' weights: {sizes['layers']} kernels, {n:,} values: {nbytes:,} bytes "
            f"({nbytes / n:.4f} B/value) against {2 * n:,} in bf16 ({2 * n / nbytes:.2f}x smaller)"
        )
    other = sizes["other_values"]
    print(
        f"other parameters (embeddings, head, biases, norms): {other:,} values, {sizes['other_bytes']:,} bytes as saved"
    )
    if sizes["layers"]:
        nvfp4_model, bf16_model = nbytes + 2 * other, 2 * (n + other)
        print(
            f"whole model, the other parameters in bf16: {nvfp4_model:,} bytes against {bf16_model:,} all in bf16 "
            f"({bf16_model / nvfp4_model:.2f}x smaller)"
        )

    key = jax.random.key(args.seed)
    step = make_step(model, window, args.temperature, args.top_k)
    print(f"\n--- sample 1 of {args.samples} ---\n{args.prompt}", end="", flush=True)
    text, rate = generate(step, params, prompt, args.tokens, args.samples, window, key, on_byte=stream())
    for i in range(1, args.samples):
        print(f"\n--- sample {i + 1} of {args.samples} ---\n{bytes(text[i].astype(np.uint8)).decode(errors='replace')}")
    print(f"\n---\n{config['run']}: {rate:.1f} tokens/s ({args.samples} samples in parallel, window {window})")

    if sizes["layers"] and not args.no_baseline:
        bf16 = build_model("bf16", argparse.Namespace(**config))
        baseline_step = make_step(bf16, window, args.temperature, args.top_k)
        _, baseline = generate(baseline_step, dequantized(params), prompt, args.tokens, args.samples, window, key)
        print(
            f"bf16 (the same weights, dequantized): {baseline:.1f} tokens/s; NVFP4 / bf16 speed {rate / baseline:.2f}"
        )


if __name__ == "__main__":
    main()
