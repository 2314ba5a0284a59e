"""Validation of a manifest document: every key, type and range a reader relies on, before anything uses them.

Bounded work: every loop below runs over a list or map the document itself holds, never over a number it states
(a mesh of 40,000,000 coordinates must list 40,000,000 coordinates, so it is refused at the length check).
Unknown keys are tolerated (a newer writer may add a section); a new optional section gets its parser in
`validate_manifest`, after the sections it refers to.
"""

from __future__ import annotations

import math
from types import MappingProxyType

from .. import __version__
from ..errors import ManifestError, MeshError
from ..plan import DTYPE_BITS, Kind, LayoutMode, MeshSpec, Placement, Role
from ._entries import CoordEntry, ExtrasEntry, FileEntry, SourceRecord, TensorInfo
from ._format import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, READ_VERSIONS, REMEDY, reject, show
from ._members import plain_name_problem


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(obj: dict, name: str, where: str, check, what: str, *, optional: bool = False, default=None):
    """`obj[name]` when `check` accepts it; a `ManifestError` naming `where.name` otherwise."""
    key = f"{where}.{name}" if where else name
    if name not in obj:
        if optional:
            return default
        raise ManifestError([f"{MANIFEST_NAME}: {key} is missing: a reshard manifest has it ({what}). {REMEDY}"])
    value = obj[name]
    if not check(value):
        reject(key, value, f"it must be {what}")
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


def _mesh(data: dict) -> MeshSpec:
    raw = _get(data, "mesh", "", _dict, "an object of positive mesh sizes")
    if unknown := sorted(set(raw) - {"fsdp", "ep", "dp_replicate", "tp", "pp"}):
        reject(f"mesh.{unknown[0]}", raw[unknown[0]], "not a mesh size (fsdp, ep, dp_replicate, tp, pp)")
    sizes = {name: _get(raw, name, "mesh", _positive, "a positive integer", optional=True, default=1)
             for name in ("fsdp", "ep", "dp_replicate", "tp", "pp")}
    try:
        return MeshSpec(**sizes)
    except MeshError as e:
        reject("mesh", raw, f"not a mesh reshard can load ({e})")


def _tensors(data: dict) -> tuple[dict[str, TensorInfo], tuple[str, ...]]:
    raw = _get(data, "tensors", "", _dict, "an object of tensor entries")
    order = _get(data, "order", "", _list, "the list of tensor names")
    roles, kinds = {r.value for r in Role}, {k.value: k for k in Kind}
    tensors = {}
    for name, info in raw.items():
        where = f"tensors[{name!r}]"
        if not isinstance(info, dict):
            reject(where, info, "a tensor entry must be an object")
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
        dequantized = _get(info, "dequantized_from", where, lambda v: v is None or _dict(v), "an object",
                           optional=True)
        tensors[name] = TensorInfo(name, tuple(shape), dtype, Role(role), is_param, Placement(kind, dim, degree, ep),
                                   None if dequantized is None else MappingProxyType(dequantized))
    if not all(isinstance(n, str) for n in order) or len(set(order)) != len(order) or set(order) != set(tensors):
        reject("order", order, "it must name every tensor of `tensors` exactly once")
    return tensors, tuple(order)


def _placements_fit(tensors: dict[str, TensorInfo], mesh: MeshSpec) -> None:
    """Each placement agrees with the mesh, so every chunk `local_box` derives lies inside its tensor."""
    for info in tensors.values():
        p, where = info.placement, f"tensors[{info.name!r}].placement"
        if p.kind is Kind.DENSE and (p.degree, p.ep) != (mesh.fsdp, 1):
            reject(where, _placement_text(p), f"a dense tensor is split over fsdp {mesh.fsdp} (degree {mesh.fsdp}, "
                                              "ep 1)")
        if p.kind is Kind.EXPERT and ((p.degree, p.ep) != (mesh.efsdp, mesh.ep) or info.shape[0] % mesh.ep):
            reject(where, _placement_text(p), f"an expert tensor is split over efsdp {mesh.efsdp} x ep {mesh.ep} "
                                              f"(degree {mesh.efsdp}, ep {mesh.ep}), its dim 0 ({info.shape[0]}) "
                                              "a multiple of ep")


def _placement_text(p) -> str:
    return f"kind {p.kind.value}, shard_dim {p.shard_dim}, degree {p.degree}, ep {p.ep}"


def _file_name(entry, where: str, what: str, taken: set[str], listed_twice: str) -> str:
    """The name of file entry `entry` (`what`, at `where`): an object whose `name` is a plain file name not yet in
    `taken`, where it is then added."""
    if not isinstance(entry, dict):
        reject(where, entry, f"{what} must be an object")
    name = _get(entry, "name", where, lambda v: plain_name_problem(v) is None,
                "a plain file name inside the folder (no separator, no `..`, not absolute)")
    if name in taken:
        reject(f"{where}.name", name, listed_twice)
    taken.add(name)
    return name


def _files(data: dict, mesh: MeshSpec, order: tuple[str, ...]) -> tuple[FileEntry, ...]:
    raw = _get(data, "files", "", _list, "the list of file entries")
    files, taken = [], {MANIFEST_NAME}
    for i, entry in enumerate(raw):
        where = f"files[{i}]"
        name = _file_name(entry, where, "a file entry", taken, "each file is listed once, and never as the manifest "
                                                               "itself")
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


def _holds(data: dict, mesh: MeshSpec) -> tuple[tuple[int, int], ...] | None:
    """The optional `holds`: the ranks a node's copy holds the files of, as `[first, last]` spans (None: every
    rank's)."""
    raw = _get(data, "holds", "", lambda v: v is None or _list(v), "a list of [first, last] rank spans or null",
               optional=True)
    if raw is None:
        return None
    world = mesh.world_size
    if not raw or not all(_list(s) and len(s) == 2 and all(_natural(r) for r in s) and s[0] <= s[1] < world
                          for s in raw):
        reject("holds", raw, f"a non-empty list of [first, last] spans of ranks of the mesh (0 to {world - 1})")
    return tuple((s[0], s[1]) for s in raw)


def _coords(data: dict, mesh: MeshSpec, files: tuple[FileEntry, ...]) -> tuple[CoordEntry, ...]:
    raw = _get(data, "coords", "", _list, "the list of coordinate entries")
    if len(raw) != mesh.fsdp:  # before any loop over the mesh: an absurd fsdp stops here
        reject("mesh.fsdp", mesh.fsdp, f"the manifest lists {len(raw)} coordinates (`coords`); they must agree")
    own: dict[int, list[str]] = {c: [] for c in range(mesh.fsdp)}
    for entry in files:
        own[entry.coord].append(entry.name)
    coords = []
    for c, entry in enumerate(raw):
        where = f"coords[{c}]"
        if not isinstance(entry, dict):
            reject(where, entry, "a coordinate entry must be an object")
        _get(entry, "coord", where, lambda v: v == c, f"its position in the list ({c})")
        ranks = mesh.coord_ranks(c)
        listed = _get(entry, "ranks", where, _list, "the list of ranks reading this coordinate", optional=True)
        if listed is not None and (len(listed) != len(ranks) or listed != list(ranks)):  # version 2 lists them
            reject(f"{where}.ranks", listed, f"the ranks of coordinate {c} on a mesh of dp_replicate "
                                             f"{mesh.dp_replicate} x fsdp {mesh.fsdp}")
        names = _get(entry, "files", where, _list, "the list of this coordinate's file names")
        if sorted(map(str, names)) != sorted(own[c]) or not all(isinstance(n, str) for n in names):
            reject(f"{where}.files", names, f"exactly the files whose entries name coordinate {c} "
                                            f"({sorted(own[c])[:3]}{' ...' if len(own[c]) > 3 else ''})")
        markers = _get(entry, "empty_markers", where, _natural, "a count >= 0", optional=True, default=0)
        coords.append(CoordEntry(c, ranks, tuple(names), markers))
    return tuple(coords)


def _copied(data: dict) -> tuple[str, ...]:
    copied = _get(data, "copied", "", _list, "the list of copied file names", optional=True, default=[])
    for i, name in enumerate(copied):
        if (why := plain_name_problem(name)) or name == MANIFEST_NAME:
            reject(f"copied[{i}]", name, why or "the manifest is not a copied file")
    if len(set(copied)) != len(copied):
        reject("copied", copied, "each copied file is listed once")
    return tuple(copied)


def _source(data: dict) -> SourceRecord:
    source = _get(data, "source", "", _dict, "an object (source, model_type, architecture, ...)")
    name = _get(source, "source", "source", _str, "the source the folder was written from")
    model_type, architecture = (_get(source, key, "source", _str_or_none, "a string or null")
                                for key in ("model_type", "architecture"))
    revision = _get(source, "revision", "source", _str_or_none, "a string or null", optional=True)
    digests = _get(source, "header_sha256", "source", lambda v: _dict(v) and all(map(_str, v.values())),
                   "an object of file name to digest", optional=True, default={})
    quantization = _get(source, "quantization_config", "source", _dict, "an object", optional=True)
    record = _get(data, "source_layout", "", lambda v: v is None or _dict(v), "an object or null",
                  optional=True)
    if record is not None:
        _get(record, "tensors", "source_layout", lambda v: _dict(v) and all(
            isinstance(p, list) and all(isinstance(t, str) for t in p) for p in v.values()),
            "an object of lists of on-disk key records", optional=True)
    return SourceRecord(name, revision, model_type, architecture, MappingProxyType(dict(digests)),
                        None if quantization is None else MappingProxyType(quantization))


def _crc_text(value) -> bool:
    return isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)


def _extras(data: dict, files: tuple[FileEntry, ...]) -> tuple[ExtrasEntry, ...]:
    """The optional `extras` section (files of tensors the model does not load)."""
    raw = _get(data, "extras", "", _list, "the list of extras files", optional=True, default=[])
    taken = {f.name for f in files} | {MANIFEST_NAME}
    keys: set[str] = set()
    entries = []
    for i, entry in enumerate(raw):
        where = f"extras[{i}]"
        name = _file_name(entry, where, "an extras entry", taken, "each file is listed once: not a rank file, another "
                                                                 "extras file or the manifest")
        size = _get(entry, "bytes", where, _natural, "a size in bytes >= 0")
        crc = _get(entry, "crc32", where, _crc_text, "8 lowercase hex digits")
        names = _get(entry, "keys", where, lambda v: _list(v) and v and all(isinstance(k, str) and k for k in v),
                     "a non-empty list of tensor names")
        if repeated := sorted(keys.intersection(names)):
            reject(f"{where}.keys", repeated[:3], "each extra tensor is listed once")
        keys.update(names)
        entries.append(ExtrasEntry(name, size, crc, tuple(names)))
    return tuple(entries)


def _sizes_fit(tensors: dict[str, TensorInfo], files: tuple[FileEntry, ...]) -> None:
    """Every element is stored once at least, so no tensor is larger than the files together: refuses an absurd
    shape before anything allocates it."""
    total = sum(f.bytes for f in files)
    for info in tensors.values():
        nbytes = math.prod(info.shape) * DTYPE_BITS[info.dtype] // 8
        if nbytes > total:
            reject(f"tensors[{info.name!r}].shape", list(info.shape),
                   f"{nbytes} bytes of {info.dtype}, more than the {total} bytes of every file together")


def validate_manifest(data) -> dict:
    """Check a manifest document before anything uses it; the checked sections, typed (the fields of `Manifest`).

    Checks types and required keys; mesh sizes positive and agreeing with the coordinates listed; every file entry's
    coordinate, run of `order` and name (a plain name inside the folder); placement kinds and dims valid for the
    tensor's rank and agreeing with the mesh (so every chunk lies inside its tensor); tensor sizes no larger than
    the files. O(size of the document). Unknown keys are tolerated.

    Returns:
        `mesh`, `order`, `tensors`, `files`, `coords`, `copied`, `source`, `layout`, `extras`, `dropped_unloaded`,
        `tool`, `holds`, `write_id`: the fields of `Manifest`.

    Raises:
        ManifestError: the first problem, naming the key and its value.
    """
    if not isinstance(data, dict):
        reject("the document", data, "a reshard manifest is a JSON object")
    if data.get("format") == MANIFEST_FORMAT and data.get("version") == 1:
        raise ManifestError([f"{MANIFEST_NAME}: written by an earlier reshard (manifest version 1, which lists every "
                             f"chunk of every file); this reshard reads version {MANIFEST_VERSION}. Write the folder "
                             "again."])
    version = data.get("version")
    if data.get("format") == MANIFEST_FORMAT and _is_int(version) and version > MANIFEST_VERSION:
        # not damage: restoring or rewriting would not help, a reshard that reads it would
        tool = f", by {show(data['tool'])}" if isinstance(data.get("tool"), str) else ""
        raise ManifestError([f"{MANIFEST_NAME}: written by a newer reshard (manifest version {version}{tool}); "
                             f"upgrade reshard to read it: this one, {__version__}, reads manifest versions "
                             f"{READ_VERSIONS[0]} to {READ_VERSIONS[-1]}. Nothing was changed."])
    if data.get("format") != MANIFEST_FORMAT or version not in READ_VERSIONS:
        raise ManifestError([f"{MANIFEST_NAME}: format {show(data.get('format'))} version "
                             f"{show(version)}; this reshard reads {MANIFEST_FORMAT!r} versions "
                             f"{READ_VERSIONS[0]} to {READ_VERSIONS[-1]}. {REMEDY}"])
    mesh = _mesh(data)
    tensors, order = _tensors(data)
    files = _files(data, mesh, order)
    holds = _holds(data, mesh)
    if holds is not None and (strays := sorted({f.coord for f in files} - set(mesh.coords_of(holds)))):
        reject("holds", [list(s) for s in holds], f"the ranks whose files are listed (coordinate {strays[0]} too)")
    coords = _coords(data, mesh, files)
    _placements_fit(tensors, mesh)
    _sizes_fit(tensors, files)
    layout = LayoutMode(_get(data, "layout", "", lambda v: v in ("balanced", "stock"), "balanced or stock",
                             optional=True, default=LayoutMode.BALANCED.value))
    # (a new optional section: parse it here, after the sections it refers to)
    return {"mesh": mesh, "order": order, "tensors": MappingProxyType(tensors), "files": files, "coords": coords,
            "copied": _copied(data), "source": _source(data), "layout": layout, "extras": _extras(data, files),
            "dropped_unloaded": _get(data, "dropped_unloaded", "", _natural, "a count >= 0", optional=True, default=0),
            "tool": _get(data, "tool", "", _str, "a string", optional=True, default=""), "holds": holds,
            "write_id": _get(data, "write_id", "", _digest, "a SHA-256 in 64 hex digits", optional=True)}


def _digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
