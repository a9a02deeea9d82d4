"""Renamed public names: the old name keeps working for one release, with a ``DeprecationWarning`` (CHANGELOG)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(module: str, names: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name of ``names`` (old -> new) as ``namespace[new]``,
    warning that it is deprecated and naming its replacement."""

    def module_getattr(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = names[name]
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in the next release; use {module}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return namespace[new]

    return module_getattr
