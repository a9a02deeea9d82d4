"""One linear layer's forward and backward under the NVFP4 recipe, kernel by kernel, beside bf16's.

Compiles ``jax.vjp`` of ``jax_nvfp4.dot_general`` (x [M, K] . W [K, N], a bf16 cotangent; the full recipe: RHT,
stochastic rounding, 16x16 weight blocks) and of ``lax.dot_general`` for the default backend, and lists every
kernel of the compiled program's entry computation (custom calls, fusions, dots, copies, collectives) with the
bytes it must read and write: its operands and its result, each once, the least HBM traffic it can have. Read
from the compiled HLO only: nothing runs, so it works offline on any backend (on the CPU the GEMMs are XLA's own
fusions; a GPU build shows the same custom calls and dequantize passes). ``--target b200`` (or h100, h200)
compiles for that GPU on a machine without one (``benchmarks.offline_gpu``: jax's CUDA plugin, and a build with
the CUDA module for the recipe's kernels), so the table shows XLA's GPU fusions. For a GPU, compiled offline or
attached, it also shows the tensor-core MMA each kernel's PTX runs (an FP4 GEMM's is ``tcgen05 mxf4nvf4``) and the
roofline model's time (``benchmarks.roofline``: the GPU's published peaks; a model, not a timing), and the bytes
outside the GEMMs against the fewest the recipe's passes can move. ``--time`` also runs the step (random inputs
and cotangent) under ``jax.profiler`` and puts each kernel's time beside its bytes (``benchmarks.profile_trace``):
device time on a GPU, host time on the CPU. ``--experts G`` makes the layer a
mixture of experts instead: ``jax_nvfp4.ragged_dot`` of x [M, K] (M / G tokens an expert) and W [G, K, N] against
``lax.ragged_dot``.

    python -m benchmarks.layer_breakdown [--shape 8192,4096,4096] [--impl auto] [--target b200] [--time]
                                         [--experts G] [--out results.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
from jax import lax

import jax_nvfp4
from benchmarks import roofline
from benchmarks.offline_gpu import TARGETS, target, target_of
from benchmarks.profile_trace import instruction_seconds
from benchmarks.timing import Report, commit, device_name

DENSE = (((1,), (0,)), ((), ()))
# Instructions that move no data of their own: views, tuples, parameters, constants.
FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id", "replica-id"}
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
BYTES |= {"s64": 8, "u64": 8, "f64": 8, "f4e2m1fn": 0.5}
SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
INSTRUCTION = roofline.INSTRUCTION


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (a tuple's: its elements'), e.g. ``(u8[1,384,256]{2,1,0}, f32[1]{0})``."""
    total = 0.0
    for dtype, dims in SHAPE.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * BYTES.get(dtype if not dtype.startswith("f8") else "u8", 0)
    return total


@dataclasses.dataclass
class Kernel:
    name: str
    what: str  # the custom call's target, the fusion's kind, or the opcode
    op: str  # the JAX operation it came from (its op_name, shortened)
    read: float
    written: float
    shape: str = ""  # its result's HLO shape
    seconds: float = 0.0  # its time in a traced run (--time)


def kernels(hlo: str, gpu: bool = False) -> list[Kernel]:
    """The data-moving instructions of the entry computation of compiled HLO text, in program order; with ``gpu``
    a ``call``'s are those of the computation it calls (a GPU runs its kernels; the CPU runs a call as one)."""
    entry, found = roofline.computations(hlo)
    return _kernels(found, entry, gpu)


def _kernels(found: dict[str, list[str]], name: str, gpu: bool) -> list[Kernel]:
    shapes: dict[str, str] = {}
    out = []
    for line in found[name]:
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode, operands, rest = m.groups()
        shapes[name] = shape
        if opcode in FREE:
            continue
        if opcode == "call" and gpu:
            out += _kernels(found, re.search(r"to_apply=%([\w.\-]+)", rest).group(1), gpu)
            continue
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        kind = re.search(r"kind=(k\w+)", rest)
        what = target.group(1) if target else f"fusion {kind.group(1)}" if kind else opcode
        op_name = re.search(r'op_name="([^"]+)"', rest)
        op = "/".join(op_name.group(1).split("/")[-2:]) if op_name else ""
        read = sum(shape_bytes(shapes.get(o, "")) for o in re.findall(r"%([\w.\-]+)", operands))
        out.append(Kernel(name, what, op, read, shape_bytes(shape), shape))
    return out


# A dequantize call whose result is one float32 a row ([..., 1]): a GEMM's global decode scale (one code 1.0 under
# block scale 1.0, ops.gemm.decode_scale), a few bytes, not a pass over an operand.
DECODE_SCALE = re.compile(r"^f32\[[\d,]*\b1\]")
CATEGORIES = ("amax", "quantize", "dequantize", "decode scale", "GEMM", "other")


def category(k: Kernel) -> str:
    """What a kernel is for (one of CATEGORIES), by its custom call or name (a grouped op's as the plain op's)."""
    what = k.what.replace("nvfp4_grouped_", "nvfp4_")
    if "nvfp4_dequantize" in what and DECODE_SCALE.match(k.shape):
        return "decode scale"
    for key in ("amax", "quantize", "dequantize"):
        if f"nvfp4_{key}" in what:
            return key
    if "reduce_max" in k.op:  # an amax XLA computes itself (on a GPU), with its producer where it fused
        return "amax"
    # a Pallas kernel (the fused GEMM), cuBLAS or cuDNN
    gemm_call = "triton" in k.what or "gemm" in k.what or k.what in roofline.LIBRARY_GEMMS
    if gemm_call or k.what == "dot" or "dot" in k.name or "ynn" in k.name or "_gemm" in k.op:
        return "GEMM"  # the dots and their epilogues (the scale product, the cast)
    return "other"


def compiled_step(dot, shape: tuple[int, int, int], target: str = "default", producer: str = "none", experts: int = 0):
    """The compiled forward and backward of ``dot`` on x [M, K], W [K, N] (``experts``: W [G, K, N]) with a
    cotangent [M, N]; with ``producer="gelu"`` x is the gelu of the input, computed in the step (as a layer's
    input is)."""
    shapes = _shapes(shape, experts)
    make_x = {"none": lambda h: h, "gelu": jax.nn.gelu}[producer]

    def step(h, w, dy):
        y, vjp = jax.vjp(lambda h, w: dot(make_x(h), w), h, w)
        return y, *vjp(dy)

    if target == "default":
        return jax.jit(step).lower(*[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]).compile()
    from benchmarks.offline_gpu import compile_for

    with compile_for(target) as on_gpu:
        return jax.jit(step).trace(*[on_gpu(s, jnp.bfloat16) for s in shapes]).lower().compile()


def _shapes(shape: tuple[int, int, int], experts: int) -> tuple[tuple[int, ...], ...]:
    """x, W and the cotangent's shapes: W [K, N], or [G, K, N] with ``experts`` G."""
    m, k, n = shape
    return (m, k), ((experts, k, n) if experts else (k, n)), (m, n)


def step_inputs(shape: tuple[int, int, int], experts: int = 0) -> list[jax.Array]:
    """Random bf16 x [M, K], W [K, N] or [G, K, N] (scaled as a layer's) and cotangent dy [M, N]: a GEMM that the
    gradient of a sum would hand a constant cotangent can skip work."""
    x, w, dy = _shapes(shape, experts)
    keys = jax.random.split(jax.random.key(1), 3)
    return [
        jax.random.normal(keys[0], x, jnp.bfloat16),
        (jax.random.normal(keys[1], w) * shape[1] ** -0.5).astype(jnp.bfloat16),
        jax.random.normal(keys[2], dy, jnp.bfloat16),
    ]


def layer_dots(recipe: jax_nvfp4.Recipe, shape: tuple[int, int, int], experts: int = 0):
    """The NVFP4 layer and bf16's: ``dot_general`` against ``lax.dot_general``, or with ``experts`` G
    ``ragged_dot`` against ``lax.ragged_dot`` with M / G tokens an expert."""
    key = jax.random.key(0)
    if not experts:
        nvfp4 = lambda x, w: jax_nvfp4.dot_general(x, w, DENSE, recipe=recipe, rng_key=key)  # noqa: E731
        return nvfp4, lambda x, w: lax.dot_general(x, w, DENSE)
    if shape[0] % experts:
        raise ValueError(f"M = {shape[0]} tokens do not split evenly over {experts} experts")
    sizes = jnp.full((experts,), shape[0] // experts, jnp.int32)
    nvfp4 = lambda x, w: jax_nvfp4.ragged_dot(x, w, sizes, recipe=recipe, rng_key=key)  # noqa: E731
    return nvfp4, lambda x, w: lax.ragged_dot(x, w, sizes)


def minimum_outside_gemms(shape: tuple[int, int, int], experts: int = 0) -> float:
    """The fewest bytes the recipe's passes outside the GEMMs can move: x, W and dy read once in bf16, and each
    quantized copy the GEMMs read written once (x and dy rowwise and columnwise, W in 16x16 blocks once, which
    both of its GEMMs read), at 4 bits a value and one E4M3 scale per 16."""
    m, k, n = shape
    w = k * n * max(experts, 1)
    return 2.0 * (m * k + w + m * n) + (0.5 + 1 / 16) * (2 * m * k + w + 2 * m * n)


def mma_label(kernel: Kernel, found: dict[str, set[str]]) -> str:
    """The tensor-core MMA a kernel runs, from its PTX: e.g. ``tcgen05 mxf4nvf4`` (FP4), ``wgmma bf16``."""
    names = found.get(kernel.name, set())
    if not names:
        return "library call" if kernel.what.startswith(("__cublas", "__cudnn")) else ""
    short = set()
    for n in names:
        kind = re.search(r"kind::(\w+)", n) or re.search(r"\.(bf16|f16|e4m3|e5m2|tf32)\b", n)
        short.add(f"{n.split('.')[0]} {kind.group(1) if kind else ''}".strip())
    return ", ".join(sorted(short))


def ptx_dump() -> str:
    """A new folder that XLA dumps its PTX to (for ``dumped_mmas``), from the backend's start: call before it, as
    XLA reads its flags once."""
    dump = tempfile.mkdtemp(prefix="xla_ptx_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_emitter_re=.*"
    return dump


def dumped_mmas(dump: str | None) -> dict[str, set[str]]:
    """The MMA instructions of each kernel in the PTX dumped to ``dump`` so far (``roofline.mma_instructions``),
    then the dump emptied for the next compile."""
    if dump is None:
        return {}
    found = roofline.mma_instructions(dump)
    for entry in os.scandir(dump):
        if entry.is_dir():
            shutil.rmtree(entry.path)
        else:
            os.remove(entry.path)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192,4096,4096", help="M,K,N: x [M, K] . W [K, N]")
    parser.add_argument("--impl", default="auto", help="the recipe's GEMM impl (auto, emulated, scaled_dot, ...)")
    parser.add_argument(
        "--target", default="default", choices=("default", *TARGETS), help="JAX's backend, or a GPU offline"
    )
    parser.add_argument("--producer", default="none", choices=("none", "gelu"), help="x an input, or a gelu's output")
    parser.add_argument("--rht-amax-estimate", action="store_true", help="Recipe(rht_amax_estimate=True)")
    parser.add_argument("--time", action="store_true", help="also time each kernel (jax.profiler; not offline)")
    parser.add_argument("--experts", type=int, default=0, help="G > 0: a mixture-of-experts layer (ragged_dot)")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    if args.time and args.target != "default":
        parser.error("--time runs the step: only on JAX's own backend")
    dump = None
    if args.target != "default" or shutil.which("nvidia-smi"):
        dump = ptx_dump()
    if args.target != "default":
        from benchmarks.offline_gpu import prepare

        prepare()
    recipe = jax_nvfp4.Recipe(impl=args.impl, rht_amax_estimate=args.rht_amax_estimate)
    nvfp4_dot, bf16_dot = layer_dots(recipe, shape, args.experts)
    nvfp4_step = compiled_step(nvfp4_dot, shape, args.target, args.producer, args.experts)
    nvfp4_hlo = nvfp4_step.as_text()
    on_gpu = args.target != "default" or jax.default_backend() == "gpu"
    nvfp4, nvfp4_mma = kernels(nvfp4_hlo, on_gpu), dumped_mmas(dump)
    bf16_step = compiled_step(bf16_dot, shape, args.target, args.producer, args.experts)
    bf16_hlo = bf16_step.as_text()
    bf16, bf16_mma = kernels(bf16_hlo, on_gpu), dumped_mmas(dump)
    if dump:
        shutil.rmtree(dump)
    if args.time:
        inputs = step_inputs(shape, args.experts)
        for step, found in ((nvfp4_step, nvfp4), (bf16_step, bf16)):
            seconds = instruction_seconds(step, *inputs)
            for k in found:
                k.seconds = seconds.get(k.name, 0.0)
    if args.target != "default":
        gpu = target(args.target)
        capability = ".".join(map(str, gpu.capability))
        machine = f"{gpu.device_kind} (sm_{capability}), compiled offline: no GPU attached, XLA's untuned GEMM configs"
    else:
        gpu = target_of(device_name()) if jax.default_backend() == "gpu" else None
        machine = f"{device_name()} ({jax.default_backend()})"
    model = {}
    if gpu is not None:
        # A Pallas GEMM (impl="fused") is one of the layer's three GEMMs, each 2 M K N FLOPs (M: all tokens), on f16
        # MMAs (its decoded tiles).
        pallas = roofline.Dot(2.0 * shape[0] * shape[1] * shape[2], "f16")
        for ks, hlo, mma in ((nvfp4, nvfp4_hlo, nvfp4_mma), (bf16, bf16_hlo, bf16_mma)):
            seconds = roofline.modeled(hlo, gpu, mma, pallas)
            model.update({id(k): seconds[k.name] for k in ks})
    mmas = {id(k): mma_label(k, found) for ks, found in ((nvfp4, nvfp4_mma), (bf16, bf16_mma)) for k in ks}
    columns = [("MMA (PTX)", "---", lambda ks: mmas[id(ks[0])] if len(ks) == 1 else "")] if dump else []
    if model:
        columns.append(("model us", "---:", lambda ks: f"{sum(model[id(k)] for k in ks) * 1e6:.1f}"))
    if args.time:
        columns.append(("ms", "---:", lambda ks: f"{sum(k.seconds for k in ks) * 1e3:.3f}"))

    def extra(ks, total_row=False) -> str:
        cells = ["" if total_row and head.startswith("MMA") else cell(ks) for head, _, cell in columns]
        return "".join(f" | {c}" for c in cells)

    heads = "".join(f" {head} |" for head, _, _ in columns)
    rules = "".join(f"{rule}|" for _, rule, _ in columns)

    mb = 1e6
    m, k, n = shape
    if args.experts:
        layer = (
            f"`jax_nvfp4.ragged_dot` of x [M, K] and W [G, K, N] = {m} x {k} and {args.experts} x {k} x {n} "
            f"({m // args.experts} tokens an expert) against `lax.ragged_dot`"
        )
    else:
        layer = f"x [M, K] . W [K, N] = {m} x {k} . {k} x {n}"
    model_note = (
        f" Model: `benchmarks.roofline`, each kernel max(bytes / HBM bandwidth, FLOPs / dense tensor peak of its MMA, "
        f"or of its dot's operand type where no PTX names one) with the published figures of the {gpu.device_kind} "
        f"({gpu.source}); a model, not a timing."
        if model
        else ""
    )
    report = Report(
        args.out,
        [
            f"# One {'mixture-of-experts' if args.experts else 'linear'} layer, kernel by kernel: {machine}",
            "",
            f"{datetime.date.today()}, jax {jax.__version__}, commit {commit()}; `python -m benchmarks.layer_breakdown "
            f"--shape {args.shape} --impl {args.impl} --target {args.target} --producer {args.producer}"
            f"{' --rht-amax-estimate' if args.rht_amax_estimate else ''}"
            f"{f' --experts {args.experts}' if args.experts else ''}`: forward + backward (`jax.vjp`, a bf16 "
            f"cotangent) of {layer}, bf16, the full recipe (RHT, stochastic rounding, 16x16 weight blocks). "
            "Bytes: each kernel's operands read once and its result written once (the least HBM traffic it can "
            "have), from the compiled HLO."
            + (" MMA: the tensor-core instructions of the kernel's PTX as XLA emitted it." if dump else "")
            + model_note
            + (
                " Times: the mean of 5 runs traced by jax.profiler (benchmarks.profile_trace), "
                f"{'device' if jax.default_backend() != 'cpu' else 'host'} time."
                if args.time
                else " No times (`--time` traces a run)."
            ),
            "",
            f"| # | kernel | what | from | MB read | MB written |{heads}",
            f"|---:|---|---|---|---:|---:|{rules}",
        ],
    )
    shown = [k for k in nvfp4 if k.read + k.written >= 1e5]
    for i, k in enumerate(shown):
        report.add(f"| {i} | `{k.name}` | {k.what} | {k.op} | {k.read / mb:.1f} | {k.written / mb:.1f}{extra([k])} |")
    small = [k for k in nvfp4 if k.read + k.written < 1e5]
    report.add(
        f"| | {len(small)} more under 0.1 MB each | | | {sum(k.read for k in small) / mb:.2f} | "
        f"{sum(k.written for k in small) / mb:.2f}{extra(small, True)} |"
    )
    report.add("")
    totals = [c for c in columns if not c[0].startswith("MMA")]
    heads = "".join(f" {head} |" for head, _, _ in totals)
    rules = "".join(f"{rule}|" for _, rule, _ in totals)

    def sums(ks) -> str:
        return "".join(f" | {cell(ks)}" for _, _, cell in totals)

    report.add(f"| | kernels | MB read | MB written | MB in all | x bf16's |{heads}")
    report.add(f"|---|---:|---:|---:|---:|---:|{rules}")
    bf16_total = sum(k.read + k.written for k in bf16)
    for cat in CATEGORIES:
        ks = [k for k in nvfp4 if category(k) == cat]
        moved = sum(k.read + k.written for k in ks)
        report.add(
            f"| NVFP4 {cat} | {len(ks)} | {sum(k.read for k in ks) / mb:.1f} | "
            f"{sum(k.written for k in ks) / mb:.1f} | {moved / mb:.1f} | {moved / bf16_total:.2f}{sums(ks)} |"
        )
    total = sum(k.read + k.written for k in nvfp4)
    report.add(
        f"| **NVFP4** | {len(nvfp4)} | {sum(k.read for k in nvfp4) / mb:.1f} | "
        f"{sum(k.written for k in nvfp4) / mb:.1f} | {total / mb:.1f} | {total / bf16_total:.2f}{sums(nvfp4)} |"
    )
    report.add(
        f"| **bf16** | {len(bf16)} | {sum(k.read for k in bf16) / mb:.1f} | "
        f"{sum(k.written for k in bf16) / mb:.1f} | {bf16_total / mb:.1f} | 1.00{sums(bf16)} |"
    )
    report.add("")
    outside = sum(k.read + k.written for k in nvfp4 if category(k) != "GEMM")
    least = minimum_outside_gemms(shape, args.experts)
    report.add(
        f"Outside the GEMMs the NVFP4 step moves {outside / mb:.1f} MB, {outside / least:.2f}x the fewest it can "
        f"({least / mb:.1f} MB: x, W and dy read once in bf16, each quantized copy the GEMMs read written once)."
    )
    if model:
        nv, bf = (sum(model[id(k)] for k in ks) for ks in (nvfp4, bf16))
        report.add(
            f"Modeled on the {gpu.device_kind}: NVFP4 {nv * 1e6:.1f} us, bf16 {bf * 1e6:.1f} us, **{nv / bf:.2f}x "
            "bf16's time**."
        )
    report.add("")
    report.add("bf16's kernels:")
    report.add("")
    report.add(f"| # | kernel | what | from | MB read | MB written |{''.join(f' {h} |' for h, _, _ in columns)}")
    report.add(f"|---:|---|---|---|---:|---:|{''.join(f'{r}|' for _, r, _ in columns)}")
    for i, k in enumerate(bf16):
        report.add(f"| {i} | `{k.name}` | {k.what} | {k.op} | {k.read / mb:.1f} | {k.written / mb:.1f}{extra([k])} |")
    report.save()


if __name__ == "__main__":
    main()
