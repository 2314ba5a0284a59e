"""Prove a written folder complete and exact: manifest vs files, coverage, empty markers, and bytes vs source.

This proves the copying, not reshard's key mapping (which on-disk keys make which in-memory tensor): the bytes are
compared with the source bytes that mapping names. The tests check the mapping against transformers' own load.
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

from .checkpoint import DTYPE_BITS, read_checkpoint, read_header
from .errors import MeshError, ReshardError, VerifyError
from .manifest import MANIFEST_NAME, coverage_problems, header_problems, read_manifest
from .write import COPY_BUFFER_BYTES, chunk_runs


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
        VerifyError: listing every problem found, one per line.
    """
    summary = check_folder(folder, against=against, revision=revision, checksums=checksums, progress=progress)
    if summary["problems"]:
        raise VerifyError(summary["problems"])
    return summary


def check_folder(folder: str | os.PathLike, *, against: str | os.PathLike | None = None,
                 revision: str | None = None, checksums: bool = True, progress: bool | None = None) -> dict:
    """`verify`, returning the problems instead of raising them (what `reshard verify --json` prints).

    Returns:
        `ok`, `folder`, `against`, `files`, `tensors`, `empty_markers`, `bytes_compared` and `problems` (one line
        each; empty when `ok`).

    Raises:
        ReshardError: the source given as `against` cannot be read.
    """
    folder = Path(folder)
    summary = {"ok": False, "folder": str(folder), "against": None if against is None else str(against),
               "files": 0, "tensors": 0, "empty_markers": 0, "bytes_compared": 0, "problems": []}
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
    tensors = data["tensors"]
    from tqdm.auto import tqdm

    total = sum(entry["bytes"] for entry in data["files"]) if checksums else 0
    if against is not None:
        total += sum(math.prod(c.shape) * DTYPE_BITS.get(tensors[c.name]["dtype"], 0) // 8
                     for entry in data["files"] for c in manifest.chunks(entry))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard verify",
               disable=None if progress is None else not progress)
    try:
        compared, markers = _check(manifest, against, revision, checksums, bar, problems, corrupt)
    finally:
        bar.close()
    problems = corrupt + problems
    return {**summary, "ok": not problems, "files": len(data["files"]), "tensors": len(tensors),
            "empty_markers": markers, "bytes_compared": compared, "problems": problems}


def _crc32(path: Path, buffer: bytearray, bar) -> str:
    """The file's CRC-32 as the manifest records it (8 hex digits), advancing `bar` as the bytes pass."""
    crc, view = 0, memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            bar.update(n)
    return f"{crc:08x}"


def _check(manifest, against, revision, checksums, bar, problems, corrupt) -> tuple[int, int]:
    """Every check of `verify`, appending to `problems` and `corrupt`; returns (bytes compared, empty markers).

    The manifest says which chunks each file holds (a run of `order`, each chunk's box following from the tensor's
    placement and the file's coordinate): each header must hold exactly those, with the offsets in
    `DCP_SHARDING_INFO`; `coverage_problems` shows they put every element somewhere exactly once.
    """
    folder, data = manifest.path, manifest.data
    buffer = bytearray(COPY_BUFFER_BYTES)
    chunks: dict[str, list[tuple[int, tuple, str]]] = {name: [] for name in data["tensors"]}
    headers = {}
    markers = 0
    problems += coverage_problems(data)
    for entry in data["files"]:
        path = folder / entry["name"]
        if not path.exists():
            problems.append(f"{entry['name']}: missing (rank(s) {data['coords'][entry['coord']]['ranks']} read it)")
            continue
        if path.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['name']}: {path.stat().st_size} bytes, manifest says {entry['bytes']}")
            continue
        if checksums and _crc32(path, buffer, bar) != entry["crc32"]:
            corrupt.append(f"{entry['name']}: CRC-32 differs from the manifest (the file is corrupt)")
        try:
            header = read_header(path)
        except ReshardError as e:
            problems.append(str(e))
            continue
        headers[entry["name"]] = header
        expected = manifest.chunks(entry)
        mismatches = header_problems(entry, expected, header)
        problems += mismatches
        if mismatches:
            continue
        for chunk in expected:
            if chunk.is_empty:
                markers += 1
            else:
                chunks[chunk.name].append((entry["coord"], tuple(zip(chunk.offsets, chunk.shape)), entry["name"]))
    compared = 0
    if against is not None and not problems:
        compared = _compare_with_source(folder, data, headers, chunks, against, revision, problems, bar)
    return compared, markers


def _compare_with_source(folder, data, headers, chunks, against, revision, problems, bar) -> int:
    """Compare each chunk's bytes with the bytes the source pieces give for that region."""
    from .experts import find_experts

    index = read_checkpoint(against, revision=revision, need_data=True)
    layout = find_experts(index).by_name()
    compared = 0
    buffer = bytearray(COPY_BUFFER_BYTES)
    fds: dict[str, int] = {}
    try:
        for name, found in chunks.items():
            target = layout.get(name)
            if target is None:
                problems.append(f"{name}: not a tensor of the source model")
                continue
            for coord, box, file in found:
                entry = next(t for t in headers[file].tensors if t.name == name)
                if entry.dtype != target.dtype:
                    problems.append(f"{file}: {name} is {entry.dtype}, the source is {target.dtype}")
                    continue
                if str(folder / file) not in fds:  # (setdefault would open, and leak, a descriptor per call)
                    fds[str(folder / file)] = os.open(folder / file, os.O_RDONLY)
                out_fd = fds[str(folder / file)]
                for run in chunk_runs(target, box, index.tensors):
                    if run.file not in fds:
                        fds[run.file] = os.open(index.path_of(run.file), os.O_RDONLY)
                    src_fd = fds[run.file]
                    done = 0
                    while done < run.nbytes:
                        n = min(run.nbytes - done, len(buffer) // 2)
                        a = os.pread(src_fd, n, run.src + done)
                        b = os.pread(out_fd, n, entry.data_start + run.dst + done)
                        if a != b:
                            problems.append(f"{file}: {name} differs from the source at chunk {box}")
                            break
                        done += n
                        bar.update(n)
                    compared += done
    finally:
        for fd in fds.values():
            os.close(fd)
    return compared
