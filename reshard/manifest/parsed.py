"""`reshard.json` read from a folder, validated and typed: which files each rank reads and what each holds.

A file's header is checked against the chunks the manifest derives for it here, once (`header_problems`): verify,
every load path, the reader and a read as a source use that one check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ManifestError
from ..plan.mesh import MeshSpec
from ..plan.placement import local_box
from .entries import Chunk, CoordEntry, FileEntry, TensorInfo
from .format import DCP_SHARDING_INFO_KEY, MANIFEST_NAME, REMEDY, SAVED_OFFSETS_KEY, show
from .members import open_member
from .validate import validate_manifest

MAX_MANIFEST_BYTES = 1 << 30  # far above any real manifest (linear in tensors plus coordinates)


@dataclass(frozen=True)
class Manifest:
    """`reshard.json`, parsed and validated (`validate_manifest`) on construction: `Manifest(data, path)` of a
    document that is not a sound manifest raises `ManifestError`. See docs/format.md, "The manifest", for every field.

    The manifest's size grows with tensors plus coordinates, not their product: a file entry names the run of
    `order` it holds (`first`, `count`), and each chunk's offsets and shape follow from the tensor's placement and
    the file's coordinate (`local_box`), computed here for the coordinates asked about only.

    Attributes:
        data: the whole JSON document (validated; the typed fields below are its checked view).
        path: the folder it was read from.
        mesh, order, tensors, files, coords, copied: the checked sections.
    """

    data: dict
    path: Path
    mesh: MeshSpec = field(init=False, repr=False)
    order: tuple[str, ...] = field(init=False, repr=False)
    tensors: dict[str, TensorInfo] = field(init=False, repr=False)
    files: tuple[FileEntry, ...] = field(init=False, repr=False)
    coords: tuple[CoordEntry, ...] = field(init=False, repr=False)
    copied: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        for name, value in validate_manifest(self.data).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_by_name", {f.name: f for f in self.files})

    def files_of_rank(self, rank: int) -> list[str]:
        """The files rank `rank` reads its shards from (its coordinate's files)."""
        return self.files_of_coord(self.mesh.coord_of(rank))

    def files_of_coord(self, coord: int) -> list[str]:
        return list(self.coords[coord].files)

    def file_entry(self, name: str) -> FileEntry:
        return self._by_name[name]

    def chunks(self, entry: FileEntry) -> list[Chunk]:
        """The chunks file `entry` holds, in file order (O(tensors in the file))."""
        out = []
        for name in self.order[entry.first:entry.first + entry.count]:
            info = self.tensors[name]
            box = local_box(info.shape, info.placement, self.mesh, entry.coord)
            out.append(Chunk(name, tuple(o for o, _ in box), tuple(n for _, n in box), info.dtype))
        return out

    def empty_of_rank(self, rank: int) -> list[str]:
        """Tensors whose local is empty on `rank` (an explicit empty marker in its files)."""
        coord = self.mesh.coord_of(rank)
        return [c.name for name in self.files_of_coord(coord) for c in self.chunks(self.file_entry(name))
                if c.is_empty]

    def files_for_ranks(self, ranks) -> list[str]:
        """Every file the ranks `ranks` need to load, relative to the folder: the manifest, the copied non-weight
        files (config, tokenizer, ...) and each rank's shard files, in that order.

        Raises:
            MeshError: a rank outside the mesh.
        """
        coords = sorted({self.mesh.coord_of(r) for r in ranks})
        return [MANIFEST_NAME, *self.copied, *(name for c in coords for name in self.files_of_coord(c))]

    def open_file(self, name: str):
        """`open_member(self.path, name)`: a file of the folder, opened only if it is a regular file."""
        return open_member(self.path, name)


def read_manifest(folder: str | Path) -> Manifest:
    """Read `reshard.json` in `folder` and validate it (`validate_manifest`).

    Raises:
        ManifestError: the manifest is missing, not a regular file, not JSON, of an unknown format/version, or not
            a sound manifest (naming the key and the value).
    """
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    try:
        with open_member(folder, MANIFEST_NAME) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError([f"{path}: over {MAX_MANIFEST_BYTES} bytes, not a manifest reshard writes. {REMEDY}"])
        data = json.loads(raw)
    except FileNotFoundError as e:
        raise ManifestError([f"{path}: no manifest; this folder was not written by `reshard write` (or the write "
                             "did not finish). Write it again."]) from e
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than the parser goes
        raise ManifestError([f"{path}: unreadable manifest ({type(e).__name__}: {str(e)[:200]}). {REMEDY}"]) from e
    return Manifest(data, folder)


def header_problems(entry: FileEntry, expected: list[Chunk], header) -> list[str]:
    """Where a file's parsed header (`checkpoint.FileHeader`) differs from the chunks the manifest derives for it
    (`expected`): the same tensors, each with the manifest's dtype, its shape and `DCP_SHARDING_INFO` offsets, the
    empty markers the entry counts, and each tensor's data where the manifest's order puts it (`_placement_problems`).
    The one check of a header against the manifest: verify, every load path, the reader and a read as a source use
    it."""
    name = entry.name
    try:
        saved = json.loads(header.metadata.get(DCP_SHARDING_INFO_KEY) or "{}")
    except (ValueError, RecursionError):
        saved = None
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        return [f"{name}: the header's {DCP_SHARDING_INFO_KEY} is not a JSON object of tensor offsets"]
    stored = {t.name: t for t in header.tensors}
    problems = []
    if set(stored) != {c.name for c in expected}:
        problems.append(f"{name}: header holds {sorted(set(stored) ^ {c.name for c in expected})[:3]} differently "
                        "from the manifest")
    if entry.empty_markers != sum(c.is_empty for c in expected):
        problems.append(f"{name}: the manifest counts {entry.empty_markers} empty markers, its chunks have "
                        f"{sum(c.is_empty for c in expected)}")
    for chunk in expected:
        if chunk.name not in stored:
            continue
        tensor = stored[chunk.name]
        if chunk.dtype is not None and tensor.dtype != chunk.dtype:
            problems.append(f"{name}: {chunk.name} is {tensor.dtype} in the header, {chunk.dtype} in the manifest")
        offsets = saved.get(chunk.name, {}).get(SAVED_OFFSETS_KEY)
        if list(tensor.shape) != list(chunk.shape) or not isinstance(offsets, list) or tuple(offsets) != chunk.offsets:
            problems.append(f"{name}: {chunk.name} shape/offsets {list(tensor.shape)}/{show(offsets)} differ from "
                            f"the manifest's {list(chunk.shape)}/{list(chunk.offsets)}")
    return problems + _placement_problems(name, expected, stored, header, ends_checked=not problems)


def _placement_problems(name: str, expected: list[Chunk], stored: dict, header, *, ends_checked: bool) -> list[str]:
    """Where the data offsets deviate from the layout the manifest implies: the writer puts a file's tensors back to
    back in the manifest's order from the header's end, so each offset is derived, never trusted. Checked in that
    order, not in data-offset order: two same-size tensors whose offsets were swapped are contiguous either way, and
    would load swapped. `ends_checked`: whether data ending before the file does is a problem too (not worth
    saying when the header is wrong already)."""
    cursor = header.header_bytes
    for chunk in expected:
        tensor = stored.get(chunk.name)
        if tensor is None:
            return []  # a missing or extra tensor is reported above
        if tensor.data_start != cursor:
            return [f"{name}: {chunk.name}'s data begins at byte {tensor.data_start}, but the manifest's order puts "
                    f"it at byte {cursor}, right after {_before(expected, chunk)}: the header's data_offsets were "
                    "altered"]
        cursor += tensor.nbytes
    if ends_checked and header.size is not None and cursor != header.size:
        return [f"{name}: the header's tensors end at byte {cursor}, the file has {header.size}"]
    return []


def _before(expected: list[Chunk], chunk: Chunk) -> str:
    at = expected.index(chunk)
    return f"{expected[at - 1].name}'s data" if at else "the header"
