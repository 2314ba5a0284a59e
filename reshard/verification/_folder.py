"""`reshard verify` of a reshard folder: manifest vs files, coverage, empty markers, CRC-32s, and bytes vs source."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

from ..errors import ReshardError, VerifyError
from ..manifest import copied_problems, coverage_problems, header_problems, read_manifest
from ..plan import DTYPE_BITS, RankSpans, ranks_text
from ..read import ByteRange, Folder, INDEX_NAME, SourceKind, READ_BLOCK, header_of
from ..results import VerifyResult
from ..runs import Run, chunk_runs
from ..words import plural
from ._merged import check_merged


def check_folder(folder: Folder, *, against=None, checksums: bool = True, progress: bool | None = None,
                 ranks=None) -> VerifyResult:
    """`reshard verify` of a folder opened once (`reshard.read.open_folder`, by `reshard.api.verify_folder`): every
    check, the problems in the result instead of raised (`reshard.api.verify` raises). `against` is the source
    opened once (`reshard.read.open_source`), or None.

    A node's copy (its manifest's `holds`) is checked for the ranks it holds; `ranks` (rank spans) checks only the
    files those ranks load, in a copy staged by hand.

    Raises:
        ReshardError: a source the checked folder names cannot be read (a merge's `--extras-from`).
        UsageError: `ranks` outside the mesh or the copy.
    """
    location, manifest = folder.location, folder.manifest
    empty = VerifyResult(False, location.spec, None if against is None else against.spec, 0, 0, 0, 0)
    try:
        if manifest is None and location.kind is SourceKind.CHECKPOINT and _holds_weights(location.store):
            return check_merged(folder, against=against, progress=progress)
        if manifest is None:
            read_manifest(location.store)  # raises the ManifestError that says what is missing
    except VerifyError as e:
        return replace(empty, problems=tuple(e.problems))
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
        compared, markers = _check(manifest, listed, against, dequantized)
    finally:
        bar.close()
    problems = corrupt + problems
    return VerifyResult(not problems, empty.folder, empty.against, len(manifest.files), len(manifest.tensors),
                        markers, compared, tuple(dequantized), tuple(problems),
                        ranks=None if manifest.holds is None else str(RankSpans(manifest.holds)),
                        write_id=manifest.write_id)




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


def _check(manifest, listed: _Listed, against, dequantized) -> tuple[int, int]:
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
        compared = _compare_with_source(listed.store, headers, chunks, against, problems, listed.bar, dequantized)
    return compared, markers




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


def _compare_with_source(out, headers, chunks, against, problems, bar, dequantized) -> int:
    """Compare each chunk's bytes with the bytes the source pieces give for that region; a dequantized chunk with
    the values `write --dequantize` computes from the source (its names are added to `dequantized`). The copied
    chunks of one written file are compared together, their source bytes fetched in few large requests."""
    index, layout, dequantizer = _source_to_compare(against)
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
    source, read in few requests (`Store.read_ranges`); each differing chunk is named once. Bytes compared."""
    runs = [(name, box, run) for name, box, chunk in placed for run in chunk]
    differing, compared = [], 0

    def compare(piece) -> None:
        nonlocal compared
        name, box, run = runs[piece.index]
        if out.read(file, run.dst + piece.offset, len(piece.data)) != piece.data and name not in differing:
            differing.append(name)
            problems.append(f"{file}: {name} differs from the source at chunk {box}")
        compared += len(piece.data)
        bar.update(len(piece.data))

    source.read_ranges([ByteRange(run.file, run.src, run.nbytes) for _, _, run in runs], compare)
    return compared


def _source_to_compare(source):
    """(the source's index, its tensors by name with the extras under their keys, the `Dequantizer` of a quantized
    source or None), checked decodable before any byte is compared."""
    source_layout = source.model_layout()
    layout = {**source_layout.by_name(), **{t.name: t for t in source_layout.extras}}
    if source.quantization is None:
        return source.index, layout, None
    from ..runs import Dequantizer, check_decodable

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


