"""Where a source's bytes are, served as byte ranges: one interface over a local folder and an object store.

Every reader of a source (headers, `config.json`, the index, the manifest, tensor data) asks its `Store` for a name and
a byte range, so a local folder, a Hugging Face cache snapshot, the Hub and S3 differ only here:

- `LocalStore`: a folder. A name opens only as a regular file (a FIFO, a device or a folder is refused before it
  could block or never end), and, for a source, a link must resolve inside the folder, or inside `link_root` (a
  cache snapshot's links into its repo's `blobs/`). The engine copies a local file's bytes inside the kernel, so the
  store also gives its path (`local_path`).
- `reshard.read.remote`: an object store (S3, the Hub) through fsspec, read in bounded ranged requests with retries.
- `JoinedStore`: two stores as one (a merge's `--extras-from` source beside the trained folder).
"""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
import threading
import weakref
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError

READ_BLOCK = 32 << 20  # the largest ranged request: bounds the memory a remote read holds
HEADER_PROBE = 64 << 10  # a header's first request: the length prefix and, almost always, the whole header


class Store(ABC):
    """A source's files by name (POSIX-style, relative to the source), read in byte ranges.

    Attributes:
        location: the folder or URL, as messages show it.
        requests: the data and metadata requests made so far (a remote store's ranged GETs and listings).
    """

    location: str
    requests: int = 0
    remote: bool = True  # reads cost a request each: batch them, fetch headers concurrently

    def url(self, name: str) -> str:
        """Where file `name` is, as messages show it."""
        return f"{self.location.rstrip('/')}/{name}"

    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """The top-level file names, sorted."""

    @abstractmethod
    def size(self, name: str) -> int:
        """File `name`'s size in bytes."""

    def read(self, name: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes of `name` from `start` (an error if the file ends first). A store defines `read` or
        `readinto` (or both): each defaults to the other, as in `io` (a local file fills a buffer in place, an object
        store answers one ranged request)."""
        out = bytearray(length)
        self.readinto(name, start, memoryview(out))
        return bytes(out)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        """Fill `view` with the bytes of `name` from `start`."""
        view[:] = self.read(name, start, len(view))

    def local_path(self, name: str) -> Path | None:
        """The local file behind `name` (checked as `read` checks it), or None when it is not on this machine."""
        return None

    def open(self, name: str):
        """A file object for sequential reads of `name` (`readinto`, `seek`, `tell`, `close`)."""
        return RangeFile(self, name)

    def read_all(self, name: str, limit: int, what: str) -> bytes:
        """The whole of small file `name` (a config, an index, a manifest), refused over `limit` bytes."""
        size = self.size(name)
        if size > limit:
            raise CheckpointError(f"{self.url(name)}: {size} bytes, over the {limit} a {what} may have; it is not "
                                  "one. Nothing was read or changed.", path=self.url(name))
        return self.read(name, 0, size)

    def check_inside(self, name: str) -> None:
        """Refuse a name that leads out of the source (a local link); an object store has no links."""

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        """Release what the store holds open (a local store's descriptors)."""


def check_name(name: str, where: str) -> str:
    """`name` as a relative POSIX path inside the source: no `..`, not absolute, not empty."""
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or "\\" in name or "\0" in name or ".." in parts or not parts:
        raise CheckpointError(f"{where}: {name!r} is not a file name inside the source (no `..`, not absolute). "
                              "Nothing was read or changed.", path=where)
    return name


# ---- a local folder ------------------------------------------------------------------------------------------------

def _kind_of(mode: int) -> str | None:
    """What a non-regular file is ("a FIFO", ...), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def refuse_irregular(path: Path, name: str, mode: int) -> None:
    """Refuse a FIFO, a device, a socket or a folder where a file is read; the error's `kind` names which."""
    if kind := _kind_of(mode):
        error = CheckpointError(f"{name}: {kind}, not a regular file; reshard reads only regular files from a "
                                "checkpoint. Replace it with the real file. Nothing was read or changed.",
                                path=str(path))
        error.kind = kind
        raise error


def open_regular(path: Path, name: str):
    """Open `path` (`name` in messages) for reading, unbuffered, only if it is a regular file; the open cannot block
    (O_NONBLOCK, then fstat refuses a FIFO swapped in after the check)."""
    refuse_irregular(path, name, os.stat(path).st_mode)

    def opener(file, flags: int) -> int:
        fd = os.open(file, flags | os.O_NONBLOCK)
        try:
            refuse_irregular(path, name, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return open(path, "rb", buffering=0, opener=opener)  # by path: callers and audits see which file it is


class LocalStore(Store):
    """A local folder's files.

    Args:
        root: the folder.
        link_root: a link must resolve inside this folder (default: `root`).
        links_anywhere: follow links wherever they point (a folder the user assembled, such as a node's staged copy
            of a reshard folder, whose manifest says what each file must hold); the target must still be a regular
            file, and the files a write copies as they are must still be inside (`check_inside`).
        cache_repo: for a Hugging Face cache snapshot, the repo's cache folder, named in messages.
    """

    def __init__(self, root: Path, *, link_root: Path | None = None, links_anywhere: bool = False,
                 cache_repo: Path | None = None):
        self.root = Path(root)
        self.location = str(self.root)
        self.remote = False
        self.link_root = Path(link_root or root)
        self.links_anywhere = links_anywhere
        self.cache_repo = cache_repo
        self._inside: set[str] = set()  # names whose links were checked
        self._hold_descriptors()

    def _hold_descriptors(self) -> None:
        # A store nobody closed still gives its descriptors back when it is dropped: a long-lived process (a trainer,
        # a test session) that opens many sources must not run out of them.
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._release = weakref.finalize(self, _close_all, self._fds)

    def __getstate__(self):  # open descriptors stay with their process
        return {k: v for k, v in self.__dict__.items() if k not in ("_fds", "_lock", "_release")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._hold_descriptors()

    def url(self, name: str) -> str:
        return str(self.root / name)

    def path(self, name: str) -> Path:
        """The checked path of `name`: inside the folder, and a link only where it may point."""
        path = self.root / check_name(name, self.location)
        if not self.links_anywhere:
            self.check_inside(name)
        return path

    def check_inside(self, name: str) -> None:
        """Refuse `name` when it is a link that resolves out of the folder (or `link_root`): what a write copies as
        it is (a config, a tokenizer) must come from the source, whatever links its weight files may follow."""
        if name not in self._inside:
            self._check_link(self.root / check_name(name, self.location), name)
            self._inside.add(name)

    def _check_link(self, path: Path, name: str) -> None:
        target = path.resolve()
        try:
            target.relative_to(self.link_root.resolve())
        except ValueError:
            if self.cache_repo is not None:
                accepted = (f"in a Hugging Face cache snapshot, links are followed into {self.cache_repo / 'blobs'} "
                            "(the cache's own layout) only")
            else:
                accepted = "a checkpoint folder's files must be inside it (a Hugging Face cache snapshot's links "\
                           "into its repo's blobs/ are the one exception)"
            raise CheckpointError(f"{name}: a link out of the checkpoint folder (to {target}); {accepted}. Copy the "
                                  "file in, or pass the folder the link points into. Nothing was read or changed.",
                                  path=str(path)) from None

    def names(self) -> tuple[str, ...]:
        """The top-level entries that are not folders (a FIFO or a device is listed, and refused when read)."""
        return tuple(sorted(n for n in os.listdir(self.root) if not os.path.isdir(self.root / n)))

    def size(self, name: str) -> int:
        path = self.path(name)
        mode = os.stat(path)
        refuse_irregular(path, name, mode.st_mode)
        return mode.st_size

    def local_path(self, name: str) -> Path | None:
        path = self.path(name)
        refuse_irregular(path, name, os.stat(path).st_mode)
        return path

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                with open_regular(self.path(name), name) as f:
                    fd = self._fds[name] = os.dup(f.fileno())
            return fd

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        fd, done = self._fd(name), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], start + done)
            if got <= 0:
                raise CheckpointError(f"{self.url(name)}: the file ends at byte {start + done}, before the "
                                      f"{start + len(view)} its header says; it is truncated or changed. Copy it "
                                      "again. Nothing was kept.", path=self.url(name))
            done += got

    def open(self, name: str):
        return open_regular(self.path(name), name)

    def close(self) -> None:
        with self._lock:
            _close_all(self._fds)


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


# ---- sequential reads in large ranges ----------------------------------------------------------------------------

class RangeFile:
    """A remote file read front to back, one ranged request per `READ_BLOCK` (a rank reading its own file: a few
    large requests, not one per tensor); `seek` past the buffer starts a new range there. Holds one block."""

    def __init__(self, store: Store, name: str, *, block: int = READ_BLOCK):
        self.store, self.name, self.block = store, name, block
        self.size = store.size(name)
        self._pos = 0
        self._start = 0
        self._data = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._data = b""

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, view) -> int:
        view = memoryview(view).cast("B")
        if self._pos >= self.size or not len(view):
            return 0
        offset = self._pos - self._start
        if not 0 <= offset < len(self._data):
            if len(view) >= self.block:  # a large read goes straight into the caller's memory
                n = min(len(view), self.size - self._pos) // self.block * self.block or len(view)
                n = min(n, self.size - self._pos)
                self.store.readinto(self.name, self._pos, view[:n])
                self._pos += n
                return n
            self._start, offset = self._pos, 0
            self._data = self.store.read(self.name, self._pos, min(self.block, self.size - self._pos))
        n = min(len(view), len(self._data) - offset)
        view[:n] = self._data[offset:offset + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        n = self.size - self._pos if n < 0 else min(n, self.size - self._pos)
        out = bytearray(max(n, 0))
        view, done = memoryview(out), 0
        while done < len(out):
            got = self.readinto(view[done:])
            if not got:
                break
            done += got
        return bytes(out[:done])


class JoinedStore(Store):
    """Two stores read as one: a name under `prefix` is `other`'s (a merge's `--extras-from` source beside the trained
    folder), every other name `main`'s. Only `main`'s names are listed."""

    def __init__(self, main: Store, prefix: str, other: Store):
        self.main, self.prefix, self.other = main, prefix, other
        self.location = main.location
        self.remote = main.remote or other.remote

    @property
    def requests(self) -> int:
        return self.main.requests + self.other.requests

    def _route(self, name: str) -> tuple[Store, str]:
        if name.startswith(self.prefix):
            return self.other, name[len(self.prefix):]
        return self.main, name

    def url(self, name: str) -> str:
        store, name = self._route(name)
        return store.url(name)

    def names(self) -> tuple[str, ...]:
        return self.main.names()

    def size(self, name: str) -> int:
        store, name = self._route(name)
        return store.size(name)

    def read(self, name: str, start: int, length: int) -> bytes:
        store, name = self._route(name)
        return store.read(name, start, length)

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        store, name = self._route(name)
        store.readinto(name, start, view)

    def local_path(self, name: str) -> Path | None:
        store, name = self._route(name)
        return store.local_path(name)

    def check_inside(self, name: str) -> None:
        store, name = self._route(name)
        store.check_inside(name)

    def open(self, name: str):
        store, name = self._route(name)
        return store.open(name)

    def close(self) -> None:
        self.main.close()
        self.other.close()
