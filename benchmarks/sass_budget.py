"""Instruction budget of the CUDA quantize, dequantize and amax kernels, measured without a GPU.

Builds entry points that run the persistent tile loop of ffi/cuda/quantize.cu in its steady state
per spec (its hook budget_tile under NVFP4_SASS_BUDGET: whole tiles, the spec's flags
compile-time constants) with nvcc, dumps the SASS with cuobjdump, and prints per spec and GPU
architecture: SASS instructions a thread issues per input element (the loop body's instructions,
one tile, over the 16 x 8 values a thread holds), registers and spill bytes (ptxas -v). The
dequantize and amax kernels are counted the same way over their grid-stride loops (OTHER_KERNELS;
dequantize per output element). An entry
point with a loop inside the counted body is flagged: its static count is then a lower bound.
The old kernel of --before has no loop: its whole entry point is counted. The bound: an H100 issues about 29 T
thread-instructions/s against 3.35 TB/s of memory, about 25 instructions per element at ~3.1
bytes per element.

`--before REV` measures the quantize kernel of git revision REV the same way: through its own hook
where REV has today's tile kernel, else (its one-column-per-thread stripe kernel: 16 values per
thread) through a wrapper that this script writes for it.

Tools: nvcc and cuobjdump from the `nvidia-cuda-nvcc`, `nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm` wheels when installed, else from PATH.

    pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    python -m benchmarks.sass_budget --json benchmarks/results/sass-budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jax_nvfp4 import QuantizeSpec

ROOT = Path(__file__).resolve().parent.parent
SPECS = {  # the specs measured, each built by its option names
    "rowwise_columnwise": QuantizeSpec(columnwise=True),
    "rowwise": QuantizeSpec(),
    "columnwise": QuantizeSpec(rowwise=False, columnwise=True),
    "block_2d": QuantizeSpec(columnwise=True, block_2d=True),
    "rht": QuantizeSpec(columnwise=True, rht=True),
    "stochastic_rounding": QuantizeSpec(columnwise=True, stochastic_rounding=True),
    "row_scaled": QuantizeSpec(columnwise=True, row_scaled=True),
    "four_over_six_fast_math": QuantizeSpec(
        columnwise=True, four_over_six_error="mse", four_over_six_fast_math=True, e4m3_max=256
    ),
    "four_over_six": QuantizeSpec(columnwise=True, four_over_six_error="mse", e4m3_max=256),
}
# The same specs on the tie-safe code index, which a copy takes where its amax lets a product be a round-down
# tie (tie_possible: about a third of bfloat16 amaxes; the RHT's columnwise copy and 4over6 at E4M3 256 on
# N(0, 1) data): today's kernel only (budget_tile<..., true>).
TIE_SAFE_SPECS = {
    f"{name}_tie_safe": SPECS[name]
    for name in ("rowwise_columnwise", "block_2d", "rht", "four_over_six_fast_math", "four_over_six")
}
AFTER_ELEMENTS = 16 * 8  # a thread's values per tile
BEFORE_ELEMENTS = 16  # the old kernel: one column of a 16-row stripe per thread

# NVFP4_BUDGET(name, mode, min_blocks, assignments...) defines the entry point budget_quantize_<name>,
# which sets the C++ QuantizeSpec's members by name (`s.rht = 1;` ...: the FFI attributes the Python spec
# passes, kernel_attrs()) and calls HOOK<LoadBF16, Mode::mode>(x, p, s): the steady-state tile
# loop (or one stripe) of a bf16 input. The same launch bounds as the kernels: 128 threads, and
# for 4over6 one block per multiprocessor (quantize_4over6_kernel).
ENTRY_MACRO = """
#define NVFP4_BUDGET(name, mode, min_blocks, ...)                                      \\
  extern "C" __global__ void __launch_bounds__(128, min_blocks)                        \\
      budget_quantize_##name(const uint16_t* x, nvfp4::cuda::Params p) {               \\
    nvfp4::QuantizeSpec s{};                                                           \\
    __VA_ARGS__                                                                        \\
    nvfp4::cuda::HOOK<nvfp4::LoadBF16, nvfp4::cuda::Mode::mode>(x, p, s);              \\
  }
"""
# The kernel's own hook (ffi/cuda/quantize.cu under NVFP4_SASS_BUDGET), and its tie-safe variant
# (NVFP4_BUDGET_TIE_SAFE: the hook's third template argument).
AFTER_WRAPPER = (
    '#include "cuda/quantize.cu"\n'
    + ENTRY_MACRO.replace("HOOK", "budget_tile")
    + ENTRY_MACRO.replace("NVFP4_BUDGET(", "NVFP4_BUDGET_TIE_SAFE(").replace(
        "HOOK<nvfp4::LoadBF16, nvfp4::cuda::Mode::mode>", "budget_tile<nvfp4::LoadBF16, nvfp4::cuda::Mode::mode, true>"
    )
)
# The old kernel (quantize_stripe<L, Mode>(x, p), Params {amax, amax_t, seed, rows, cols,
# stripes, tiles, spec, o}) has no hook: this wrapper adds one.
BEFORE_WRAPPER = """
#include "cuda/quantize.cu"
namespace nvfp4::cuda {
template <typename L, Mode kMode>
__device__ __forceinline__ void budget_stripe(const typename L::T* x, Params p, QuantizeSpec s) {
  p.spec = s;
  __builtin_assume(s.rowwise == (p.o.data != nullptr));
  __builtin_assume(s.columnwise == (p.o.data_t != nullptr));
  if (!s.rowwise) p.o.data = nullptr;
  if (!s.columnwise) p.o.data_t = nullptr;
  quantize_stripe<L, kMode>(x, p);
}
}
""" + ENTRY_MACRO.replace("HOOK", "budget_stripe")


# The dequantize and amax kernels: their device bodies (ffi/cuda/dequantize.cu, amax.cu) built
# under NVFP4_SASS_BUDGET, where dequantize takes its steady state (one amax, no NaN scale). Per
# row: (source, the new kernel's body and the elements its loop body covers, the element kernel's
# and its elements). The element kernels are ffa032c's kernels unchanged (still the path for the
# sizes the new ones do not take; their grid-stride loops kept rolled, one element or byte an
# iteration): they are the "before" column.
DEQUANTIZE_PIECES = (  # {S}: the storer
    "const nvfp4::cuda::PieceCodes<nvfp4::{S}>* d, const uint8_t* s, const float* a, uint32_t n, uint32_t m, "
    "nvfp4::DequantizeSpec p, {T}* o"
)
DEQUANTIZE_BYTES = (
    "const uint8_t* d, const uint8_t* s, const float* a, int64_t r, int64_t c, int64_t n, bool m, "
    "nvfp4::DequantizeSpec p, {T}* o"
)
AMAX_VECTORS = "const uint4* x, int64_t n, int64_t c, uint32_t* b"
AMAX_ELEMENTS = "const {T}* x, int64_t n, int64_t c, uint32_t* b"
UNROLL = 4  # kUnroll of amax.cu: vectors a loop iteration takes
DEQUANTIZE_UNROLL = 8  # kUnroll of dequantize.cu: pieces (the values of a 16-byte store) an iteration takes


def dequantize_row(storer: str, t: str, per_piece: int) -> tuple:
    params = DEQUANTIZE_PIECES.replace("{S}", storer)
    body = ("dequantize_pieces", params, DEQUANTIZE_UNROLL * per_piece)
    old = ("dequantize_bytes", DEQUANTIZE_BYTES, 2)  # a byte, two values, an iteration
    return ("dequantize.cu", *((f"{f}<nvfp4::{storer}>", p, t, n) for f, p, n in (body, old)))


def amax_row(loader: str, t: str, per_vector: int) -> tuple:
    body = ("amax_vectors", AMAX_VECTORS, UNROLL * per_vector)
    old = ("amax_elements", AMAX_ELEMENTS, 1)
    return ("amax.cu", *((f"{f}<nvfp4::{loader}>", p, t, n) for f, p, n in (body, old)))


OTHER_KERNELS = {  # row: (source, (body, parameters, T, elements), (element kernel ...))
    "dequantize_to_bf16": dequantize_row("StoreBF16", "uint16_t", 8),
    "dequantize_to_f32": dequantize_row("StoreF32", "float", 4),
    "amax_bf16": amax_row("LoadBF16", "uint16_t", 8),
    "amax_f32": amax_row("LoadF32", "float", 4),
}


def other_source(source: str, tmp: Path) -> tuple[Path, dict[str, tuple[str, int]], dict[str, tuple[str, int]]]:
    """An entry point per row of OTHER_KERNELS of `source` (the new body and the element kernel's),
    written under tmp; the (after, before) entries for measure."""
    lines = [f'#include "cuda/{source}"']
    after, before = {}, {}
    for row, (src, *bodies) in OTHER_KERNELS.items():
        if src != source:
            continue
        for (body, params, t, elements), entries, suffix in zip(
            bodies, (after, before), ("", "_elements"), strict=True
        ):
            name = f"budget_{row}{suffix}"
            args = ", ".join(p.split()[-1].lstrip("*") for p in params.split(", "))
            lines.append(
                f'extern "C" __global__ void __launch_bounds__(256) {name}({params.format(T=t)}) '
                f"{{ nvfp4::cuda::{body}({args}); }}"
            )
            entries[row] = (name, elements)
    path = tmp / f"budget_{source}"
    path.write_text("\n".join(lines) + "\n")
    return path, after, before


def tool(name: str) -> str:
    """A CUDA tool from the nvidia wheels if installed, else from PATH."""
    try:
        import nvidia

        for base in nvidia.__path__:
            for candidate in Path(base).glob(f"cu*/bin/{name}"):
                return str(candidate)
    except ImportError:
        pass
    found = shutil.which(name)
    if not found:
        sys.exit(
            f"sass_budget: {name} not found (pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
        )
    return found


def xla_include() -> str:
    import jaxlib

    return str(Path(jaxlib.__file__).parent / "include")


def compile_cubin(source: Path, include: Path, arch: str, out: Path) -> str:
    """Compiles `source` to a cubin for `arch`; returns ptxas's resource report."""
    nvcc = tool("nvcc")
    cmd = [
        nvcc,
        f"-arch={arch}",
        "-cubin",
        "-o",
        str(out),
        str(source),
        f"-I{include}",
        f"-I{xla_include()}",
        "-std=c++17",
        "--fmad=false",
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        "-diag-suppress=940,2473,177",
        "-DNVFP4_SASS_BUDGET",
        "-Xptxas",
        "-v",
    ]
    env = dict(os.environ, PATH=f"{Path(nvcc).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode:
        sys.exit(f"sass_budget: nvcc failed:\n{run.stderr}")
    return run.stderr


def resources(report: str) -> dict[str, dict[str, int]]:
    """Registers and spill bytes per budget entry point, from ptxas -v."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(budget_\w+)'", line):
            current = m.group(1)
        elif current and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            out.setdefault(current, {})["spills"] = int(m.group(1)) + int(m.group(2))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            out.setdefault(current, {})["registers"] = int(m.group(1))
            current = None
    return out


def sass_counts(cubin: Path) -> tuple[dict[str, int], set[str]]:
    """Instructions per budget entry point (no NOP padding or the closing self-branch): of the body
    of its outermost loop where it has one (the kernel's persistent tile loop: the steady state),
    else of the whole entry point. Also the entry points with a loop inside what is counted, whose
    count is then a lower bound of what runs."""
    cuobjdump = tool("cuobjdump")
    env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env, check=True).stdout
    functions: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        if m := re.search(r"Function : (budget_\w+)", line):
            current = m.group(1)
            functions[current] = []
        elif current and (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)):
            functions[current].append((int(m.group(1), 16), m.group(2).strip()))
    counts: dict[str, int] = {}
    loops: set[str] = set()
    for name, code in functions.items():
        kept, back = [], []  # back: (target, address) of each backward branch
        for address, instruction in code:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]
            if opcode == "NOP":
                continue
            if opcode.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", instruction)):
                target = int(t.group(1), 16)
                if target == address:
                    continue  # the self-loop after EXIT
                if target < address:
                    back.append((target, address))
            kept.append(address)
        first, last = min(back, key=lambda b: b[0] - b[1]) if back else (0, max(kept))
        counts[name] = sum(first <= a <= last for a in kept)
        if any((t, a) != (first, last) and first <= t and a <= last for t, a in back):
            loops.add(name)
    return counts, loops


def measure(source: Path, include: Path, arch: str, entries: dict[str, tuple[str, int]]) -> dict[str, dict]:
    """Builds `source` for `arch`; per row of `entries` (row -> (entry point, elements its loop body
    or whole body covers)): instructions per element, registers, spills."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "budget.cubin"
        report = compile_cubin(source, include, arch, cubin)
        (counts, loops), res = sass_counts(cubin), resources(report)
    table = {}
    for row, (key, elements) in entries.items():
        if key not in counts:
            continue
        table[row] = {
            "instructions_per_element": round(counts[key] / elements, 2),
            "registers": res.get(key, {}).get("registers"),
            "spills": res.get(key, {}).get("spills"),
            "has_loop": key in loops,
        }
    return table


def quantize_entries(elements: int, tie_safe: bool = False) -> dict[str, tuple[str, int]]:
    names = list(SPECS) + (list(TIE_SAFE_SPECS) if tie_safe else [])
    return {name: (f"budget_quantize_{name}", elements) for name in names}


def mode_of(spec: QuantizeSpec) -> str:
    """The kernel's rounding mode (its template argument) for ``spec``."""
    if spec.stochastic_rounding:
        return "kStochastic"
    return "kNearest" if spec.four_over_six_error is None else "kFourOverSix"


def budget_source(wrapper: str, tmp: Path, tie_safe: bool = False) -> Path:
    """`wrapper` (which includes the kernel) with an entry point per spec (and per tie-safe spec, on today's
    kernel), written under tmp."""
    lines = [wrapper]
    specs = [("NVFP4_BUDGET", name, spec) for name, spec in SPECS.items()]
    if tie_safe:
        specs += [("NVFP4_BUDGET_TIE_SAFE", name, spec) for name, spec in TIE_SAFE_SPECS.items()]
    for macro, name, spec in specs:
        mode = mode_of(spec)
        min_blocks = 1 if mode == "kFourOverSix" and wrapper is AFTER_WRAPPER else 0
        members = " ".join(f"s.{field} = {int(value)};" for field, value in spec.kernel_attrs().items())
        lines.append(f"{macro}({name}, {mode}, {min_blocks}, {members})")
    source = tmp / "budget.cu"
    source.write_text("\n".join(lines) + "\n")
    return source


def before_ffi(rev: str, tmp: Path) -> Path:
    """The ffi/ sources of git revision `rev`, extracted under tmp."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "ffi"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp / "ffi"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="nvcc -arch (default: sm_90 and sm_100a)")
    parser.add_argument("--before", metavar="REV", help="also measure the kernel of this git revision")
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()
    archs = args.arch or ["sm_90", "sm_100a"]
    result: dict[str, dict] = {}
    for arch in archs:
        print(f"building the budget entry points for {arch} ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            source = budget_source(AFTER_WRAPPER, Path(tmp), tie_safe=True)
            entries = quantize_entries(AFTER_ELEMENTS, tie_safe=True)
            result.setdefault(arch, {})["after"] = measure(source, ROOT / "ffi", arch, entries)
        tiled_before = False  # REV has today's tile kernel (its hook budget_tile), not the stripe kernel
        if args.before:
            print(f"building {args.before}'s kernel for {arch} ...", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                include = before_ffi(args.before, Path(tmp))
                tiled_before = "budget_tile" in (include / "cuda" / "quantize.cu").read_text()
                wrapper, elements = (
                    (AFTER_WRAPPER, AFTER_ELEMENTS) if tiled_before else (BEFORE_WRAPPER, BEFORE_ELEMENTS)
                )
                source = budget_source(wrapper, Path(tmp))
                result[arch]["before"] = measure(source, include, arch, quantize_entries(elements))
        for kernel_source in sorted({src for src, *_ in OTHER_KERNELS.values()}):
            print(f"building {kernel_source}'s kernels for {arch} ...", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                source, after, before = other_source(kernel_source, Path(tmp))
                result[arch]["after"].update(measure(source, ROOT / "ffi", arch, after))
                if args.before and not tiled_before:  # the element kernels: the stripe kernel's time
                    result[arch]["before"].update(measure(source, ROOT / "ffi", arch, before))
    plain = "rowwise_columnwise"  # "+": has a loop, the count is a lower bound
    for arch, tables in result.items():
        print(f"\n{arch}: SASS instructions per input element (registers, spill bytes)")
        print(f"{'spec':34} " + " ".join(f"{k:>22}" for k in tables) + "  x plain")
        for name in list(SPECS) + list(TIE_SAFE_SPECS) + list(OTHER_KERNELS):
            cells = []
            for table in tables.values():
                row = table.get(name)
                cells.append(
                    f"{row['instructions_per_element']:8.2f}{'+' if row['has_loop'] else ' '}"
                    f"({row['registers']:3}, {row['spills']:4})"
                    if row
                    else f"{'-':>22}"
                )
            after = tables["after"]
            ratio = after[name]["instructions_per_element"] / after[plain]["instructions_per_element"]
            print(f"{name:34} " + " ".join(f"{c:>22}" for c in cells) + f"  {ratio:6.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
