"""Prove a written folder complete and exact: manifest vs files, coverage, empty markers, and bytes vs source.

This proves the copying, not reshard's key mapping (which on-disk keys make which in-memory tensor): the bytes are
compared with the source bytes that mapping names. The tests check the mapping against transformers' own load.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import MeshError, ReshardError, UsageError, VerifyError
from .manifest import (MANIFEST_NAME, copied_problems, coverage_problems, header_problems, member_problem, open_member,
                       read_manifest, tied_from_record)
from .plan.dtypes import DTYPE_BITS
from .plan.mesh import ranks_text
from .read.checkpoint import read_header
from .runs.engine import COPY_BUFFER_BYTES
from .runs.byte_runs import chunk_runs


def verify(folder: str | os.PathLike, *, against: str | os.PathLike | None = None, revision: str | None = None,
           checksums: bool = True, progress: bool | None = None) -> dict:
    """Check a `reshard write` folder; with `against`, compare every byte with the source checkpoint.

    Checks: every manifest file exists with its size and CRC-32; each coordinate's files hold every tensor once (a
    chunk, an explicit empty marker, or a whole copy of a replicated tensor); each header holds exactly the chunks
    the manifest derives for it (shapes, offsets in `DCP_SHARDING_INFO`, empty markers counted); every sharded
    tensor's non-empty chunks tile it exactly once. With `against`: each chunk's bytes, every copy of a replicated
    tensor included, equal the source's.

    What this proves is the copying: that the bytes sit where the manifest says and equal the source bytes reshard's
    key mapping names. It does not prove that mapping right (which on-disk keys make which in-memory tensor); the
    tests check that against transformers' own load.

    Args:
        folder: the written folder.
        against: the source checkpoint (folder, file or Hub repo id).
        checksums: recompute every file's CRC-32 (reads all bytes).
        progress: show a byte progress bar (None: only on a terminal; False: never).

    Returns:
        The summary of `check_folder`, whose `problems` are empty.

    Raises:
        ManifestError: `reshard.json` is unsound (a `VerifyError` too), naming the key and the value.
        VerifyError: listing every problem found, one per line.
    """
    from .write.merge import is_merged_folder

    if not is_merged_folder(folder):
        read_manifest(folder)  # an unsound manifest raises its own ManifestError (a VerifyError) before any read
    summary = check_folder(folder, against=against, revision=revision, checksums=checksums, progress=progress)
    if summary["problems"]:
        raise VerifyError(summary["problems"])
    return summary


def check_folder(folder: str | os.PathLike, *, against: str | os.PathLike | None = None,
                 revision: str | None = None, checksums: bool = True, progress: bool | None = None) -> dict:
    """`verify`, returning the problems instead of raising them (what `reshard verify --json` prints).

    Returns:
        `ok`, `folder`, `against`, `files`, `tensors`, `empty_markers`, `bytes_compared`, `dequantized_tensors`
        (the tensors `against` gave as quantized, recomputed and compared bit for bit) and `problems` (one line
        each; empty when `ok`).

    Raises:
        ReshardError: the source given as `against` cannot be read.
    """
    from .write.merge import is_merged_folder

    if is_merged_folder(folder):  # a `reshard merge` output (a plain HF checkpoint)
        return check_merged(folder, against=against, revision=revision, progress=progress)
    folder = Path(folder)
    summary = {"ok": False, "folder": str(folder), "against": None if against is None else str(against),
               "files": 0, "tensors": 0, "empty_markers": 0, "bytes_compared": 0, "dequantized_tensors": [],
               "problems": []}
    try:
        manifest = read_manifest(folder)
        manifest.mesh  # an impossible mesh in the manifest is a problem of the folder
    except VerifyError as e:
        return {**summary, "problems": e.problems}
    except MeshError as e:
        return {**summary, "problems": [f"{folder / MANIFEST_NAME}: {e}"]}
    data = manifest.data
    problems: list[str] = []
    corrupt: list[str] = []  # CRC mismatches: the structure is still sound, so --against still compares bytes
    dequantized: list[str] = []  # tensors --against recomputed from a quantized source
    tensors = data["tensors"]
    from tqdm.auto import tqdm

    total = sum(entry.bytes for entry in manifest.files) if checksums else 0
    if against is not None:
        total += sum(math.prod(c.shape) * DTYPE_BITS.get(tensors[c.name]["dtype"], 0) // 8
                     for entry in manifest.files for c in manifest.chunks(entry))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard verify",
               disable=None if progress is None else not progress)
    try:
        compared, markers = _check(manifest, against, revision, checksums, bar, problems, corrupt, dequantized)
    finally:
        bar.close()
    problems = corrupt + problems
    return {**summary, "ok": not problems, "files": len(manifest.files), "tensors": len(tensors),
            "empty_markers": markers, "bytes_compared": compared, "dequantized_tensors": dequantized,
            "problems": problems}


def _crc32(path: Path, buffer: bytearray, bar) -> str:
    """The file's CRC-32 as the manifest records it (8 hex digits), advancing `bar` as the bytes pass."""
    crc, view = 0, memoryview(buffer)
    with open_member(path.parent, path.name) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            bar.update(n)
    return f"{crc:08x}"


@dataclass(frozen=True)
class _Listed:
    """The checks every file the manifest lists gets, rank file or extras file, and where their findings go.

    `corrupt` takes CRC mismatches apart from `problems`: the structure is still sound, so `--against` still
    compares bytes.
    """

    folder: Path
    checksums: bool
    buffer: bytearray  # one read buffer for every CRC
    bar: object
    problems: list[str]
    corrupt: list[str]

    def header(self, name: str, size: int, crc32: str, holds: str):
        """The header of listed file `name`: present (else missing, with `holds` saying what it holds), a regular
        file, of `size` bytes and CRC-32 `crc32` (when checksums are on), and a header that parses. None after a
        problem, which is recorded."""
        path = self.folder / name
        if not path.exists():
            self.problems.append(f"{name}: missing ({holds})")
            return None
        if problem := member_problem(self.folder, name):  # a FIFO or a device: refused before a byte is read
            self.problems.append(problem)
            return None
        if path.stat().st_size != size:
            self.problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {size}")
            return None
        if self.checksums and _crc32(path, self.buffer, self.bar) != crc32:
            self.corrupt.append(f"{name}: CRC-32 differs from the manifest (the file is corrupt)")
        try:
            return read_header(path)
        except ReshardError as e:
            self.problems.append(str(e))
            return None


def _check(manifest, against, revision, checksums, bar, problems, corrupt, dequantized) -> tuple[int, int]:
    """Every check of `verify`, appending to `problems` and `corrupt`; returns (bytes compared, empty markers).

    The manifest says which chunks each file holds (a run of `order`, each chunk's box following from the tensor's
    placement and the file's coordinate): each header must hold exactly those, with the offsets in
    `DCP_SHARDING_INFO`; `coverage_problems` shows they put every element somewhere exactly once.
    """
    folder, data = manifest.path, manifest.data
    listed = _Listed(folder, checksums, bytearray(COPY_BUFFER_BYTES), bar, problems, corrupt)
    chunks: dict[str, list[tuple[int, tuple, str]]] = {name: [] for name in data["tensors"]}
    headers = {}
    markers = 0
    problems += coverage_problems(data)
    problems += copied_problems(folder, manifest.copied)  # a folder whose config cannot load does not pass
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
    _check_extras(listed, data, headers, chunks)
    compared = 0
    if against is not None and not problems:
        compared = _compare_with_source(folder, data, headers, chunks, against, revision, problems, bar, dequantized)
    return compared, markers


def _check_extras(listed: _Listed, data: dict, headers: dict, chunks: dict) -> None:
    """The manifest's extras files (tensors the model does not load, whole under their on-disk keys): each checked
    as every listed file is, holding exactly its keys. Each tensor joins `chunks` whole (coordinate -1: no rank reads
    it), so `--against` compares its bytes like every chunk's."""
    for entry in data.get("extras") or ():
        name, keys = entry["name"], entry["keys"]
        header = listed.header(name, entry["bytes"], entry["crc32"],
                               f"it holds {len(keys)} tensor(s) the model does not load, e.g. {keys[0]}")
        if header is None:
            continue
        found = {t.name: t for t in header.tensors}
        if sorted(found) != sorted(keys):
            listed.problems.append(f"{name}: header holds {sorted(set(found) ^ set(keys))[:3]} differently from the "
                                   "manifest")
            continue
        headers[name] = header
        for key in keys:
            chunks[key] = [(-1, tuple((0, n) for n in found[key].shape), name)]


def _compare_with_source(folder, data, headers, chunks, against, revision, problems, bar, dequantized) -> int:
    """Compare each chunk's bytes with the bytes the source pieces give for that region; a dequantized chunk with
    the values `write --dequantize` computes from the source (its names are added to `dequantized`)."""
    index, layout, dequantizer = _source_to_compare(against, revision)
    compared = 0
    fds: dict[str, int] = {}
    try:
        for name, found in chunks.items():
            target = layout.get(name)
            if target is None:
                problems.append(f"{name}: not a tensor of the source model")
                continue
            computed = dequantizer is not None and dequantizer.computes(target)
            if computed:
                dequantized.append(name)
            for coord, box, file in found:
                entry = next(t for t in headers[file].tensors if t.name == name)
                if entry.dtype != target.dtype:
                    problems.append(f"{file}: {name} is {entry.dtype}, the source is {target.dtype}")
                    continue
                if str(folder / file) not in fds:  # (setdefault would open, and leak, a descriptor per call)
                    fds[str(folder / file)] = os.open(folder / file, os.O_RDONLY)
                out_fd = fds[str(folder / file)]
                if computed:  # recomputed from the source bytes, compared bit for bit
                    done, same = _same_slabs(dequantizer.chunk_slabs(target, box), out_fd, entry.data_start, bar)
                    compared += done
                    if not same:
                        problems.append(f"{file}: {name} differs from its dequantized source at chunk {box}")
                    continue
                for run in chunk_runs(target, box, index.tensors):
                    if run.file not in fds:
                        fds[run.file] = os.open(index.path_of(run.file), os.O_RDONLY)
                    done, same = _same_run(fds[run.file], out_fd, run, entry.data_start, bar)
                    compared += done
                    if not same:
                        problems.append(f"{file}: {name} differs from the source at chunk {box}")
    finally:
        for fd in fds.values():
            os.close(fd)
        if dequantizer is not None:
            dequantizer.close()
    return compared


def _source_to_compare(against, revision):
    """(the source's index, its tensors by name with the extras under their keys, the `Dequantizer` of a quantized
    source or None), checked decodable before any byte is compared."""
    from .api import read_source
    from .read.experts import find_experts

    index = read_source(against, revision=revision, need_data=True)
    source_layout = find_experts(index)
    layout = {**source_layout.by_name(), **{t.name: t for t in source_layout.extras}}
    if index.quantization is None:
        return index, layout, None
    from .runs.dequant import Dequantizer, check_decodable

    check_decodable(index)
    return index, layout, Dequantizer(index)


def _same_slabs(slabs, out_fd: int, start: int, bar) -> tuple[int, bool]:
    """Compare computed `slabs` with the written bytes from `start` on: (bytes that matched, whether all did)."""
    position = start
    for data in slabs:
        if os.pread(out_fd, len(data), position) != data:
            return position - start, False
        position += len(data)
        bar.update(len(data))
    return position - start, True


def _same_run(src_fd: int, out_fd: int, run, start: int, bar) -> tuple[int, bool]:
    """Compare one byte run of the source with the written chunk that begins at `start`, half a copy buffer at a
    time: (bytes that matched, whether all did)."""
    done, step = 0, COPY_BUFFER_BYTES // 2
    while done < run.nbytes:
        n = min(run.nbytes - done, step)
        if os.pread(src_fd, n, run.src + done) != os.pread(out_fd, n, start + run.dst + done):
            return done, False
        done += n
        bar.update(n)
    return done, True


# ---- a merged (plain Hugging Face) folder: `reshard merge` output -------------------------------------------------

def check_merged(folder: str | os.PathLike, *, against: str | os.PathLike | None = None,
                 revision: str | None = None, progress: bool | None = None) -> dict:
    """`check_folder` for a plain HF checkpoint (what `reshard merge` writes): the index agrees with the headers and
    its `metadata.total_size`; with `against` (the original HF checkpoint, a reshard folder or a saved distributed
    checkpoint), the key set is the source's on-disk one (`--layout original`) or its in-memory names (`fused`), and
    every in-memory tensor, read through each side's own key mapping, equals the source's byte for byte.

    Returns:
        The same summary fields as `check_folder` (`empty_markers` is 0), plus `kind: "merged"`.
    """
    from .read.checkpoint import INDEX_NAME, read_checkpoint

    folder = Path(folder)
    summary = {"ok": False, "folder": str(folder), "against": None if against is None else str(against),
               "kind": "merged", "files": 0, "tensors": 0, "empty_markers": 0, "bytes_compared": 0,
               "dequantized_tensors": [], "problems": []}
    problems: list[str] = []
    try:
        dest = read_checkpoint(folder)
    except ReshardError as e:
        return {**summary, "problems": [str(e)]}
    try:
        import json

        total = json.loads((folder / INDEX_NAME).read_text())["metadata"]["total_size"]
        if total != dest.total_bytes:
            problems.append(f"{INDEX_NAME}: metadata.total_size is {total}, the tensors hold {dest.total_bytes} bytes")
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"{INDEX_NAME}: no metadata.total_size ({type(e).__name__}: {e})")
    compared = 0
    if against is not None and not problems:
        compared = _compare_merged(dest, against, revision, progress, problems)
    return {**summary, "ok": not problems, "files": len(dest.files), "tensors": len(dest.tensors),
            "bytes_compared": compared, "problems": problems}


def _source_view(against, revision):
    """(index, layout, the on-disk keys of the source layout, the in-memory names a fused copy holds)."""
    from .read.checkpoint import read_checkpoint
    from .read.dcp_source import dcp_kind, read_dcp_source
    from .read.experts import find_experts

    if dcp_kind(against):
        index, layout = read_dcp_source(against)
        original = None if index.original is None else {p[0] for pieces in index.original.values() for p in pieces}
        tied = set(index.tied)
    else:
        index = read_checkpoint(against, revision=revision, need_data=True)
        if index.config.get("quantization_config"):
            raise UsageError(f"{against} is a quantized checkpoint: a merged folder holds the bf16 values computed "
                              "from it, not its bytes. Verify the merged folder against the reshard folder it was "
                              "merged from, and that folder with `reshard verify OUT --against SRC`, which "
                              "recomputes every dequantized chunk.")
        layout = find_experts(index)
        original = {p.source for t in layout.tensors for p in t.pieces}
        tied = set(tied_from_record({t.name: [(p.source,) for p in t.pieces] for t in layout.tensors}))
    extras = {t.name for t in layout.extras}  # written back under their own keys in either layout
    return (index, layout, None if original is None else original | extras,
            ({t.name for t in layout.tensors} - tied) | extras)


def _merged_extras_from(dest) -> str | None:
    """The `--extras-from` source a merged folder's index records (`metadata.extras_from`), or None."""
    import json

    from .read.checkpoint import INDEX_NAME

    try:
        return json.loads((dest.root / INDEX_NAME).read_text())["metadata"].get("extras_from")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _compare_merged(dest, against, revision, progress, problems) -> int:
    from tqdm.auto import tqdm

    from .read.experts import find_experts

    src_index, src_layout, original_keys, fused_keys = _source_view(against, revision)
    sources = [(t, src_index) for t in (*src_layout.tensors, *src_layout.extras)]
    extras_from = _merged_extras_from(dest)
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
    fds: dict[tuple[str, str], int] = {}

    def fd(index, file) -> int:
        if (str(index.root), file) not in fds:
            fds[(str(index.root), file)] = os.open(index.path_of(file), os.O_RDONLY)
        return fds[(str(index.root), file)]

    compared = 0
    try:
        for src, src_index in sources:
            mine = dest_layout.get(src.name)
            if mine is None or mine.shape != src.shape or mine.dtype != src.dtype:
                problems.append(f"{src.name}: {'missing' if mine is None else f'{mine.dtype} {list(mine.shape)}'}, "
                                f"the source has {src.dtype} {list(src.shape)}")
                continue
            box = tuple((0, n) for n in src.shape)
            a = chunk_runs(src, box, src_index.tensors)
            b = chunk_runs(mine, box, dest.tensors)
            n = _compare_runs(a, b, lambda f: fd(src_index, f), lambda f: fd(dest, f), bar)
            if n is None:
                problems.append(f"{src.name}: differs from the source")
            else:
                compared += n
    finally:
        bar.close()
        for handle in fds.values():
            os.close(handle)
    return compared


def _compare_runs(a, b, open_a, open_b, bar) -> int | None:
    """Compare two run lists tiling the same bytes (each sorted by `dst`) block by block; bytes compared, or None at
    the first difference."""
    i = j = position = 0
    step = COPY_BUFFER_BYTES
    while i < len(a) and j < len(b):
        ra, rb = a[i], b[j]
        end = min(ra.dst + ra.nbytes, rb.dst + rb.nbytes, position + step)
        n = end - position
        if os.pread(open_a(ra.file), n, ra.src + position - ra.dst) != \
                os.pread(open_b(rb.file), n, rb.src + position - rb.dst):
            return None
        bar.update(n)
        position = end
        if position == ra.dst + ra.nbytes:
            i += 1
        if position == rb.dst + rb.nbytes:
            j += 1
    return position
