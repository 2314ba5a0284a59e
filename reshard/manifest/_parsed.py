"""`reshard.json` read from a folder, validated and typed: which files each rank reads and what each holds.

A file's header is checked against the chunks the manifest derives for it here, once (`header_problems`): verify,
every load path, the reader and a read as a source use that one check.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ManifestError, ReshardError, UsageError
from ..plan import LayoutMode, MeshSpec, RankSpans, ranks_text
from ._entries import (Chunk, CoordEntry, ExtrasEntry, FileEntry, SourceRecord, TensorInfo, chunk_of, plain_state,
                       set_state)
from ._format import (DCP_SHARDING_INFO_KEY, MANIFEST_FORMAT, MANIFEST_NAME, REMEDY, SAVED_OFFSETS_KEY, dump_manifest,
                      show)
from ._source_layout import recorded_source_layout
from ._validate import validate_manifest

MAX_MANIFEST_BYTES = 1 << 30  # far above any real manifest (linear in tensors plus coordinates)


_SHORT_ID = 12  # hex digits of a write's id shown in messages: enough to tell writes apart at a glance


def write_label(write_id: str | None) -> str:
    """`write 3f2a9c1b07de` (the id's first `_SHORT_ID` digits), or what a manifest without an id is."""
    if not write_id:
        return "a write of unknown identity (no write_id: an older reshard)"
    return f"write {write_id[:_SHORT_ID]}"


@dataclass(frozen=True)
class Manifest:
    """`reshard.json`, parsed and validated: the one typed value of a reshard folder's manifest. See docs/format.md,
    "The manifest", for every field.

    Built through `Manifest.from_document` (validated: a document that is not a sound manifest raises
    `ManifestError`) by `read_manifest`, and by the writer from its typed values (`Manifest.written`, which
    `reshard.manifest.build_manifest` calls: nothing parsed back). Pickled as its typed value. Its size grows with
    tensors plus coordinates, not their product: a file entry names the run of `order` it holds (`first`, `count`),
    and each chunk's offsets and shape follow from the tensor's placement and the file's coordinate (`chunks`).

    Attributes:
        where: the folder or URL it was read from (or will be written to), as messages show it.
        mesh, order, tensors, files, coords, copied, source, layout, extras, dropped_unloaded, tool: the checked
            sections (`layout`: a `LayoutMode`, balanced or stock).
        holds: for a node's own copy (`write --node-local`, `write --ranks`), the ranks whose files it holds, as
            `(first, last)` spans; None for a whole folder.
        write_id: the identity of the write the folder or copy belongs to (`reshard.manifest._document.write_id`),
            the same in every node's copy of one write; None in a manifest written before reshard recorded it.
    """

    where: str
    mesh: MeshSpec
    order: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    files: tuple[FileEntry, ...]
    coords: tuple[CoordEntry, ...]
    copied: tuple[str, ...]
    source: SourceRecord
    layout: LayoutMode
    extras: tuple[ExtrasEntry, ...]
    dropped_unloaded: int
    tool: str
    holds: tuple[tuple[int, int], ...] | None
    write_id: str | None
    _document: dict = field(repr=False, compare=False)

    @classmethod
    def from_document(cls, document, where: str | os.PathLike) -> "Manifest":
        """The manifest `document` (parsed JSON) describes, validated (`validate_manifest`).

        Raises:
            ManifestError: the document is not a sound manifest (naming the key and its value).
        """
        return cls(str(where), **validate_manifest(document), _document=document)

    @classmethod
    def written(cls, document: dict, where: str | os.PathLike, **fields) -> "Manifest":
        """The manifest a write records: `fields` (those of `validate_manifest`) typed as the writer holds them, and
        the `document` built from them that `to_json` writes; not parsed back."""
        return cls(str(where), **fields, _document=document)

    def to_json(self) -> str:
        """The document as `reshard.json` holds it (deterministic: sorted keys)."""
        return dump_manifest(self._document)

    @property
    def record_digest(self) -> str:
        """SHA-256 of the manifest as recorded (`to_json`): every field, each file's CRC-32 included. Equal for a
        folder every node sees and for whole copies of it; what copies without a `write_id` are compared by."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def __getstate__(self) -> dict:  # to a worker process as its typed value (no cached view, nothing validated)
        return plain_state(self, "tensors")

    def __setstate__(self, state: dict) -> None:
        set_state(self, state, "tensors")

    @functools.cached_property
    def _by_name(self) -> dict[str, FileEntry]:
        return {f.name: f for f in self.files}

    def files_of_rank(self, rank: int) -> list[str]:
        """The files rank `rank` reads its shards from (its coordinate's files)."""
        return self.files_of_coord(self.mesh.coord_of(rank))

    def files_of_coord(self, coord: int) -> list[str]:
        return list(self.coords[coord].files)

    def file_entry(self, name: str) -> FileEntry:
        return self._by_name[name]

    def chunks(self, entry: FileEntry) -> list[Chunk]:
        """The chunks file `entry` holds, in file order (O(tensors in the file))."""
        return [chunk_of(self.tensors[name], self.mesh, entry.coord)
                for name in self.order[entry.first:entry.first + entry.count]]

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

    @functools.cached_property
    def held_coords(self) -> tuple[int, ...]:
        """The coordinates whose files this copy holds: every one, or those of `holds`."""
        return tuple(range(self.mesh.num_coords) if self.holds is None else self.mesh.coords_of(self.holds))

    def for_ranks(self, spans) -> "Manifest":
        """The manifest of a copy holding only the files ranks `spans` load (a node's copy staged by hand with `reshard
        files --ranks`): their coordinates' files, no extras files (no rank loads those).

        Raises:
            UsageError: a rank outside the mesh, or one whose files this copy does not hold.
        """
        from dataclasses import replace

        world = self.mesh.world_size
        if (top := max(last for _, last in spans)) >= world:
            raise UsageError(f"--ranks names rank {top}, but {self.where} is for a mesh of {world} ranks "
                             f"(0-{world - 1}). Nothing was checked.")
        coords = set(self.mesh.coords_of(spans))
        if missing := sorted(coords - set(self.held_coords)):
            outside = self.coords[missing[0]].ranks
            raise UsageError(f"{self.where} is a node's copy holding the files of ranks {RankSpans(self.holds)} only "
                             f"({ranks_text(outside)} {'needs' if len(outside) == 1 else 'need'} others). Pass ranks "
                             "it holds, or none to check the whole copy. Nothing was checked.")
        files = tuple(f for f in self.files if f.coord in coords)
        return replace(self, holds=tuple(tuple(s) for s in spans), files=files, extras=())

    @property
    def write_label(self) -> str:
        """The write this folder or copy belongs to, in words (`write_label`)."""
        return write_label(self.write_id)

    def holds_rank(self, rank: int) -> bool:
        """Whether this copy holds the files rank `rank` reads."""
        return self.holds is None or self.mesh.coord_of(rank) in set(self.held_coords)

    @property
    def split_dims(self) -> dict[str, int]:
        """Tensor -> the dim FSDP splits, for every tensor split on a dim other than 0 (balanced expert tensors)."""
        return {name: info.placement.shard_dim for name, info in self.tensors.items()
                if info.placement.shard_dim not in (None, 0)}

    @property
    def bytes(self) -> int:
        """Bytes of the rank files together."""
        return sum(f.bytes for f in self.files)

    @property
    def empty_markers(self) -> int:
        return sum(f.empty_markers for f in self.files)

    @property
    def dequantized(self) -> int:
        """Tensors computed from a quantized source (`write --dequantize`)."""
        return sum(info.dequantized_from is not None for info in self.tensors.values())

    def original_layout(self) -> tuple[dict | None, str | None]:
        """The source's on-disk layout the manifest records (`recorded_source_layout`): (per tensor its on-disk
        pieces, or None and why)."""
        return recorded_source_layout(self._document, self.source.source)


def read_manifest(store) -> Manifest:
    """Read `reshard.json` of the folder `store` (a `reshard.read.Store`: the one opening of a folder is the
    read layer's) and validate it.

    Raises:
        ManifestError: the manifest is missing, not a regular file, not JSON, of an unknown format/version, or not
            a sound manifest (naming the key and the value).
    """
    where = store.location
    path = f"{where.rstrip('/')}/{MANIFEST_NAME}"
    try:
        document = json.loads(store.read_all(MANIFEST_NAME, MAX_MANIFEST_BYTES, "manifest"))
    except FileNotFoundError as e:
        raise ManifestError([f"{path}: no manifest; this folder was not written by `reshard write` (or the write "
                             "did not finish). Write it again."]) from e
    except ReshardError as e:
        raise ManifestError([f"{path}: {e}"]) from e
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than the parser goes
        raise ManifestError([f"{path}: unreadable manifest ({type(e).__name__}: {str(e)[:200]}). {REMEDY}"]) from e
    return Manifest.from_document(document, where)


def claimed_names(store, entries: list[str], *, with_copied: bool = True) -> tuple[set[str] | None, str | None]:
    """The file names the manifest of a reshard output, the folder `store` holding `entries`, claims as its own (the
    manifest, rank and extras files, and the `copied` ones), read leniently, since an output of an older reshard may
    be replaced too:
    (names, None), (None, None) when it records no `copied` (and `with_copied`), or (None, why) when there is no
    reshard manifest to read."""
    try:
        document = json.loads(store.read_all(MANIFEST_NAME, MAX_MANIFEST_BYTES, "manifest"))
    except FileNotFoundError:
        return None, (f"it holds {_some(entries)} and no {MANIFEST_NAME}, so it is not a reshard "
                      "output")
    except (OSError, ValueError, ReshardError) as e:
        return None, f"its {MANIFEST_NAME} cannot be read ({e})"
    try:
        if document.get("format") != MANIFEST_FORMAT:
            return None, f"its {MANIFEST_NAME} is not a reshard manifest"
        ours = {MANIFEST_NAME, *(f["name"] for f in document["files"]),
                *(f["name"] for f in document.get("extras") or ())}
        copied = document.get("copied")
    except (AttributeError, KeyError, TypeError):
        return None, f"its {MANIFEST_NAME} is damaged"
    if not with_copied:
        return ours, None
    return (None, None) if copied is None else (ours | set(copied), None)


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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
