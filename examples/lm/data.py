"""The training example's data: the standard library's source as bytes, its token windows and a run's batches.

The corpus is the Python standard library's own source, which every machine has offline: ~4 MB of bytes in a
fixed order, the last 5% held out for validation. Every run of one seed sees the same batches.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

VOCAB = 256  # bytes
EVAL_WINDOWS, EVAL_BATCH = 256, 64  # fixed validation set: 256 windows, evenly spaced over the held-out bytes


def load_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
    """The standard library's .py sources as bytes, in sorted file order, up to max_bytes."""
    root = pathlib.Path(os.path.dirname(os.__file__))
    files = sorted(root.glob("*.py")) + sorted(p for p in root.glob("*/*.py") if "site-packages" not in p.parts)
    chunks, total = [], 0
    for path in files:
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """[len(starts), seq_len + 1] int32 token windows: inputs are [:, :-1], targets [:, 1:]."""
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def prepare_data(args: argparse.Namespace) -> tuple[np.ndarray, dict[str, Any]]:
    """The training windows' starts [steps, batch] and the data ({"train": bytes, "val_batches": [...]}), the
    same for every run: one numpy RNG for training, evenly spaced fixed windows for validation."""
    corpus = load_corpus()
    split = int(0.95 * len(corpus))
    train_data, val_data = corpus[:split], corpus[split:]
    train_starts = np.random.default_rng(args.seed).integers(0, split - args.seq_len - 1, (args.steps, args.batch))
    val_starts = np.linspace(0, len(val_data) - args.seq_len - 1, EVAL_WINDOWS).astype(np.int64)
    val_windows = windows(val_data, val_starts, args.seq_len)
    val_batches = [jnp.asarray(w) for w in np.split(val_windows, EVAL_WINDOWS // EVAL_BATCH)]
    print(f"corpus: {len(corpus) / 1e6:.2f} MB of stdlib source ({len(train_data)} train / {len(val_data)} val bytes)")
    return train_starts, {"train": train_data, "val_batches": val_batches}
