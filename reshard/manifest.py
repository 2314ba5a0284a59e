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
import os
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from .errors import ManifestError, MeshError
from .plan.mesh import MeshSpec

MANIFEST_NAME = "reshard.json"
MANIFEST_FORMAT = "reshard"
MANIFEST_VERSION = 2  # 2: file entries name a run of `order`; chunks follow from placements
SHARD_FILE = "shard-{coord:05d}-model-{part:05d}-of-{parts:05d}.safetensors"
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
DCP_VERSION_KEY = "DCP_VERSION"
DCP_VERSION = "1.0"
SAVED_OFFSETS_KEY = "saved_offsets"
# Tensors the model does not load (MTP layers, ...), whole under their on-disk keys: a name transformers' distributed
# loader does not take for a rank file, listed in the manifest's optional `extras` section, read by no rank.
EXTRA_FILE = "extra-{part:05d}-of-{parts:05d}.safetensors"


def extra_file_name(part: int, parts: int) -> str:
    """File name of extras file `part` (0-based) of `parts`."""
    return EXTRA_FILE.format(part=part + 1, parts=parts)


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
    placement: object  # plan.placement.Placement (imported lazily: the planner imports this package's readers)


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
    """One entry of the manifest's `coords`: the ranks that read this coordinate's files, and those files."""

    coord: int
    ranks: tuple[int, ...]
    files: tuple[str, ...]
    empty_markers: int


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
        return self.files_of_coord(self.mesh.shard_index(rank))

    def files_of_coord(self, coord: int) -> list[str]:
        return list(self.coords[coord].files)

    def file_entry(self, name: str) -> FileEntry:
        return self._by_name[name]

    def chunks(self, entry: FileEntry) -> list[Chunk]:
        """The chunks file `entry` holds, in file order (O(tensors in the file))."""
        from .plan.placement import local_box

        out = []
        for name in self.order[entry.first:entry.first + entry.count]:
            info = self.tensors[name]
            box = local_box(info.shape, info.placement, self.mesh, entry.coord)
            out.append(Chunk(name, tuple(o for o, _ in box), tuple(n for _, n in box), info.dtype))
        return out

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
        return [MANIFEST_NAME, *self.copied, *(name for c in coords for name in self.files_of_coord(c))]

    def open_file(self, name: str):
        """`open_member(self.path, name)`: a file of the folder, opened only if it is a regular file."""
        return open_member(self.path, name)


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
        out.append(Chunk(name, tuple(o for o, _ in box), tuple(n for _, n in box), info["dtype"]))
    return out


# ---- validation: every key, type and range a reader relies on, before anything uses them ------------------------
#
# Bounded work: every loop below runs over a list or map the document itself holds, never over a number it states
# (a mesh of 40,000,000 coordinates must list 40,000,000 coordinates, so it is refused at the length check).
# Unknown keys are tolerated (a newer writer may add a section); a new optional section gets its parser in
# `validate_manifest`, after the sections it refers to.

_REMEDY = ("Nothing was changed. Restore its reshard.json (or its files) from a good copy, or "
           "write the folder again with `reshard write`.")
MAX_MANIFEST_BYTES = 1 << 30  # far above any real manifest (linear in tensors plus coordinates)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _fail(key: str, value, why: str):
    raise ManifestError([f"{MANIFEST_NAME}: {key} is {_show(value)}: {why}. {_REMEDY}"])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(obj: dict, name: str, where: str, check, what: str, *, optional: bool = False, default=None):
    """`obj[name]` when `check` accepts it; a `ManifestError` naming `where.name` otherwise."""
    key = f"{where}.{name}" if where else name
    if name not in obj:
        if optional:
            return default
        raise ManifestError([f"{MANIFEST_NAME}: {key} is missing: a reshard manifest has it ({what}). {_REMEDY}"])
    value = obj[name]
    if not check(value):
        _fail(key, value, f"it must be {what}")
    return value


def _natural(value) -> bool:
    return _is_int(value) and value >= 0


def _positive(value) -> bool:
    return _is_int(value) and value >= 1


def _dict(value) -> bool:
    return isinstance(value, dict)


def _list(value) -> bool:
    return isinstance(value, list)


def _str(value) -> bool:
    return isinstance(value, str)


def _str_or_none(value) -> bool:
    return value is None or isinstance(value, str)


def plain_name_problem(name) -> str | None:
    """Why `name` is not a plain file name inside a folder (a separator, `.`/`..`, absolute, empty), or None."""
    if not isinstance(name, str) or not name:
        return "a file name must be a non-empty string"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or os.path.isabs(name):
        return "a file name must be a plain name inside the folder (no separator, no `..`, not absolute)"
    return None


def _mesh(data: dict) -> MeshSpec:
    raw = _get(data, "mesh", "", _dict, "an object of positive mesh sizes")
    if unknown := sorted(set(raw) - {"fsdp", "ep", "dp_replicate", "tp", "pp"}):
        _fail(f"mesh.{unknown[0]}", raw[unknown[0]], "not a mesh size (fsdp, ep, dp_replicate, tp, pp)")
    sizes = {name: _get(raw, name, "mesh", _positive, "a positive integer", optional=True, default=1)
             for name in ("fsdp", "ep", "dp_replicate", "tp", "pp")}
    try:
        return MeshSpec(**sizes)
    except MeshError as e:
        _fail("mesh", raw, f"not a mesh reshard can load ({e})")


def _tensors(data: dict) -> tuple[dict[str, TensorInfo], tuple[str, ...]]:
    from .plan.layout import Role
    from .plan.placement import Kind, Placement
    from .read.checkpoint import DTYPE_BITS

    raw = _get(data, "tensors", "", _dict, "an object of tensor entries")
    order = _get(data, "order", "", _list, "the list of tensor names")
    roles, kinds = {r.value for r in Role}, {k.value: k for k in Kind}
    tensors = {}
    for name, info in raw.items():
        where = f"tensors[{name!r}]"
        if not isinstance(info, dict):
            _fail(where, info, "a tensor entry must be an object")
        shape = _get(info, "shape", where, lambda v: _list(v) and all(map(_natural, v)), "a list of sizes >= 0")
        dtype = _get(info, "dtype", where, lambda v: _str(v) and v in DTYPE_BITS and DTYPE_BITS[v] >= 8,
                     "a byte-sized safetensors dtype (F32, BF16, I64, ...)")
        role = _get(info, "role", where, lambda v: _str(v) and v in roles, f"one of {sorted(roles)}")
        is_param = _get(info, "is_param", where, lambda v: isinstance(v, bool), "true or false")
        p = _get(info, "placement", where, _dict, "an object (kind, shard_dim, degree, ep)")
        kind = kinds.get(_get(p, "kind", f"{where}.placement", lambda v: _str(v) and v in kinds,
                              f"one of {sorted(kinds)}"))
        dim_ok = (lambda v: v is None) if kind is Kind.REPLICATED else (lambda v: _is_int(v) and 0 <= v < len(shape))
        dim = _get(p, "shard_dim", f"{where}.placement", dim_ok,
                   "null for a replicated tensor" if kind is Kind.REPLICATED
                   else f"a dim of its {len(shape)}-dim shape {shape} (0 to {len(shape) - 1})")
        degree = _get(p, "degree", f"{where}.placement", _positive, "a positive integer")
        ep = _get(p, "ep", f"{where}.placement", _positive, "a positive integer")
        tensors[name] = TensorInfo(name, tuple(shape), dtype, role, is_param, Placement(kind, dim, degree, ep))
    if not all(isinstance(n, str) for n in order) or len(set(order)) != len(order) or set(order) != set(tensors):
        _fail("order", order, "it must name every tensor of `tensors` exactly once")
    return tensors, tuple(order)


def _placements_fit(tensors: dict[str, TensorInfo], mesh: MeshSpec) -> None:
    """Each placement agrees with the mesh, so every chunk `local_box` derives lies inside its tensor."""
    from .plan.placement import Kind

    for info in tensors.values():
        p, where = info.placement, f"tensors[{info.name!r}].placement"
        if p.kind is Kind.DENSE and (p.degree, p.ep) != (mesh.fsdp, 1):
            _fail(where, _placement_text(p), f"a dense tensor is split over fsdp {mesh.fsdp} (degree {mesh.fsdp}, "
                                             "ep 1)")
        if p.kind is Kind.EXPERT and ((p.degree, p.ep) != (mesh.efsdp, mesh.ep) or info.shape[0] % mesh.ep):
            _fail(where, _placement_text(p), f"an expert tensor is split over efsdp {mesh.efsdp} x ep {mesh.ep} "
                                             f"(degree {mesh.efsdp}, ep {mesh.ep}), its dim 0 ({info.shape[0]}) "
                                             "a multiple of ep")


def _placement_text(p) -> str:
    return f"kind {p.kind.value}, shard_dim {p.shard_dim}, degree {p.degree}, ep {p.ep}"


def _files(data: dict, mesh: MeshSpec, order: tuple[str, ...]) -> tuple[FileEntry, ...]:
    raw = _get(data, "files", "", _list, "the list of file entries")
    files, names = [], set()
    for i, entry in enumerate(raw):
        where = f"files[{i}]"
        if not isinstance(entry, dict):
            _fail(where, entry, "a file entry must be an object")
        name = _get(entry, "name", where, lambda v: plain_name_problem(v) is None,
                    "a plain file name inside the folder (no separator, no `..`, not absolute)")
        if name in names or name == MANIFEST_NAME:
            _fail(f"{where}.name", name, "each file is listed once, and never as the manifest itself")
        names.add(name)
        coord = _get(entry, "coord", where, lambda v: _is_int(v) and 0 <= v < mesh.fsdp,
                     f"a coordinate of the mesh (0 to {mesh.fsdp - 1}, fsdp {mesh.fsdp})")
        first = _get(entry, "first", where, lambda v: _natural(v) and v <= len(order),
                     f"a position in order (0 to {len(order)})")
        count = _get(entry, "count", where, lambda v: _natural(v) and first + v <= len(order),
                     f"a count of tensors from position {first} within the {len(order)} of order")
        size = _get(entry, "bytes", where, _natural, "a size in bytes >= 0")
        crc = _get(entry, "crc32", where, _crc_text, "8 lowercase hex digits")
        markers = _get(entry, "empty_markers", where, lambda v: _natural(v) and v <= count,
                       "a count of empty markers, at most the file's tensors")
        files.append(FileEntry(name, coord, first, count, size, crc, markers))
    return tuple(files)


def _coords(data: dict, mesh: MeshSpec, files: tuple[FileEntry, ...]) -> tuple[CoordEntry, ...]:
    raw = _get(data, "coords", "", _list, "the list of coordinate entries")
    if len(raw) != mesh.fsdp:  # before any loop over the mesh: an absurd fsdp stops here
        _fail("mesh.fsdp", mesh.fsdp, f"the manifest lists {len(raw)} coordinates (`coords`); they must agree")
    own: dict[int, list[str]] = {c: [] for c in range(mesh.fsdp)}
    for entry in files:
        own[entry.coord].append(entry.name)
    coords = []
    for c, entry in enumerate(raw):
        where = f"coords[{c}]"
        if not isinstance(entry, dict):
            _fail(where, entry, "a coordinate entry must be an object")
        _get(entry, "coord", where, lambda v: v == c, f"its position in the list ({c})")
        ranks = _get(entry, "ranks", where, _list, "the list of ranks reading this coordinate")
        if len(ranks) != mesh.dp_replicate or ranks != [r * mesh.fsdp + c for r in range(mesh.dp_replicate)]:
            _fail(f"{where}.ranks", ranks, f"the ranks of coordinate {c} on a mesh of dp_replicate "
                                           f"{mesh.dp_replicate} x fsdp {mesh.fsdp}")
        names = _get(entry, "files", where, _list, "the list of this coordinate's file names")
        if sorted(map(str, names)) != sorted(own[c]) or not all(isinstance(n, str) for n in names):
            _fail(f"{where}.files", names, f"exactly the files whose entries name coordinate {c} "
                                           f"({sorted(own[c])[:3]}{' ...' if len(own[c]) > 3 else ''})")
        markers = _get(entry, "empty_markers", where, _natural, "a count >= 0", optional=True, default=0)
        coords.append(CoordEntry(c, tuple(ranks), tuple(names), markers))
    return tuple(coords)


def _copied(data: dict) -> tuple[str, ...]:
    copied = _get(data, "copied", "", _list, "the list of copied file names", optional=True, default=[])
    for i, name in enumerate(copied):
        if (why := plain_name_problem(name)) or name == MANIFEST_NAME:
            _fail(f"copied[{i}]", name, why or "the manifest is not a copied file")
    if len(set(copied)) != len(copied):
        _fail("copied", copied, "each copied file is listed once")
    return tuple(copied)


def _source(data: dict) -> None:
    source = _get(data, "source", "", _dict, "an object (source, model_type, architecture, ...)")
    _get(source, "source", "source", _str, "the source the folder was written from")
    for name in ("model_type", "architecture"):
        _get(source, name, "source", _str_or_none, "a string or null")
    record = _get(data, "source_layout", "", lambda v: v is None or _dict(v), "an object or null",
                  optional=True)
    if record is not None:
        _get(record, "tensors", "source_layout", lambda v: _dict(v) and all(
            isinstance(p, list) and all(isinstance(t, str) for t in p) for p in v.values()),
            "an object of lists of on-disk key records", optional=True)


def _crc_text(value) -> bool:
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


def _extras(data: dict, files: tuple[FileEntry, ...]) -> None:
    """The optional `extras` section (files of tensors the model does not load) and `dropped_unloaded` count."""
    raw = _get(data, "extras", "", _list, "the list of extras files", optional=True, default=[])
    taken = {f.name for f in files} | {MANIFEST_NAME}
    keys: set[str] = set()
    for i, entry in enumerate(raw):
        where = f"extras[{i}]"
        if not isinstance(entry, dict):
            _fail(where, entry, "an extras entry must be an object")
        name = _get(entry, "name", where, lambda v: plain_name_problem(v) is None,
                    "a plain file name inside the folder (no separator, no `..`, not absolute)")
        if name in taken:
            _fail(f"{where}.name", name, "each file is listed once: not a rank file, another extras file or the "
                                         "manifest")
        taken.add(name)
        _get(entry, "bytes", where, _natural, "a size in bytes >= 0")
        _get(entry, "crc32", where, _crc_text, "8 lowercase hex digits")
        names = _get(entry, "keys", where, lambda v: _list(v) and v and all(isinstance(k, str) and k for k in v),
                     "a non-empty list of tensor names")
        if repeated := sorted(keys.intersection(names)):
            _fail(f"{where}.keys", repeated[:3], "each extra tensor is listed once")
        keys.update(names)
    _get(data, "dropped_unloaded", "", _natural, "a count >= 0", optional=True)


def _sizes_fit(tensors: dict[str, TensorInfo], files: tuple[FileEntry, ...]) -> None:
    """Every element is stored once at least, so no tensor is larger than the files together: refuses an absurd
    shape before anything allocates it."""
    from .read.checkpoint import DTYPE_BITS

    total = sum(f.bytes for f in files)
    for info in tensors.values():
        nbytes = math.prod(info.shape) * DTYPE_BITS[info.dtype] // 8
        if nbytes > total:
            _fail(f"tensors[{info.name!r}].shape", list(info.shape),
                  f"{nbytes} bytes of {info.dtype}, more than the {total} bytes of every file together")


def validate_manifest(data) -> dict:
    """Check a manifest document before anything uses it; the checked sections, typed.

    Checks types and required keys; mesh sizes positive and agreeing with the coordinates listed; every file entry's
    coordinate, run of `order` and name (a plain name inside the folder); placement kinds and dims valid for the
    tensor's rank and agreeing with the mesh (so every chunk lies inside its tensor); tensor sizes no larger than
    the files. O(size of the document). Unknown keys are tolerated.

    Returns:
        `mesh`, `order`, `tensors`, `files`, `coords`, `copied`: the fields of `Manifest`.

    Raises:
        ManifestError: the first problem, naming the key and its value.
    """
    if not isinstance(data, dict):
        _fail("the document", data, "a reshard manifest is a JSON object")
    if data.get("format") == MANIFEST_FORMAT and data.get("version") == 1:
        raise ManifestError([f"{MANIFEST_NAME}: written by an earlier reshard (manifest version 1, which lists every "
                             f"chunk of every file); this reshard reads version {MANIFEST_VERSION}. Write the folder "
                             "again."])
    if data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
        raise ManifestError([f"{MANIFEST_NAME}: format {_show(data.get('format'))} version "
                             f"{_show(data.get('version'))}; this reshard reads {MANIFEST_FORMAT!r} version "
                             f"{MANIFEST_VERSION}. {_REMEDY}"])
    mesh = _mesh(data)
    tensors, order = _tensors(data)
    files = _files(data, mesh, order)
    coords = _coords(data, mesh, files)
    _placements_fit(tensors, mesh)
    _sizes_fit(tensors, files)
    _source(data)
    _extras(data, files)
    # (a new optional section: parse it here, after the sections it refers to)
    return {"mesh": mesh, "order": order, "tensors": MappingProxyType(tensors), "files": files, "coords": coords,
            "copied": _copied(data)}


def open_member(folder: str | Path, name: str):
    """Open file `name` of `folder` for reading (unbuffered), only if it is a regular file.

    A link inside the folder may point anywhere (the user's choice); what it names must be a regular file. A FIFO,
    a device or a folder is refused before it is opened, and the open itself cannot block (O_NONBLOCK, then fstat:
    a FIFO swapped in after the check is refused too).

    Raises:
        ManifestError: not a plain name, or not a regular file.
        OSError: the file is missing or unreadable.
    """
    if why := plain_name_problem(name):
        _fail("a file name", name, why)
    path = Path(folder) / name
    _refuse_irregular(name, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_irregular(name, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _refuse_irregular(name: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ManifestError([f"{name}: {kind}, not a regular file; reshard reads only regular files. {_REMEDY}"])


def check_member(folder: str | Path, name: str) -> None:
    """Open and close file `name` of `folder` (`open_member`): a `ManifestError` unless it is a regular file."""
    with open_member(folder, name):
        pass


def member_problem(folder: str | Path, name: str) -> str | None:
    """Why file `name` of `folder` cannot be read as a regular file of the folder (see `open_member`), or None."""
    try:
        check_member(folder, name)
        return None
    except ManifestError as e:
        return "; ".join(e.problems)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"


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
            raise ManifestError([f"{path}: over {MAX_MANIFEST_BYTES} bytes, not a manifest reshard writes. {_REMEDY}"])
        data = json.loads(raw)
    except FileNotFoundError as e:
        raise ManifestError([f"{path}: no manifest; this folder was not written by `reshard write` (or the write "
                             "did not finish). Write it again."]) from e
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than the parser goes
        raise ManifestError([f"{path}: unreadable manifest ({type(e).__name__}: {str(e)[:200]}). {_REMEDY}"]) from e
    return Manifest(data, folder)


def header_problems(entry: FileEntry, expected: list[Chunk], header) -> list[str]:
    """Where a file's parsed header (`checkpoint.FileHeader`) differs from the chunks the manifest derives for it
    (`expected`): the same tensors, each with the manifest's dtype, its shape and `DCP_SHARDING_INFO` offsets, the
    empty markers the entry counts, and data that fills the file from the header's end without a gap. The one
    check of a header against the manifest: verify, every load path, the reader and a read as a source use it."""
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
            problems.append(f"{name}: {chunk.name} shape/offsets {list(tensor.shape)}/{_show(offsets)} differ from "
                            f"the manifest's {list(chunk.shape)}/{list(chunk.offsets)}")
    cursor = header.header_bytes
    for tensor in header.tensors:  # sorted by data offset: each begins where the previous ended
        if tensor.data_start != cursor:
            problems.append(f"{name}: {tensor.name}'s data begins at byte {tensor.data_start}, not {cursor}, where "
                            "the previous one ends")
            break
        cursor += tensor.nbytes
    if header.size is not None and cursor != header.size and not problems:
        problems.append(f"{name}: the header's tensors end at byte {cursor}, the file has {header.size}")
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
    path = Path(path)
    with open_member(path.parent, path.name) as f:  # a FIFO or a device is never read
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def dump_manifest(data: dict) -> str:
    """Deterministic JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
