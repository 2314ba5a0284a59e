"""Which chunk of which tensor each output file holds: per fsdp coordinate, by tensor kind, split into parts.

Pure planning (no I/O): a coordinate's chunk list is derived from the plan's placements, one coordinate at a time,
so the writers' cost stays linear in tensors plus coordinates.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..errors import UsageError
from ._dtypes import DTYPE_BITS
from ._layout import TargetTensor
from ._placement import Box, ReshardPlan, local_box, local_sizes


class ChunkSpec(NamedTuple):
    """One tensor's chunk in one output file (a named tuple: a coordinate's list has one per tensor, built often)."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # the local shape (zeros for an empty marker)
    offsets: tuple[int, ...]  # global offsets, torch's convention for empty chunks
    nbytes: int
    index: int  # the tensor's position in the plan (the manifest's `order`)


def coordinate_chunks(plan: ReshardPlan, coord: int) -> list[tuple[ChunkSpec, TargetTensor, Box]]:
    """What fsdp coordinate `coord` stores: a chunk or an empty marker of every sharded tensor, and a whole copy of
    every replicated tensor (a persistent buffer), so each coordinate's files hold everything its ranks load.

    O(tensors) for one coordinate; a tensor's chunk depends only on its kind, (shape, placement, dtype), of which a
    model has a few dozen, so each kind's chunk is computed once per coordinate.
    """
    kinds, tensors = plan.tensor_kinds
    per_kind = []  # (box, local shape, offsets, bytes) of each kind on this coordinate
    for shape, placement, dtype in kinds:
        box = local_box(shape, placement, plan.mesh, coord)
        local = tuple(length for _, length in box)
        per_kind.append((box, local, tuple(o for o, _ in box), math.prod(local) * DTYPE_BITS[dtype] // 8))
    out = []
    for index, (tensor, kind) in enumerate(tensors):
        box, local, offsets, nbytes = per_kind[kind]
        out.append((ChunkSpec(tensor.name, tensor.dtype, local, offsets, nbytes, index), tensor, box))
    return out


def coordinate_key(plan: ReshardPlan, coord: int) -> tuple[Box, ...]:
    """The box of every kind on `coord`: two coordinates with equal keys store equal chunks (`coordinate_chunks`),
    as every empty coordinate of a large mesh does. O(kinds)."""
    kinds, _ = plan.tensor_kinds
    box = local_box.__wrapped__  # uncached: kinds x coordinates entries would only evict one another
    return tuple(box(shape, placement, plan.mesh, coord) for shape, placement, _ in kinds)


def check_max_shard_size(value) -> None:
    """Refuse a file size that would split nothing sensibly: 0 (read as "no limit") or below (a file per tensor).

    Raises:
        UsageError: `value` is neither None nor a whole number of bytes, 1 or more.
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise UsageError(f"max_shard_size {value!r}: a file size is a whole number of bytes, 1 or more (or None for "
                         "no limit). Nothing was changed.")


def split_parts(items: list, max_bytes: int | None, *, nbytes=lambda item: item[0].nbytes) -> list[list]:
    """Greedy split, in order, into files of at most `max_bytes` (a larger item gets its own): one coordinate's
    chunks (`(ChunkSpec, ...)` items, the default `nbytes`), or a merge's output tensors."""
    if not max_bytes:
        return [items]
    parts, current, size = [], [], 0
    for item in items:
        if current and size + nbytes(item) > max_bytes:
            parts.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes(item)
    parts.append(current)
    return parts


def coordinate_sizes(plan: ReshardPlan) -> list[int]:
    """Bytes of shard data each coordinate's files hold, in O(tensors + kinds x coordinates): a tensor's chunk size
    depends only on its kind (see `coordinate_chunks`), so no coordinate's chunk list is built."""
    kinds, tensors = plan.tensor_kinds
    members = [0] * len(kinds)
    for _, kind in tensors:
        members[kind] += 1
    sizes = [0] * plan.mesh.num_coords
    for (shape, placement, dtype), count in zip(kinds, members):
        scale = count * DTYPE_BITS[dtype] // 8  # byte-sized dtypes only (sub-byte ones are refused when read)
        sizes = [total + scale * n for total, n in zip(sizes, local_sizes(shape, placement, plan.mesh))]
    return sizes
