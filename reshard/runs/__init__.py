"""Runs: turn each planned chunk into byte runs of the source files, or, for dequantized tensors, into bounded
slabs of computed values.
"""
