"""The test suite's layout: tests in feature folders, what they share in tests/helpers/ only.

Parses every Python file under tests/ (no imports, well under a second): no file imports a test module or
conftest (shared code goes to helpers, pytest configuration stays in conftest.py); a module-level function or
class is defined in one file only (leading underscores aside: ``_unpack`` is ``unpack``), test functions,
pytest hooks and fixtures aside; test files' basenames are unique and test folders have no ``__init__.py``
(pytest's default import mode imports each test file by its basename).
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
HELPERS = TESTS / "helpers"


@functools.cache
def _sources() -> dict[pathlib.Path, ast.Module]:
    files = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    return {p: ast.parse(p.read_text(), str(p)) for p in files}


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(TESTS))


def _imported_modules(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def _is_fixture(node) -> bool:
    def name(decorator):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)

    return any(name(d) == "fixture" for d in node.decorator_list)


def test_no_file_imports_a_test_module_or_conftest():
    found = [
        f"{_name(path)} imports {module}"
        for path, tree in _sources().items()
        for module in _imported_modules(tree)
        if module.split(".")[0].startswith("test_") or module.split(".")[0] == "conftest"
    ]
    assert not found, "shared code goes to tests/helpers/: " + "; ".join(found)


def test_each_module_level_helper_is_defined_once():
    where = collections.defaultdict(list)
    for path, tree in _sources().items():
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if node.name.startswith(("test_", "pytest_")) or _is_fixture(node):
                continue
            where[node.name.lstrip("_")].append(f"{_name(path)}:{node.lineno} {node.name}")
    repeated = {name: places for name, places in where.items() if len({p.split(":")[0] for p in places}) > 1}
    assert not repeated, f"one definition each (a shared one in tests/helpers/, else distinct names): {repeated}"


def test_test_files_have_unique_basenames_and_folders_no_init():
    tests = collections.Counter(path.name for path in _sources() if path.name.startswith("test_"))
    assert not [name for name, n in tests.items() if n > 1], tests
    inits = [_name(path) for path in _sources() if path.name == "__init__.py" and path.parent != HELPERS]
    assert not inits, inits
