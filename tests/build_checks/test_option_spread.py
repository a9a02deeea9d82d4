"""How many files of jax_nvfp4/ and ffi/ spell each quantization option in code (comments and docstrings aside):
what adding or changing an option costs. docs/maintainers.md ("How to add an option") names the files.

At most 9 files an option: the code past the spec, its kernels and the recipe reads decoded views of it
(``QuantizeSpec.global_scale``, ``block_shape``, ``draws_random``, ``seed``, ``copy_shapes``; in C++ the
spec's ``amaxes_per_entry``, ``cost_per_byte`` and the CPU stripe's ``Options``) instead of its flags.
``SPREAD`` holds each option's count as it is, so that an option spreads to no new file; lower an entry when a
change takes the option out of files."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

REPO = pathlib.Path(__file__).resolve().parents[2]
TARGET = 9
# The QuantizeSpec fields that change the numerics, and the files that spell each today.
SPREAD = {
    "row_scaled": 7,
    "block_2d": 7,
    "stochastic_rounding": 7,
    "e4m3_max": 9,
    "rht": 7,
    "rht_amax_factor": 2,
    "four_over_six_error": 3,
    "four_over_six_fast_math": 3,
}


def _code_names(path: pathlib.Path) -> set[str]:
    """The identifiers ``path`` uses in code: Python names (and short string literals, such as keyword names),
    C++ tokens outside comments."""
    text = path.read_text()
    if path.suffix == ".py":
        names = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME:
                names.add(tok.string)
            elif tok.type == tokenize.STRING and re.fullmatch(r"[\"']\w+[\"']", tok.string):
                names.add(tok.string[1:-1])
        return names
    text = re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)
    return set(re.findall(r"\w+", text))


def option_files() -> dict[str, list[str]]:
    """Each option -> the files of jax_nvfp4/ and ffi/ that spell it in code."""
    files = sorted((REPO / "jax_nvfp4").rglob("*.py")) + sorted(
        p for p in (REPO / "ffi").rglob("*") if p.suffix in (".h", ".cc", ".cu", ".cuh")
    )
    names = {p: _code_names(p) for p in files}
    return {o: [str(p.relative_to(REPO)) for p in files if o in names[p]] for o in SPREAD}


def test_no_option_spreads_to_more_files():
    assert max(SPREAD.values()) <= TARGET
    found = option_files()
    grown = {o: files for o, files in found.items() if len(files) > SPREAD[o]}
    assert not grown, f"options spelled in more files than SPREAD allows (target {TARGET}): {grown}"
    shrunk = {o: len(files) for o, files in found.items() if len(files) < SPREAD[o]}
    assert not shrunk, f"lower SPREAD to the new counts: {shrunk}"


def test_the_count_reads_code_not_comments(tmp_path):
    py, cc = tmp_path / "a.py", tmp_path / "a.cc"
    py.write_text('"""row_scaled in a docstring"""\n# block_2d in a comment\nx = spec.rht\nf(**{"e4m3_max": 1})\n')
    cc.write_text("// row_scaled\n/* block_2d */ bool stochastic_rounding;\n")
    assert {"rht", "e4m3_max"} <= _code_names(py) and not {"row_scaled", "block_2d"} & _code_names(py)
    assert "stochastic_rounding" in _code_names(cc) and not {"row_scaled", "block_2d"} & _code_names(cc)
