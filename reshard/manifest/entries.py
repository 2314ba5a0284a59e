"""The manifest's entries, typed: a chunk, a tensor, a file and a coordinate, and the chunks a file entry holds.

A chunk is never stored: its offsets and shape follow from the tensor's placement and the file's coordinate
(`local_box`), so the manifest stays linear in tensors plus coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.mesh import MeshSpec
from ..plan.placement import Kind, Placement, local_box


@dataclass(frozen=True)
class Chunk:
    """One tensor's chunk in one file, derived from the manifest: its name, global offsets, local shape and dtype."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str | None = None  # the manifest's dtype of the tensor (None: not compared)

    @property
    def is_empty(self) -> bool:
        return 0 in self.shape


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the manifest's `tensors`, checked: its global shape, dtype, role and the placement written."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    is_param: bool
    placement: Placement


@dataclass(frozen=True)
class FileEntry:
    """One entry of the manifest's `files`, checked: a plain file name, its fsdp coordinate, the run of `order` it
    holds (`first`, `count`), its size, CRC-32 and empty-marker count."""

    name: str
    coord: int
    first: int
    count: int
    bytes: int
    crc32: str
    empty_markers: int

    def __getitem__(self, key: str):
        # the document's spelling (`entry["name"]`), for code written against the JSON entries
        return getattr(self, key)


@dataclass(frozen=True)
class CoordEntry:
    """One entry of the manifest's `coords`: the ranks that read this coordinate's files (derived from the mesh,
    `MeshSpec.coord_ranks`: a range, never a list as long as dp_replicate), and those files."""

    coord: int
    ranks: range
    files: tuple[str, ...]
    empty_markers: int


def placement_of(info: dict) -> Placement:
    """The `Placement` a manifest tensor entry records."""
    p = info["placement"]
    return Placement(Kind(p["kind"]), p["shard_dim"], p["degree"], p["ep"])


def file_chunks(data: dict, entry: dict) -> list[Chunk]:
    """The chunks of one file entry of a manifest document (pure; O(tensors in the file))."""
    mesh = MeshSpec(**data["mesh"])
    tensors = data["tensors"]
    out = []
    for name in data["order"][entry["first"]:entry["first"] + entry["count"]]:
        info = tensors[name]
        box = local_box(tuple(info["shape"]), placement_of(info), mesh, entry["coord"])
        out.append(Chunk(name, tuple(o for o, _ in box), tuple(n for _, n in box), info["dtype"]))
    return out

