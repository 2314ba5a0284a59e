"""Turn a chunk (a box of an in-memory tensor) into byte runs: where each of its bytes lies in the source files.

What the engine (`reshard.runs._engine`) copies for `write`, `merge` and mesh-to-mesh: a run is a stretch contiguous
both in a source tensor and in the output chunk, so gate and up rows fused into `gate_up_proj`, a chunk split on dim
1, or a per-expert key cut back out of a fused tensor are all copied by the kernel, never materialized. Chunks of
dequantized tensors are computed instead (`reshard.runs._dequant`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..plan import Box, DTYPE_BITS, TargetTensor, box_is_empty
from ..read import TensorEntry


@dataclass(frozen=True)
class Run:
    """A byte range copied from a source file into an output chunk."""

    file: str
    src: int  # absolute offset in the source file
    dst: int  # offset inside the output chunk
    nbytes: int


def row_major_strides(shape) -> list[int]:
    """Element strides of a contiguous row-major array of `shape`."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def chunk_runs(tensor: TargetTensor, box: Box, entries: dict[str, TensorEntry]) -> list[Run]:
    """The byte runs that build `tensor`'s chunk `box` from its on-disk pieces, in output order.

    Args:
        tensor: the in-memory tensor and its pieces.
        box: the chunk, `(offset, length)` per dim in global coordinates.
        entries: the source tensors by on-disk key.

    Returns:
        Runs sorted by output offset that tile the chunk's bytes exactly once.
    """
    if box_is_empty(box):
        return []
    itemsize = DTYPE_BITS[tensor.dtype] // 8
    out_lengths = [length for _, length in box]
    out_strides = row_major_strides(out_lengths)
    runs = []
    for piece in tensor.pieces:
        entry = entries[piece.source]
        extent = tensor.piece_shape(piece, entry.shape)
        lo = [max(b, o) for (b, _), o in zip(box, piece.offset)]
        hi = [min(b + n, o + e) for (b, n), o, e in zip(box, piece.offset, extent)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        lengths = [h - l for l, h in zip(lo, hi)]
        # the run covers dims k.. : every dim after k must be whole in the piece and in the chunk
        k = max(len(lengths) - 1, 0)  # a 0-dim tensor (an extra can be one) is one run of one element
        while k > 0 and lengths[k] == extent[k] == out_lengths[k]:
            k -= 1
        run_elems = math.prod(lengths[k:])
        src_strides = row_major_strides(extent)
        for prefix in itertools.product(*(range(n) for n in lengths[:k])):
            idx = list(prefix) + [0] * (len(lengths) - k)
            src_elem = sum((lo[j] + idx[j] - piece.offset[j]) * src_strides[j] for j in range(len(idx)))
            dst_elem = sum((lo[j] + idx[j] - box[j][0]) * out_strides[j] for j in range(len(idx)))
            runs.append(Run(entry.file, entry.data_start + src_elem * itemsize, dst_elem * itemsize,
                            run_elems * itemsize))
    runs.sort(key=lambda r: r.dst)
    expected = math.prod(out_lengths) * itemsize
    if sum(r.nbytes for r in runs) != expected:
        raise AssertionError(f"{tensor.name}: runs cover {sum(r.nbytes for r in runs)} of {expected} bytes")
    return runs


def placed_runs(start: int, boxes: list, entries: dict[str, TensorEntry]) -> tuple[list[Run], int]:
    """The byte runs that fill `(nbytes, tensor, box)` chunks one after another from file offset `start`, each run's
    `dst` an absolute offset in the file, and the offset where the last chunk ends (the file's size)."""
    placed, base = [], start
    for nbytes, tensor, box in boxes:
        if nbytes:  # an empty marker has no bytes to place
            placed += [Run(r.file, r.src, base + r.dst, r.nbytes) for r in chunk_runs(tensor, box, entries)]
        base += nbytes
    return placed, base
