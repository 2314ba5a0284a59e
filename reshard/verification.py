"""Prove a written folder complete and exact: manifest vs files, coverage, empty markers, and bytes vs source.

This proves the copying, not reshard's key mapping (which on-disk keys make which in-memory tensor): the bytes are
compared with the source bytes that mapping names. The tests check the mapping against transformers' own load.
Every file is read through its folder's store (`reshard.read.store`), so a folder in S3 is checked the same way.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass

from .errors import ReshardError, UsageError, VerifyError
from .manifest import copied_problems, coverage_problems, header_problems, read_manifest, tied_from_record
from .plan.dtypes import DTYPE_BITS
from .plan.mesh import ranks_text
from .plan.ranks import RankSpans
from .read.checkpoint import INDEX_NAME, header_of
from .read.source import Kind, locate, open_source
from .read.store import READ_BLOCK
from .results import VerifyResult
from .runs.byte_runs import Run, chunk_runs
from .words import plural

COMPARE_BLOCK = 1 << 20  # bytes compared at a time: one buffer per side


def check_folder(folder, *, against=None, revision: str | None = None, checksums: bool = True,
                 progress: bool | None = None, ranks=None) -> VerifyResult:
    """`reshard verify`: every check, the problems in the result instead of raised (`reshard.api.verify` raises).

    A node's copy (its manifest's `holds`) is checked for the ranks it holds; `ranks` (rank spans) checks only the
    files those ranks load, in a copy staged by hand.

    Raises:
        ReshardError: the source given as `against` cannot be read.
        UsageError: `ranks` outside the mesh or the copy.
    """
    location = locate(folder, outside_links=True)
    if location.kind is Kind.CHECKPOINT and _holds_weights(location.store):
        return check_merged(location, against=against, revision=revision, progress=progress)
    empty = VerifyResult(False, str(folder), None if against is None else str(against), 0, 0, 0, 0)
    try:
        manifest = read_manifest(location.store)
    except VerifyError as e:
        return _with(empty, problems=tuple(e.problems))
    if ranks is not None:
        manifest = manifest.for_ranks(ranks)
    problems: list[str] = []
    corrupt: list[str] = []  # CRC mismatches: the structure is still sound, so --against still compares bytes
    dequantized: list[str] = []  # tensors --against recomputed from a quantized source
    from tqdm.auto import tqdm

    total = manifest.bytes if checksums else 0
    if against is not None:
        total += sum(math.prod(c.shape) * DTYPE_BITS[c.dtype] // 8 for e in manifest.files for c in manifest.chunks(e))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard verify",
               disable=None if progress is None else not progress)
    try:
        listed = _Listed(location.store, checksums, bar, problems, corrupt)
        compared, markers = _check(manifest, listed, against, revision, dequantized)
    finally:
        bar.close()
    problems = corrupt + problems
    return VerifyResult(not problems, str(folder), empty.against, len(manifest.files), len(manifest.tensors),
                        markers, compared, tuple(dequantized), tuple(problems),
                        ranks=None if manifest.holds is None else str(RankSpans(manifest.holds)),
                        write_id=manifest.write_id)


def _with(result: VerifyResult, **changes) -> VerifyResult:
    from dataclasses import replace

    return replace(result, **changes)


def _holds_weights(store) -> bool:
    """A plain HF checkpoint (what `merge` writes): an index or `*.safetensors` files, no reshard manifest."""
    return any(n == INDEX_NAME or n.endswith(".safetensors") for n in store.names())


def _crc32(store, name: str, size: int, bar) -> str:
    """The file's CRC-32 as the manifest records it (8 hex digits), advancing `bar` as the bytes pass."""
    crc, buffer = 0, bytearray(min(READ_BLOCK, max(size, 1)))
    view = memoryview(buffer)
    for start in range(0, size, len(buffer)):
        n = min(len(buffer), size - start)
        store.readinto(name, start, view[:n])
        crc = zlib.crc32(view[:n], crc)
        bar.update(n)
    return f"{crc:08x}"


@dataclass(frozen=True)
class _Listed:
    """The checks every file the manifest lists gets, rank file or extras file, and where their findings go.

    `corrupt` takes CRC mismatches apart from `problems`: the structure is still sound, so `--against` still
    compares bytes.
    """

    store: object
    checksums: bool
    bar: object
    problems: list[str]
    corrupt: list[str]

    def header(self, name: str, size: int, crc32: str, holds: str):
        """The header of listed file `name`: present (else missing, with `holds` saying what it holds), a regular
        file, of `size` bytes and CRC-32 `crc32` (when checksums are on), and a header that parses. None after a
        problem, which is recorded."""
        try:
            found = self.store.size(name)  # a FIFO or a device: refused before a byte is read
        except FileNotFoundError:
            self.problems.append(f"{name}: missing ({holds})")
            return None
        except ReshardError as e:
            self.problems.append(str(e))
            return None
        if found != size:
            self.problems.append(f"{name}: {found} bytes, manifest says {size}")
            return None
        try:
            if self.checksums and _crc32(self.store, name, size, self.bar) != crc32:
                self.corrupt.append(f"{name}: CRC-32 differs from the manifest (the file is corrupt)")
            return header_of(self.store, name)
        except ReshardError as e:
            self.problems.append(str(e))
            return None


def _check(manifest, listed: _Listed, against, revision, dequantized) -> tuple[int, int]:
    """Every check of `verify`, appending to the listed problems; returns (bytes compared, empty markers).

    The manifest says which chunks each file holds (a run of `order`, each chunk's box following from the tensor's
    placement and the file's coordinate): each header must hold exactly those, with the offsets in
    `DCP_SHARDING_INFO`; `coverage_problems` shows they put every element somewhere exactly once.
    """
    problems = listed.problems
    chunks: dict[str, list[tuple[int, tuple, str]]] = {name: [] for name in manifest.tensors}
    headers, markers = {}, 0
    problems += coverage_problems(manifest)
    problems += copied_problems(listed.store, manifest.copied)  # a folder whose config cannot load does not pass
    for entry in manifest.files:
        header = listed.header(entry.name, entry.bytes, entry.crc32,
                               f"{ranks_text(manifest.coords[entry.coord].ranks)} read it")
        if header is None:
            continue
        headers[entry.name] = header
        expected = manifest.chunks(entry)
        mismatches = header_problems(entry, expected, header)
        problems += mismatches
        if mismatches:
            continue
        for chunk in expected:
            if chunk.is_empty:
                markers += 1
            else:
                chunks[chunk.name].append((entry.coord, tuple(zip(chunk.offsets, chunk.shape)), entry.name))
    _check_extras(listed, manifest, headers, chunks)
    compared = 0
    if against is not None and not problems:
        compared = _compare_with_source(listed.store, headers, chunks, against, revision, problems, listed.bar,
                                        dequantized)
    return compared, markers


def _open(spec, *, revision: str | None = None):
    """`open_source` for a check. verify writes nothing: a source's error worded for write and merge ("Nothing was
    written.") says what is true here."""
    import copy

    try:
        return open_source(spec, revision=revision)
    except ReshardError as e:
        if "Nothing was written." not in str(e):
            raise
        reworded = copy.copy(e)  # the same class (and exit code), path and fields
        reworded.args = (str(e).replace("Nothing was written.", "Nothing was changed."),)
        raise reworded from e


def _check_extras(listed: _Listed, manifest, headers: dict, chunks: dict) -> None:
    """The manifest's extras files (tensors the model does not load, whole under their on-disk keys): each checked
    as every listed file is, holding exactly its keys. Each tensor joins `chunks` whole (coordinate -1: no rank reads
    it), so `--against` compares its bytes like every chunk's."""
    for entry in manifest.extras:
        header = listed.header(entry.name, entry.bytes, entry.crc32,
                               f"it holds {plural(len(entry.keys), 'tensor')} the model does not load, "
                               f"e.g. {entry.keys[0]}")
        if header is None:
            continue
        found = {t.name: t for t in header.tensors}
        if sorted(found) != sorted(entry.keys):
            listed.problems.append(f"{entry.name}: header holds {sorted(set(found) ^ set(entry.keys))[:3]} "
                                   "differently from the manifest")
            continue
        headers[entry.name] = header
        for key in entry.keys:
            chunks[key] = [(-1, tuple((0, n) for n in found[key].shape), entry.name)]


def _compare_with_source(out, headers, chunks, against, revision, problems, bar, dequantized) -> int:
    """Compare each chunk's bytes with the bytes the source pieces give for that region; a dequantized chunk with
    the values `write --dequantize` computes from the source (its names are added to `dequantized`). The copied
    chunks of one written file are compared together, their source bytes fetched in few large requests."""
    index, layout, dequantizer = _source_to_compare(against, revision)
    compared, copied = 0, {}  # written file -> [(its chunk's name, box, runs placed in the file)]
    try:
        for name, found in chunks.items():
            target = layout.get(name)
            if target is None:
                problems.append(f"{name}: not a tensor of the source model")
                continue
            computed = dequantizer is not None and dequantizer.computes(target)
            if computed:
                dequantized.append(name)
            for _, box, file in found:
                entry = next(t for t in headers[file].tensors if t.name == name)
                if entry.dtype != target.dtype:
                    problems.append(f"{file}: {name} is {entry.dtype}, the source is {target.dtype}")
                elif computed:  # recomputed from the source bytes, compared bit for bit
                    same, done = _same_slabs(dequantizer.chunk_slabs(target, box), out, file, entry.data_start, bar)
                    compared += done
                    if not same:
                        problems.append(f"{file}: {name} differs from its dequantized source at chunk {box}")
                else:
                    runs = [Run(r.file, r.src, entry.data_start + r.dst, r.nbytes)
                            for r in chunk_runs(target, box, index.tensors)]
                    copied.setdefault(file, []).append((name, box, runs))
        for file, placed in copied.items():
            compared += _same_copies(index.store, out, file, placed, problems, bar)
    finally:
        if dequantizer is not None:
            dequantizer.close()
    return compared


def _same_copies(source, out, file: str, placed: list, problems: list[str], bar) -> int:
    """Compare the copied chunks of written file `file` (`(name, box, runs)`, each run's `dst` in the file) with the
    source, fetched in spans (`reshard.runs.fetch.spans`); each differing chunk is named once. Bytes compared."""
    from .runs.fetch import spans

    owner = {(run.file, run.src, run.dst): (name, box) for name, box, runs in placed for run in runs}
    differing, compared = [], 0
    for span in spans([run for _, _, runs in placed for run in runs]):
        data = source.read(span.file, span.start, span.length)
        for run in span.runs:
            theirs = data[run.src - span.start:run.src - span.start + run.nbytes]
            if out.read(file, run.dst, run.nbytes) != theirs:
                name, box = owner.get((run.file, run.src, run.dst)) or _owner_of(placed, run)
                if name not in differing:
                    differing.append(name)
                    problems.append(f"{file}: {name} differs from the source at chunk {box}")
            compared += run.nbytes
            bar.update(run.nbytes)
    return compared


def _owner_of(placed: list, piece) -> tuple[str, tuple]:
    """The chunk a piece of a run (a run longer than one request) belongs to."""
    for name, box, runs in placed:
        if any(r.file == piece.file and r.dst <= piece.dst < r.dst + r.nbytes for r in runs):
            return name, box
    return "?", ()


def _source_to_compare(against, revision):
    """(the source's index, its tensors by name with the extras under their keys, the `Dequantizer` of a quantized
    source or None), checked decodable before any byte is compared."""
    source = _open(against, revision=revision)
    source_layout = source.model_layout()
    layout = {**source_layout.by_name(), **{t.name: t for t in source_layout.extras}}
    if source.quantization is None:
        return source.index, layout, None
    from .runs.dequant import Dequantizer, check_decodable

    check_decodable(source.index)
    return source.index, layout, Dequantizer(source.index)


def _same_slabs(slabs, out, file: str, start: int, bar) -> tuple[bool, int]:
    """Compare computed `slabs` with the written bytes from `start` on: (whether all matched, bytes that did)."""
    position = start
    for data in slabs:
        if out.read(file, position, len(data)) != bytes(data):
            return False, position - start
        position += len(data)
        bar.update(len(data))
    return True, position - start


# ---- a merged (plain Hugging Face) folder: `reshard merge` output -------------------------------------------------

def check_merged(location, *, against=None, revision: str | None = None, progress: bool | None = None) -> VerifyResult:
    """`check_folder` for a plain HF checkpoint (what `reshard merge` writes): the index agrees with the headers and
    its `metadata.total_size`; with `against` (the original HF checkpoint, a reshard folder or a saved distributed
    checkpoint), the key set is the source's on-disk one (`--layout original`) or its in-memory names (`fused`), and
    every in-memory tensor, read through each side's own key mapping, equals the source's byte for byte."""
    result = VerifyResult(False, location.spec, None if against is None else str(against), 0, 0, 0, 0, kind="merged")
    try:
        dest = _open(location.spec).index
    except ReshardError as e:
        return _with(result, problems=(str(e),))
    problems: list[str] = []
    metadata = _merge_metadata(dest.store)
    if isinstance(metadata, str):
        problems.append(metadata)
    elif metadata is not None and metadata.get("total_size") != dest.total_bytes:
        problems.append(f"{INDEX_NAME}: metadata.total_size is {metadata.get('total_size')}, the tensors hold "
                        f"{dest.total_bytes} bytes")
    compared = 0
    if against is not None and not problems:
        extras_from = metadata.get("extras_from") if isinstance(metadata, dict) else None
        compared = _compare_merged(dest, against, revision, extras_from, progress, problems)
    return _with(result, ok=not problems, files=len(dest.files), tensors=len(dest.tensors),
                 bytes_compared=compared, problems=tuple(problems))


def _merge_metadata(store) -> dict | str | None:
    """The `metadata` of a merged folder's index (None without an index; a problem as a string)."""
    if INDEX_NAME not in store.names():
        return None
    try:
        metadata = json.loads(store.read_all(INDEX_NAME, 64 << 20, "safetensors index"))["metadata"]
        if not isinstance(metadata, dict):
            raise TypeError("metadata is not an object")
        return metadata
    except (OSError, ValueError, KeyError, TypeError, ReshardError) as e:
        return f"{INDEX_NAME}: no metadata.total_size ({type(e).__name__}: {e})"


def _source_view(against, revision):
    """(index, layout, the on-disk keys of the source layout, the in-memory names a fused copy holds)."""
    source = _open(against, revision=revision)
    index, layout = source.index, source.model_layout()
    if source.kind is not Kind.CHECKPOINT:
        original = None if index.original is None else {p[0] for pieces in index.original.values() for p in pieces}
        tied = set(index.tied)
    else:
        if source.quantization is not None:
            raise UsageError(f"{against} is a quantized checkpoint: a merged folder holds the bf16 values computed "
                             "from it, not its bytes. Verify the merged folder against the reshard folder it was "
                             "merged from, and that folder with `reshard verify OUT --against SRC`, which "
                             "recomputes every dequantized chunk.")
        original = {p.source for t in layout.tensors for p in t.pieces}
        tied = set(tied_from_record({t.name: [(p.source,) for p in t.pieces] for t in layout.tensors}))
    extras = {t.name for t in layout.extras}  # written back under their own keys in either layout
    return (index, layout, None if original is None else original | extras,
            ({t.name for t in layout.tensors} - tied) | extras)


def _compare_merged(dest, against, revision, extras_from, progress, problems) -> int:
    from tqdm.auto import tqdm

    from .read.experts import find_experts

    src_index, src_layout, original_keys, fused_keys = _source_view(against, revision)
    sources = [(t, src_index) for t in (*src_layout.tensors, *src_layout.extras)]
    if extras_from is not None and not src_layout.extras:  # a trained folder merged with `--extras-from`
        extras_index, extras_layout, _, _ = _source_view(extras_from, None)
        names = {t.name for t in extras_layout.extras}
        original_keys = None if original_keys is None else original_keys | names
        fused_keys |= names
        sources += [(t, extras_index) for t in extras_layout.extras]
    keys = set(dest.tensors)
    if keys != original_keys and keys != fused_keys:
        expected = original_keys if original_keys is not None else fused_keys
        problems.append(f"the keys are neither the source's on-disk ones nor its in-memory names: missing "
                        f"{sorted(expected - keys)[:3]}, extra {sorted(keys - expected)[:3]}")
        return 0
    try:
        found = find_experts(dest)
    except ReshardError as e:
        problems.append(f"{dest.source}: {e}")
        return 0
    dest_layout = {**found.by_name(), **{t.name: t for t in found.extras}}
    total = sum(t.numel * DTYPE_BITS[t.dtype] // 8 for t, _ in sources)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard verify",
               disable=None if progress is None else not progress)
    compared = 0
    try:
        for src, src_index in sources:
            mine = dest_layout.get(src.name)
            if mine is None or mine.shape != src.shape or mine.dtype != src.dtype:
                problems.append(f"{src.name}: {'missing' if mine is None else f'{mine.dtype} {list(mine.shape)}'}, "
                                f"the source has {src.dtype} {list(src.shape)}")
                continue
            box = tuple((0, n) for n in src.shape)
            n = _compare_runs(chunk_runs(src, box, src_index.tensors), chunk_runs(mine, box, dest.tensors),
                              src_index.store, dest.store, bar)
            if n is None:
                problems.append(f"{src.name}: differs from the source")
            else:
                compared += n
    finally:
        bar.close()
    return compared


def _compare_runs(a, b, store_a, store_b, bar) -> int | None:
    """Compare two run lists tiling the same bytes (each sorted by `dst`) block by block; bytes compared, or None at
    the first difference."""
    i = j = position = 0
    while i < len(a) and j < len(b):
        ra, rb = a[i], b[j]
        end = min(ra.dst + ra.nbytes, rb.dst + rb.nbytes, position + COMPARE_BLOCK)
        n = end - position
        if store_a.read(ra.file, ra.src + position - ra.dst, n) != store_b.read(rb.file, rb.src + position - rb.dst, n):
            return None
        bar.update(n)
        position = end
        if position == ra.dst + ra.nbytes:
            i += 1
        if position == rb.dst + rb.nbytes:
            j += 1
    return position
