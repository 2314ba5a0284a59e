"""One path for every output file: its safetensors header, its blocks reserved, its chunks filled by the engine.

A rank file of `write`, an extras file and a file of `merge` differ only in their chunks and header metadata;
whether a chunk's bytes are copied or computed is the engine's business (`reshard.runs._engine`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import struct
from pathlib import Path

from ..plan import ChunkSpec
from ..runs import Engine
from ..syscalls import libc_function


def safetensors_header(chunks: list, metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix and JSON header for `chunks` (each with `name`, `dtype`, `shape`, `nbytes`) laid out
    back to back, padded to 8 bytes."""
    header: dict = {"__metadata__": metadata}
    cursor = 0
    for c in chunks:
        header[c.name] = {"dtype": c.dtype, "shape": list(c.shape), "data_offsets": [cursor, cursor + c.nbytes]}
        cursor += c.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, chunks: list[ChunkSpec], boxes: list, metadata: dict[str, str] | None,
                      engine: Engine, *, checksum: bool = True, header: bytes | None = None) -> int | None:
    """Create `path` holding the `chunks`, whose bytes are `boxes` (`(nbytes, tensor, box)` each, in the same
    order); returns the file's CRC-32 (None without `checksum`). `header`: `safetensors_header(chunks, metadata)`
    when the caller has it already."""
    if header is None:
        header = safetensors_header(chunks, metadata)
    fd = create_sized(path, len(header) + sum(nbytes for nbytes, _, _ in boxes))
    try:
        crc = engine.fill(fd, header, boxes, checksum=checksum)
    finally:
        os.close(fd)
    return crc


# Files of a remote source filled together (`Engine.fill_together`): each holds a descriptor while the group is filled.
_FILES_AT_ONCE = 64


def files_at_once(engine: Engine, on_file) -> int:
    """How many files the engine fills together: from a remote source, `_FILES_AT_ONCE` (each source range is then
    fetched once for them all); one at a time from a local source, whose kernel copy gains nothing, and where each
    file goes on as soon as it is whole (`on_file`: a bucket output's spool sends it)."""
    return _FILES_AT_ONCE if engine.fetches and on_file is None else 1


def write_safetensors_together(files: list[tuple[Path, bytes, list]], engine: Engine, *,
                               checksum: bool = True) -> list[int | None]:
    """`write_safetensors` for several files, `(path, header, boxes)` each, filled together
    (`Engine.fill_together`); their CRC-32s."""
    fds: list[int] = []
    try:
        for path, header, boxes in files:
            fds.append(create_sized(path, len(header) + sum(nbytes for nbytes, _, _ in boxes)))
        crcs = engine.fill_together([(fd, header, boxes) for fd, (_, header, boxes) in zip(fds, files)],
                                    checksum=checksum)
    finally:
        for fd in fds:
            os.close(fd)
    return crcs


def copy_source_file(store, name: str, dest: Path) -> None:
    """Copy the source's small non-weight file `name` (a config, a tokenizer) to `dest`: with its timestamps when it
    is local, else its bytes."""
    path = store.local_path(name)
    if path is not None:
        shutil.copy2(path, dest)
    else:
        dest.write_bytes(store.read(name, 0, store.size(name)))


def _fallocate():
    return libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def create_sized(path: Path, size: int) -> int:
    """Create `path` (it must not exist) for writing, with its `size` bytes of blocks reserved up front; returns the fd.

    Writes into reserved blocks skip the file system's block allocation on each write (on ext4, 32 MiB pwrites ran 2-7x
    faster, fsync included), and a full disk fails here, before any byte is copied. Where the platform or file system
    has no fallocate nothing is reserved: this is Linux's call, not glibc's posix_fallocate, which writes zeros instead.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    fn = _fallocate()
    if fn is not None and size > 0 and fn(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise OSError(err, os.strerror(err), str(path))
    return fd
