"""Test and benchmark tools: what a compiled program communicates.

``collectives`` reads the collectives (all-gathers, all-reduces, ...) out of
compiled HLO text, so a test can assert that a sharded step moves 4-bit codes
and 8-bit scales rather than high-precision values, and a benchmark can count
the bytes.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple


class Collective(NamedTuple):
    """One collective of a compiled program: its op, result dtype and shape, result bytes, and the name of the
    JAX operation it came from (its ``op_name`` metadata, e.g. ``jit(step)/jvp(Model)/block0/mlp_up/...``;
    empty if XLA recorded none)."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    op_name: str = ""


_COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ITEMSIZE = {"pred": 1, "u8": 1, "s8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8}


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives in compiled HLO text (``jit(f).lower(...).compile().as_text()``).

    A collective with a tuple result (XLA combines some) counts each member.
    The bytes are those of the result buffer: for an all-gather, the
    gathered array.
    """
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        op_name = _OP_NAME.search(line)
        for dtype, dims in _ARRAY.findall(match.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            nbytes = math.prod(shape) * _ITEMSIZE[dtype]
            found.append(Collective(match.group(2), dtype, shape, nbytes, op_name.group(1) if op_name else ""))
    return found
