"""A package's names imported from their modules on first use (PEP 562), so a user of one name does not import the
others' dependencies (torch, numpy): `reshard`, `reshard.load` and `reshard.runs` export this way."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The `__getattr__` and `__dir__` of `package`, whose names `exports` maps to their modules (relative to it):
    each name is imported on first use and kept in `namespace` (the package's globals), so it is imported once."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
