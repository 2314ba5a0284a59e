"""Coverage: whether a manifest puts every element of every tensor somewhere exactly once, and where it does not.

Pure and bounded: O(files + tensors + kinds x coordinates), a kind being a distinct (shape, placement) pair.
"""

from __future__ import annotations

import itertools
import math

from ..plan import Kind, MeshSpec, coordinate_boxes


def _tiles(intervals: list[tuple[int, int]], size: int) -> bool:
    """Whether distinct `(offset, length)` intervals tile `[0, size)` exactly once."""
    cursor = 0
    for offset, length in sorted(intervals):
        if offset != cursor:
            return False
        cursor += length
    return cursor == size


def coverage_problems(manifest) -> list[str]:
    """What `manifest` (a `Manifest`) leaves uncovered or covers twice; pure, O(files + tensors + kinds x
    coordinates), where a kind is a distinct (shape, placement) pair: a few dozen, however many layers.

    Two things make every byte land exactly once: each coordinate's files hold the runs of `order` that together
    are all of it, once; and each tensor's chunks over the coordinates tile it. Every layout reshard writes is a grid
    (each dim split on its own), so a tensor is tiled exactly when, on every dim, the distinct chunk intervals tile the
    dim and the distinct chunks are all the cells of that grid. A replicated tensor is whole in every coordinate.
    """
    mesh, order, problems = manifest.mesh, manifest.order, []
    held = getattr(manifest, "held_coords", None)  # a node's copy: the files of its coordinates only
    runs: dict[int, list[tuple[int, int]]] = {c: [] for c in (range(mesh.num_coords) if held is None else held)}
    for entry in manifest.files:
        runs.setdefault(entry.coord, []).append((entry.first, entry.count))
    for coord, found in runs.items():
        if not _tiles(found, len(order)) or len(set(found)) != len(found):
            problems.append(f"coordinate {coord}: its files hold tensors {sorted(found)} (first, count) of the "
                            f"{len(order)} in order, not each exactly once")
    by_kind: dict[tuple, str | None] = {}
    for name in order:
        info = manifest.tensors[name]
        kind = (info.shape, info.placement)
        if kind not in by_kind:
            by_kind[kind] = _tiling_problem(*kind, mesh)
        if by_kind[kind]:
            problems.append(f"{name}: {by_kind[kind]}")
    return problems


def _tiling_problem(shape: tuple[int, ...], placement, mesh: MeshSpec) -> str | None:
    """Whether a tensor's chunks over every coordinate tile it exactly once; what is wrong, or None."""
    boxes = coordinate_boxes(shape, placement, mesh)
    if placement.kind is Kind.REPLICATED:
        return None if set(boxes) == {tuple((0, n) for n in shape)} else "a replicated tensor is not whole everywhere"
    filled = [box for box in boxes if 0 not in (n for _, n in box)]
    distinct = set(filled)
    if len(distinct) != len(filled):
        return "a chunk is stored twice"
    if 0 in shape:
        return None  # nothing to cover
    return coverage_problem(shape, list(distinct))


def region_text(offsets, lengths) -> str:
    """`0:4, 8:16` for a box given as offsets and lengths."""
    return ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, lengths))


def coverage_problem(shape: tuple[int, ...], boxes: list[tuple[tuple[int, int], ...]], *,
                     gap_hint: str = "") -> str | None:
    """Whether distinct non-empty boxes tile `shape` exactly once; what is wrong (the overlap or a gap, as index
    ranges, the gap followed by `gap_hint`), or None.

    A grid (each dim's intervals tile the dim, one box per cell: every layout a mesh gives) is checked in
    O(boxes); anything else pairwise, after a sort on dim 0.
    """
    numel = math.prod(shape)
    if not shape:
        return None if boxes or numel == 0 else "no chunk holds it"
    per_dim = [sorted({box[d] for box in boxes}) for d in range(len(shape))]
    grid = all(_tiles(iv, n) for iv, n in zip(per_dim, shape)) and len(boxes) == math.prod(map(len, per_dim))
    if grid or numel == 0:
        return None
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b[0][0] >= a[0][0] + a[0][1]:
                break
            if all(bo < ao + an and ao < bo + bn for (ao, an), (bo, bn) in zip(a, b)):
                lo = [max(ao, bo) for (ao, _), (bo, _) in zip(a, b)]
                hi = [min(ao + an, bo + bn) for (ao, an), (bo, bn) in zip(a, b)]
                return (f"chunks [{region_text(*zip(*a))}] and [{region_text(*zip(*b))}] overlap on "
                        f"[{', '.join(f'{l}:{h}' for l, h in zip(lo, hi))}]")
    covered = sum(math.prod(n for _, n in box) for box in boxes)
    if covered == numel:
        return None  # disjoint and as many elements as the tensor: an exact tiling that is not a grid
    gap = _first_gap(shape, boxes)
    where = f"; [{gap}] is in no chunk" if gap else ""
    return f"the chunks cover {covered} of its {numel} elements{where}{gap_hint}"


def _first_gap(shape, boxes, limit: int = 200_000) -> str | None:
    """The first cell of the grid the boxes' edges draw that no box covers, as index ranges (None past `limit`)."""
    edges = [sorted({0, n, *(o for box in boxes for o in (box[d][0], box[d][0] + box[d][1]))})
             for d, n in enumerate(shape)]
    cells = [list(zip(e, e[1:])) for e in edges]
    for count, cell in enumerate(itertools.product(*cells)):
        if count >= limit:
            return None
        if not any(all(o <= lo and hi <= o + n for (lo, hi), (o, n) in zip(cell, box)) for box in boxes):
            return ", ".join(f"{lo}:{hi}" for lo, hi in cell)
    return None
