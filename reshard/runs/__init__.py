"""Runs: turn each planned chunk into byte runs of the source files, or, for dequantized tensors, into bounded
slabs of computed values.

Its modules are what it exports (`__all__`); their names are used through them, e.g. `reshard.runs.byte_runs`.
"""

__all__ = ["byte_runs", "crc", "dequant", "direct", "engine", "fetch", "source_check"]
