"""A roofline model of a compiled program, kernel by kernel: what a GPU's published peaks allow, not a timing.

Each kernel of the entry computation takes max(bytes / HBM bandwidth, FLOPs / tensor peak): its bytes are its
operands read once and its result written once (``layer_breakdown.kernels``), its FLOPs those of the dot it
holds (2 x the result's size x the contraction), at the dense tensor-core peak of the MMA its PTX names, else of
the dot's operand type (FP4, FP8, or bf16 for anything wider). Launch gaps, caches, occupancy and tiles are left
out, so it is the least time the program can take on that GPU: the budget our kernels must meet, and the list of
what costs.

Which MMA a GEMM kernel runs is read from the PTX the compiler left (``mma_instructions``), not assumed: a
Blackwell NVFP4 GEMM holds ``tcgen05.mma ... kind::mxf4nvf4``; cuBLAS and cuDNN calls leave no PTX.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
DOTS = ("dot", "scaled-dot")
LIBRARY_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$blockScaledDot")


@dataclasses.dataclass(frozen=True)
class Dot:
    flops: float
    dtype: str  # the left operand's HLO element type: f4e2m1fn, f8e4m3fn, bf16, ...


def _dims(shape: str) -> tuple[str, list[int]]:
    m = ARRAY.search(shape)
    if not m:
        return "", []
    return m.group(1), [int(d) for d in m.group(2).split(",") if d]


def computations(hlo: str) -> tuple[str, dict[str, list[str]]]:
    """Compiled HLO text's entry computation's name, and every computation's instruction lines by name."""
    out: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = COMPUTATION.match(line)
        if head:
            current = out.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return entry, out


def _instructions(hlo: str) -> tuple[str, dict[str, list[re.Match]]]:
    entry, found = computations(hlo)
    return entry, {name: [m for line in lines if (m := INSTRUCTION.match(line))] for name, lines in found.items()}


def _dot_of(instructions: list[re.Match], computations: dict, seen: set, shapes: dict | None = None) -> Dot | None:
    """The dot an instruction list holds, looking through the fusions it calls (a Triton GEMM nests its operands'
    fusions); ``shapes``: its operands' shapes by name (default: the list's own)."""
    shapes = shapes if shapes is not None else {m.group(1): m.group(2) for m in instructions}
    for m in instructions:
        _, shape, opcode, operands, rest = m.groups()
        if opcode in DOTS:
            lhs = re.findall(r"%([\w.\-]+)", operands)[0]
            dtype, lhs_dims = _dims(shapes.get(lhs, ""))
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            k = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
            return Dot(2.0 * math.prod(_dims(shape)[1]) * k, dtype)
        for called in re.findall(r"calls=%([\w.\-]+)", rest):
            if called not in seen:
                seen.add(called)
                found = _dot_of(computations.get(called, []), computations, seen)
                if found:
                    return found
    return None


def dots(hlo: str) -> dict[str, Dot]:
    """The dot each kernel of compiled HLO text's entry computation runs, by kernel name (the kernels without one
    are left out): fusions holding a dot or scaled-dot, and cuBLAS / cuDNN GEMM calls, a ``call``'s included."""
    entry, found = _instructions(hlo)
    return _dots(found, found[entry])


def _dots(computations: dict, instructions: list[re.Match]) -> dict[str, Dot]:
    shapes = {m.group(1): m.group(2) for m in instructions}
    out = {}
    for m in instructions:
        name, shape, opcode, operands, rest = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        if opcode == "call":
            out.update(_dots(computations, computations.get(re.search(r"to_apply=%([\w.\-]+)", rest).group(1), [])))
        elif target and target.group(1) in LIBRARY_GEMMS:
            lhs = re.findall(r"%([\w.\-]+)", operands)[0]
            dtype, lhs_dims = _dims(shapes.get(lhs, ""))
            contracting = re.search(r'"lhs_contracting_dimensions":\["?([\d",]*)"?\]', rest)
            dims = [int(d) for d in contracting.group(1).replace('"', "").split(",") if d] if contracting else [-1]
            k = math.prod(lhs_dims[d] for d in dims)
            out[name] = Dot(2.0 * math.prod(_dims(shape)[1]) * k, dtype)
        elif opcode in DOTS or opcode == "fusion":
            found = _dot_of([m], computations, set(), shapes)
            if found:
                out[name] = found
    return out


def mma_instructions(dump: str | Path) -> dict[str, set[str]]:
    """The tensor-core MMA instructions each kernel runs, by HLO instruction name, from what XLA dumped to ``dump``
    (``--xla_dump_to`` with ``--xla_dump_emitter_re=.*``): its PTX (``tcgen05.mma...`` on Blackwell,
    ``wgmma...`` on Hopper, ``mma.sync...`` before), joined to the instructions by the thunk sequence, since XLA
    emits one kernel for identical fusions and names it after the first."""
    by_symbol: dict[str, set[str]] = {}
    for ptx in sorted(Path(dump).glob("*.ptx")):
        for body in re.split(r"\.entry ", ptx.read_text())[1:]:
            name = body[: body.index("(")].strip()
            found = set(re.findall(r"\b(tcgen05\.mma[\w.:]*|wgmma\.mma_async[\w.:]*|mma\.sync[\w.:]*)", body))
            if found:
                by_symbol.setdefault(name, set()).update(found)
    out: dict[str, set[str]] = {}
    for metadata in sorted(Path(dump).glob("*.thunk_metadata.txt")):
        sequence = metadata.with_name(metadata.name.replace("thunk_metadata", "thunk_sequence"))
        if not sequence.exists():
            continue
        symbols = dict(re.findall(r"^(\d+): kCustomKernel\s+\[[^\]]*\]\s+(\S+)", sequence.read_text(), re.M))
        pairs = re.findall(r'profile_annotation: "([^"]+)"\s+thunk_id: (\d+)', metadata.read_text())
        for instruction, thunk in pairs:
            symbol = symbols.get(f"{int(thunk):03d}")
            if symbol in by_symbol:
                out[instruction] = by_symbol[symbol]
    return out


def peak(target, dtype: str, mma: set[str] = frozenset()) -> float:
    """The dense tensor-core peak (FLOP/s) of ``target`` (an ``offline_gpu.Target``) for a dot on operands of HLO
    type ``dtype`` whose kernel runs the MMA instructions ``mma`` (from its PTX; empty: unknown, a library call):
    the MMA's own rate where the PTX names it (a kernel that widens FP4 codes for an f16 MMA runs at bf16's),
    else the operands'. FP4 needs FP4 tensor cores (Blackwell); elsewhere it is widened, at bf16's rate."""
    kinds = " ".join(mma)
    if "mxf4" in kinds and target.fp4_flops:
        return target.fp4_flops
    if "f8f6f4" in kinds or "e4m3" in kinds or "e5m2" in kinds:
        return target.fp8_flops
    if kinds:
        return target.bf16_flops
    if dtype.startswith("f4") and target.fp4_flops:
        return target.fp4_flops
    if dtype.startswith("f8"):
        return target.fp8_flops
    return target.bf16_flops


def seconds(target, moved_bytes: float, dot: Dot | None, mma: set[str] = frozenset()) -> float:
    """One kernel's modeled time on ``target``: max(bytes / HBM bandwidth, FLOPs / tensor peak)."""
    memory = moved_bytes / target.hbm_bytes_per_s
    return max(memory, dot.flops / peak(target, dot.dtype, mma)) if dot else memory


TRITON_CALL = "__gpu$xla.gpu.triton"
"""A Pallas kernel's custom call: its dot is in its Triton code, not in the HLO."""


def modeled(hlo: str, target, mma: dict[str, set[str]] | None = None, pallas_dot: Dot | None = None) -> dict:
    """Each kernel's modeled seconds on ``target``, by name, for compiled HLO text (``layer_breakdown.kernels``);
    ``mma``: the MMAs each kernel runs (``mma_instructions``), where its PTX was dumped; ``pallas_dot``: the dot of
    each Pallas kernel, which the HLO does not show (the caller knows its GEMMs' sizes)."""
    from benchmarks.layer_breakdown import kernels

    found, mma = dots(hlo), mma or {}
    if pallas_dot is not None:
        found |= {k.name: pallas_dot for k in kernels(hlo, gpu=True) if k.what == TRITON_CALL and k.name not in found}
    return {
        k.name: seconds(target, k.read + k.written, found.get(k.name), mma.get(k.name, set()))
        for k in kernels(hlo, gpu=True)
    }
