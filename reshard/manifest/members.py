"""The files of a written folder, opened safely: plain names inside the folder, regular files only.

A link inside the folder may point anywhere (the user's choice); what it names must be a regular file, so a FIFO or
a device swapped in for a shard is refused before a byte is read, and never blocks the open.
"""

from __future__ import annotations

import os
import stat
import zlib
from pathlib import Path

from ..errors import ManifestError
from .format import REMEDY, reject


def plain_name_problem(name) -> str | None:
    """Why `name` is not a plain file name inside a folder (a separator, `.`/`..`, absolute, empty), or None."""
    if not isinstance(name, str) or not name:
        return "a file name must be a non-empty string"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or os.path.isabs(name):
        return "a file name must be a plain name inside the folder (no separator, no `..`, not absolute)"
    return None


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
        reject("a file name", name, why)
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
        raise ManifestError([f"{name}: {kind}, not a regular file; reshard reads only regular files. {REMEDY}"])


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


def file_crc32(path: str | Path) -> str:
    """CRC-32 of a whole file as the manifest records it (8 hex digits), read through one reused 1 MiB buffer."""
    crc, buffer = 0, bytearray(1 << 20)  # a fresh block per read would cost page faults on every block
    view = memoryview(buffer)
    path = Path(path)
    with open_member(path.parent, path.name) as f:  # a FIFO or a device is never read
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"
