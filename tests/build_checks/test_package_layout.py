"""The package's layout rules, read from its source: no private name crosses a module boundary."""

from __future__ import annotations

import ast
import pathlib

import pytest

import jax_nvfp4

PACKAGE = pathlib.Path(jax_nvfp4.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _private_names_taken(path: pathlib.Path) -> list[str]:
    """``_name``s that ``path`` imports from, or reads as an attribute of, another jax_nvfp4 module."""
    tree = ast.parse(path.read_text())
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_nvfp4"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("_nvfp4_"):  # compiled modules
                    found.append(f"from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("jax_nvfp4"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_crosses_modules(path):
    assert _private_names_taken(path) == []


def test_the_check_sees_a_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jax_nvfp4.linear import dot_general\nfrom jax_nvfp4.core.spec import _FLAGS\n")
    bad_attr = tmp_path / "bad_attr.py"
    bad_attr.write_text("from jax_nvfp4.reference import kernels\nkernels._six_times(448)\n")
    assert _private_names_taken(bad) == ["from jax_nvfp4.core.spec import _FLAGS"]
    assert _private_names_taken(bad_attr) == ["kernels._six_times"]


def test_modules_live_in_layer_folders():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "build_info.py", "checkpoint.py", "diagnostics.py", "qwix.py"]
    assert all(not p.name.startswith("_") or p.name in ("__init__.py", "__main__.py") for p in MODULES)
