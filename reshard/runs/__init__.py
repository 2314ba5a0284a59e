"""Runs: turn each planned chunk into byte runs of the source files, or, for dequantized tensors, into bounded
slabs of computed values.

Its interface is `__all__`, imported from the package (`from reshard.runs import X`); its modules are private
(`_name.py`) and used inside `runs` only. Each name is imported from its module on first use (PEP 562), so a user of one
name does not import the others' dependencies (torch, numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # the names for static tools; at run time each comes on first use
    from ._byte_runs import Run, chunk_runs, placed_runs, row_major_strides
    from ._dequant import Dequantizer, check_decodable
    from ._engine import Engine
    from ._fetch import remember
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
}

__all__ = [
    "Dequantizer", "Engine", "Run", "SourceCrcs", "check_decodable", "chunk_runs", "placed_runs", "remember",
    "row_major_strides",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
