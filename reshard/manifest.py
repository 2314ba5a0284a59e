"""The output format: per-coordinate safetensors files in the distributed-checkpoint layout, and `reshard.json`.

Files are named `shard-SSSSS-model-PPPPP-of-NNNNN.safetensors`: `SSSSS` is the 1-based fsdp coordinate (ranks
`c, c + fsdp, ...` of each replica read it), `PPPPP-of-NNNNN` the part among that coordinate's files. This is the
pattern transformers 5.23 recognises as a distributed checkpoint (`distributed/checkpoint.py`), and each header's
`__metadata__` carries what torch's `HuggingFaceStorageReader` needs: `DCP_SHARDING_INFO` (per tensor
`saved_offsets`), `DCP_VERSION` and `format`. The names mirror a private PyTorch module, so they are our own
constants here, pinned by a golden test.

An empty local shard is written as an explicit zero-size tensor whose offset is the dim's size (torch's
convention for empty shards) and listed in the manifest's `empty` per coordinate: nothing is silently missing.

Replicated tensors (persistent buffers such as `e_score_correction_bias`, which FSDP does not shard) are written
whole into every coordinate's first file, so each coordinate's files hold everything its ranks load: they can be
copied to node-local disks on their own (`reshard files`).
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import VerifyError
from .plan.mesh import MeshSpec

MANIFEST_NAME = "reshard.json"
MANIFEST_FORMAT = "reshard"
MANIFEST_VERSION = 2  # 2: file entries name a run of `order`; chunks follow from placements
SHARD_FILE = "shard-{coord:05d}-model-{part:05d}-of-{parts:05d}.safetensors"
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
DCP_VERSION_KEY = "DCP_VERSION"
DCP_VERSION = "1.0"
SAVED_OFFSETS_KEY = "saved_offsets"


def shard_file_name(coord: int, part: int, parts: int) -> str:
    """File name of part `part` (0-based) of `parts` for fsdp coordinate `coord` (0-based)."""
    return SHARD_FILE.format(coord=coord + 1, part=part + 1, parts=parts)


def dcp_metadata(offsets: dict[str, list[int]]) -> dict[str, str]:
    """The safetensors `__metadata__` torch's HuggingFaceStorageReader reads chunk offsets from."""
    info = {name: {SAVED_OFFSETS_KEY: list(off)} for name, off in offsets.items()}
    return {DCP_SHARDING_INFO_KEY: json.dumps(info, separators=(",", ":")), DCP_VERSION_KEY: DCP_VERSION,
            "format": "pt"}


@dataclass(frozen=True)
class Chunk:
    """One tensor's chunk in one file, derived from the manifest: its name, global offsets and local shape."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def is_empty(self) -> bool:
        return 0 in self.shape


@dataclass(frozen=True)
class Manifest:
    """`reshard.json`, parsed. See README.md, "The manifest", for every field.

    The manifest's size grows with tensors plus coordinates, not their product: a file entry names the run of
    `order` it holds (`first`, `count`), and each chunk's offsets and shape follow from the tensor's placement and
    the file's coordinate (`local_box`), computed here for the coordinates asked about only.

    Attributes:
        data: the whole JSON document.
        path: the folder it was read from.
    """

    data: dict
    path: Path

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec(**self.data["mesh"])

    @property
    def files(self) -> list[dict]:
        return self.data["files"]

    def files_of_rank(self, rank: int) -> list[str]:
        """The files rank `rank` reads its shards from (its coordinate's files)."""
        return self.files_of_coord(self.mesh.shard_index(rank))

    def files_of_coord(self, coord: int) -> list[str]:
        return list(self.data["coords"][coord]["files"])

    def file_entry(self, name: str) -> dict:
        return next(f for f in self.files if f["name"] == name)

    def chunks(self, entry: dict) -> list[Chunk]:
        """The chunks file `entry` holds, in file order."""
        return file_chunks(self.data, entry)

    def empty_of_rank(self, rank: int) -> list[str]:
        """Tensors whose local is empty on `rank` (an explicit empty marker in its files)."""
        coord = self.mesh.shard_index(rank)
        return [c.name for name in self.files_of_coord(coord) for c in self.chunks(self.file_entry(name))
                if c.is_empty]

    def files_for_ranks(self, ranks) -> list[str]:
        """Every file the ranks `ranks` need to load, relative to the folder: the manifest, the copied non-weight
        files (config, tokenizer, ...) and each rank's shard files, in that order.

        Raises:
            MeshError: a rank outside the mesh.
        """
        coords = sorted({self.mesh.shard_index(r) for r in ranks})
        return [MANIFEST_NAME, *self.data["copied"], *(name for c in coords for name in self.files_of_coord(c))]


def placement_of(info: dict):
    """The `Placement` a manifest tensor entry records."""
    from .plan.placement import Kind, Placement

    p = info["placement"]
    return Placement(Kind(p["kind"]), p["shard_dim"], p["degree"], p["ep"])


def file_chunks(data: dict, entry: dict) -> list[Chunk]:
    """The chunks of one file entry of a manifest document (pure; O(tensors in the file))."""
    from .plan.placement import local_box

    mesh = MeshSpec(**data["mesh"])
    tensors = data["tensors"]
    out = []
    for name in data["order"][entry["first"]:entry["first"] + entry["count"]]:
        info = tensors[name]
        box = local_box(tuple(info["shape"]), placement_of(info), mesh, entry["coord"])
        out.append(Chunk(name, tuple(o for o, _ in box), tuple(n for _, n in box)))
    return out


def read_manifest(folder: str | Path) -> Manifest:
    """Read and sanity-check `reshard.json` in `folder`.

    Raises:
        VerifyError: the manifest is missing, not JSON, or of an unknown format/version.
    """
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise VerifyError([f"{path}: no manifest; this folder was not written by `reshard write` (or the write "
                           "did not finish). Write it again."]) from e
    except (OSError, ValueError) as e:
        raise VerifyError([f"{path}: unreadable manifest ({e})."]) from e
    if data.get("format") == MANIFEST_FORMAT and data.get("version") == 1:
        raise VerifyError([f"{path}: written by an earlier reshard (manifest version 1, which lists every chunk of "
                           f"every file); this reshard reads version {MANIFEST_VERSION}. Write the folder again."])
    if data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
        raise VerifyError([f"{path}: format {data.get('format')!r} version {data.get('version')!r}; this reshard "
                           f"reads {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}."])
    return Manifest(data, folder)


def header_problems(entry: dict, expected: list[Chunk], header) -> list[str]:
    """Where a file's parsed header (`checkpoint.FileHeader`) differs from the chunks the manifest derives for it
    (`expected`): the same tensors, each with its shape and `DCP_SHARDING_INFO` offsets, and the empty markers the
    entry counts."""
    name = entry["name"]
    try:
        saved = json.loads(header.metadata.get(DCP_SHARDING_INFO_KEY) or "{}")
    except ValueError:
        saved = {}
    shapes = {t.name: list(t.shape) for t in header.tensors}
    problems = []
    if set(shapes) != {c.name for c in expected}:
        problems.append(f"{name}: header holds {sorted(set(shapes) ^ {c.name for c in expected})[:3]} differently "
                        "from the manifest")
    if entry.get("empty_markers") != sum(c.is_empty for c in expected):
        problems.append(f"{name}: the manifest counts {entry.get('empty_markers')} empty markers, its chunks have "
                        f"{sum(c.is_empty for c in expected)}")
    for chunk in expected:
        if chunk.name not in shapes:
            continue
        offsets = saved.get(chunk.name, {}).get(SAVED_OFFSETS_KEY)
        if shapes[chunk.name] != list(chunk.shape) or offsets is None or tuple(offsets) != chunk.offsets:
            problems.append(f"{name}: {chunk.name} shape/offsets {shapes[chunk.name]}/{offsets} differ from the "
                            f"manifest's {list(chunk.shape)}/{list(chunk.offsets)}")
    return problems


def _tiles(intervals: list[tuple[int, int]], size: int) -> bool:
    """Whether distinct `(offset, length)` intervals tile `[0, size)` exactly once."""
    cursor = 0
    for offset, length in sorted(intervals):
        if offset != cursor:
            return False
        cursor += length
    return cursor == size


def coverage_problems(data: dict) -> list[str]:
    """What the manifest leaves uncovered or covers twice; pure, O(files + tensors + kinds x coordinates), where a
    kind is a distinct (shape, placement) pair: a few dozen, however many layers.

    Two things make every byte land exactly once: each coordinate's files hold the runs of `order` that together
    are all of it, once; and each tensor's chunks over the coordinates tile it. Every layout reshard writes is a grid
    (each dim split on its own), so a tensor is tiled exactly when, on every dim, the distinct chunk intervals tile the
    dim and the distinct chunks are all the cells of that grid. A replicated tensor is whole in every coordinate.
    """
    mesh = MeshSpec(**data["mesh"])
    order, problems = data["order"], []
    runs: dict[int, list[tuple[int, int]]] = {c: [] for c in range(mesh.num_shard_groups)}
    for entry in data["files"]:
        runs.setdefault(entry["coord"], []).append((entry["first"], entry["count"]))
    for coord, found in runs.items():
        if not _tiles(found, len(order)) or len(set(found)) != len(found):
            problems.append(f"coordinate {coord}: its files hold tensors {sorted(found)} (first, count) of the "
                            f"{len(order)} in order, not each exactly once")
    by_kind: dict[tuple, str | None] = {}
    for name in order:
        info = data["tensors"][name]
        kind = (tuple(info["shape"]), placement_of(info))
        if kind not in by_kind:
            by_kind[kind] = _tiling_problem(*kind, mesh)
        if by_kind[kind]:
            problems.append(f"{name}: {by_kind[kind]}")
    return problems


def _tiling_problem(shape: tuple[int, ...], placement, mesh: MeshSpec) -> str | None:
    """Whether a tensor's chunks over every coordinate tile it exactly once; what is wrong, or None."""
    from .plan.placement import Kind, local_box

    boxes = [local_box(shape, placement, mesh, c) for c in range(mesh.num_shard_groups)]
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


def file_crc32(path: str | Path) -> str:
    """CRC-32 of a whole file as the manifest records it (8 hex digits), read through one reused 1 MiB buffer."""
    crc, buffer = 0, bytearray(1 << 20)  # a fresh block per read would cost page faults on every block
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def dump_manifest(data: dict) -> str:
    """Deterministic JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
