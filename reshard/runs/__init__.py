"""Runs: turn each planned chunk into byte runs of the source files, or, for dequantized tensors, into bounded
slabs of computed values.

Its interface is `__all__`, imported from the package (`from reshard.runs import X`); its modules are private
(`_name.py`) and used inside `runs` only. Each name is imported from its module on first use (PEP 562), so a user of one
name does not import the others' dependencies (torch, numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names for static tools; at run time each comes on first use
    from ._byte_runs import Run, chunk_runs, placed_runs, row_major_strides
    from ._dequant import Dequantizer, check_decodable
    from ._engine import Engine
    from ._fetch import remember, spans
    from ._source_check import SourceCrcs

_EXPORTS = {
    "Dequantizer": "_dequant",
    "Engine": "_engine",
    "Run": "_byte_runs",
    "SourceCrcs": "_source_check",
    "check_decodable": "_dequant",
    "chunk_runs": "_byte_runs",
    "placed_runs": "_byte_runs",
    "remember": "_fetch",
    "row_major_strides": "_byte_runs",
    "spans": "_fetch",
}

__all__ = [
    "Dequantizer", "Engine", "Run", "SourceCrcs", "check_decodable", "chunk_runs", "placed_runs", "remember",
    "row_major_strides", "spans",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
