"""Where a source's bytes are, served as byte ranges: one interface over a local folder and an object store.

Every reader of a source (headers, `config.json`, the index, the manifest, tensor data) asks its `Store` for a name and
a byte range, so a local folder, a Hugging Face cache snapshot, the Hub and S3 differ only here:

- `LocalStore`: a folder. A name opens only as a regular file (a FIFO, a device or a folder is refused before it
  could block or never end), and, for a source, a link must resolve inside the folder, or inside `link_root` (a
  cache snapshot's links into its repo's `blobs/`). The engine copies a local file's bytes inside the kernel, so the
  store also gives its path (`local_path`).
- `reshard.read._remote`: an object store (S3, the Hub) through fsspec, read in bounded ranged requests with retries.
- `reshard.read._joined`: two stores as one (a merge's `--extras-from` source beside the trained folder).
"""

from __future__ import annotations

import errno
import os
import stat
from abc import ABC, abstractmethod
import threading
import weakref
from pathlib import Path, PurePosixPath
from typing import Callable, Sequence

from ..errors import CheckpointError, SourceChangedError
from ..syscalls import pread_full
from ._ranges import ByteRange, Piece, read_ranges

READ_BLOCK = 32 << 20  # the largest ranged request: bounds the memory a remote read holds
HEADER_PROBE = 64 << 10  # a header's first request: the length prefix and, almost always, the whole header


class Store(ABC):
    """A source's files by name (POSIX-style, relative to the source), read in byte ranges.

    Attributes:
        location: the folder or URL, as messages show it.
        requests: the data and metadata requests made so far (a remote store's ranged GETs and listings).
        fetched: the bytes of data a remote store has received so far (0 for a local folder).
    """

    location: str
    requests: int = 0
    fetched: int = 0
    remote: bool = True  # reads cost a request each: batch them, fetch headers concurrently
    in_flight: int = 0  # requests `read_ranges` keeps going while the caller uses one: where each costs a round trip

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

    def read_ranges(self, ranges: Sequence[ByteRange], deliver: Callable[[Piece], None], *,
                    buffers: list[bytearray] | None = None, each: Callable[[memoryview], object] | None = None) -> None:
        """Read many ranges in few requests, in source order: neighbours are joined into requests of at most `RANGE`
        bytes, `in_flight` of them kept going while the caller uses one (`reshard.read._ranges`).

        Args:
            ranges: what to read, `ByteRange(name, start, length)` each.
            deliver: called on this thread with each `Piece` (the range's index, the offset into it, its bytes, and
                `each(bytes)`) as it arrives: in source order, not the order of `ranges`; a range longer than a
                request comes in several pieces.
            buffers: where the requests land, kept by the caller from call to call (their pages fault in once).
            each: work on each piece's bytes done where they arrived (a fetch thread): a CRC-32.

        A failure stops the requests not yet made and waits for the others: nothing is left running."""
        read_ranges(self, ranges, deliver, in_flight=self.in_flight, buffers=buffers, each=each)

    def local_path(self, name: str) -> Path | None:
        """The local file behind `name` (checked as `read` checks it), or None when it is not on this machine."""
        return None

    def descriptor(self, name: str) -> int:
        """A new descriptor (the caller closes it) of local file `name`: the file its header was read from."""
        path = self.local_path(name)
        if path is None:
            raise CheckpointError(f"{self.url(name)} is not on this machine.", path=self.url(name))
        return os.open(path, os.O_RDONLY)

    def check_unchanged(self, name: str) -> None:
        """Raise `SourceChangedError` when `name` is no longer the file first read (a local file written or replaced
        since); an object store checks each read instead."""

    def open(self, name: str):
        """A file object for sequential reads of `name` (`readinto`, `seek`, `tell`, `close`)."""
        from ._range_file import RangeFile

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


def _refuse_irregular(path: Path, name: str, mode: int) -> None:
    """Refuse a FIFO, a device, a socket or a folder where a file is read; the error's `kind` names which."""
    if kind := _kind_of(mode):
        error = CheckpointError(f"{name}: {kind}, not a regular file; reshard reads only regular files from a "
                                "checkpoint. Replace it with the real file. Nothing was read or changed.",
                                path=str(path))
        error.kind = kind
        raise error


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What makes a file the same file: device, inode, size, modification and change time (ns). The change time
    moves on every write and cannot be set back, so a file rewritten in place whose mtime was put back is caught."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def changed(where: str, what: str) -> SourceChangedError:
    return SourceChangedError(f"{where}: the source changed while it was read ({what}). Run the command again once "
                              "nothing writes to the source. Nothing was kept.", path=where)


def _resolved(path: Path, name: str) -> Path:
    """`path` with every link followed; a link that loops is refused by name (not a RuntimeError traceback)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # "Symlink loop from ..." (Python <= 3.12), ELOOP (3.13)
        raise CheckpointError(f"{name}: a link that loops ({path} leads back to itself); "
                              "reshard reads only links that end at a regular file. Replace it with the file it "
                              "should be. Nothing was read or changed.", path=str(path)) from None


def _stat_of(path: Path, name: str) -> os.stat_result:
    """`os.stat(path)`; a link that loops is refused by name."""
    try:
        return os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            _resolved(path, name)  # raises the refusal, naming the loop
        raise


def _open_regular(path: Path, name: str):
    """Open `path` (`name` in messages) for reading, unbuffered, only if it is a regular file; the open cannot block
    (O_NONBLOCK, then fstat refuses a FIFO swapped in after the check)."""
    _refuse_irregular(path, name, _stat_of(path, name).st_mode)

    def opener(file, flags: int) -> int:
        fd = os.open(file, flags | os.O_NONBLOCK)
        try:
            _refuse_irregular(path, name, os.fstat(fd).st_mode)
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
        link_root: a link must resolve inside `root` or inside this folder (default: `root`; for a cache snapshot its
            repo's `blobs/`, never its `refs/`).
        links_anywhere: follow links wherever they point (a folder the user assembled, such as a node's staged copy
            of a reshard folder, whose manifest says what each file must hold); the target must still be a regular
            file, and the files a write copies as they are must still be inside (`check_inside`).
        cache_repo: for a Hugging Face cache snapshot, the repo's cache folder: links are followed into its `blobs/`.
    """

    def __init__(self, root: Path, *, link_root: Path | None = None, links_anywhere: bool = False,
                 cache_repo: Path | None = None):
        self.root = Path(root)
        self.location = str(self.root)
        self.remote = False
        self.link_root = Path(link_root or (Path(cache_repo) / "blobs" if cache_repo is not None else root))
        self.links_anywhere = links_anywhere
        self.cache_repo = cache_repo
        self._inside: set[str] = set()  # names whose links were checked
        # each file's identity when first seen (its header read): every later open, in this process or a worker,
        # and the engine after each output file, compare with it (`check_unchanged`); travels with the store
        self._seen: dict[str, tuple[int, int, int, int, int]] = {}
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
        target = _resolved(path, name)
        if not any(target.is_relative_to(folder.resolve()) for folder in (self.root, self.link_root)):
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
        mode = _stat_of(path, name)
        _refuse_irregular(path, name, mode.st_mode)
        self._seen.setdefault(name, _identity(mode))  # the file a header read then opens must be this one
        return mode.st_size

    def _pin(self, name: str, st: os.stat_result) -> None:
        """Remember `name`'s identity when first seen; refuse another file under its name later."""
        seen = self._seen.setdefault(name, _identity(st))
        if seen != _identity(st):
            raise changed(self.url(name), _difference(seen, _identity(st)))

    def check_unchanged(self, name: str) -> None:
        seen = self._seen.get(name)
        if seen is None:
            return
        fd = self._fds.get(name)
        try:
            now = _identity(os.fstat(fd) if fd is not None else os.stat(self.root / name))
            at_path = _identity(os.stat(self.root / name))
        except FileNotFoundError:
            raise changed(self.url(name), "it was removed") from None
        for found in (at_path, now):  # the name first: a file renamed over also moves the old one's change time
            if found != seen:
                raise changed(self.url(name), _difference(seen, found))

    def local_path(self, name: str) -> Path | None:
        path = self.path(name)
        _refuse_irregular(path, name, _stat_of(path, name).st_mode)
        return path

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                with _open_regular(self.path(name), name) as f:
                    self._pin(name, os.fstat(f.fileno()))
                    fd = self._fds[name] = os.dup(f.fileno())
            return fd

    def descriptor(self, name: str) -> int:
        return os.dup(self._fd(name))

    def readinto(self, name: str, start: int, view: memoryview) -> None:
        done = pread_full(self._fd(name), view, start)
        if done < len(view):
            raise CheckpointError(f"{self.url(name)}: the file ends at byte {start + done}, before the "
                                  f"{start + len(view)} its header says; it is truncated or changed. Copy it "
                                  "again. Nothing was kept.", path=self.url(name))

    def open(self, name: str):
        f = _open_regular(self.path(name), name)
        try:
            self._pin(name, os.fstat(f.fileno()))
        except BaseException:
            f.close()
            raise
        return f

    def close(self) -> None:
        with self._lock:
            _close_all(self._fds)


def _difference(seen: tuple, found: tuple) -> str:
    if seen[:2] != found[:2]:
        return "another file now has its name: replaced, as by `mv` or a new download"
    if seen[2] != found[2]:
        return f"its size went from {seen[2]} to {found[2]} bytes"
    if seen[3] != found[3]:
        return "it was written to since its header was read"
    return "it was written to since its header was read (its change time moved, though its modification time did not)"


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
