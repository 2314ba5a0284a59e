"""Linux calls Python's `os` does not wrap (fallocate, renameat2, syncfs, sync_file_range), reached through ctypes;
each is None where the platform or C library lacks it, and its callers fall back. Also the room the kernel leaves for
dirty pages before it throttles writers (/proc/vmstat), which decides how the engine writes a large file. And the one
loop that reads a byte range of a descriptor in full (`pread_full`), which every local read uses."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it
WRITEBACK_BYTES = 64 << 20  # an output file's pages are handed to the disk after each this many bytes written


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read `len(view)` bytes of `fd` from `offset` into `view`, in as many calls as the kernel needs; the bytes read,
    fewer only where the file ends first (the caller says what a short file means)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


@functools.lru_cache(maxsize=None)
def libc_function(name: str, *argtypes):
    """Linux C library's function `name` (errno kept, int result), or None: another platform, or a C library
    without it (renameat2 needs glibc 2.28)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int) -> None:
    """Have the kernel start writing `fd`'s dirty pages to disk now, without waiting: the disk then works while the
    rest of the file is still being copied, and the fsync that ends the output finds little left to do. A hint only:
    where it is missing or fails, nothing changes but the timing."""
    fn = libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


class Writeback:
    """Calls `start_writeback` on an output file each time another `WRITEBACK_BYTES` have been written to it."""

    def __init__(self, fd: int):
        self.fd, self.every, self.pending = fd, WRITEBACK_BYTES, 0

    def wrote(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            start_writeback(self.fd)
            self.pending = 0


def page_cache_room() -> int | None:
    """Bytes that can still be made dirty in the page cache before the kernel starts throttling writers (halfway
    between its background and its hard dirty thresholds, where Linux's dirty-page throttling begins), from
    /proc/vmstat; None where that is not readable (another platform)."""
    try:
        with open("/proc/vmstat") as f:
            return dirty_room(f.read())
    except (OSError, ValueError):
        return None


def dirty_room(vmstat: str) -> int | None:
    """`page_cache_room` from the text of /proc/vmstat."""
    counts = dict(line.split() for line in vmstat.splitlines() if line.count(" ") == 1)
    try:
        free_run = (int(counts["nr_dirty_threshold"]) + int(counts["nr_dirty_background_threshold"])) // 2
        dirty = int(counts["nr_dirty"]) + int(counts["nr_writeback"])
    except KeyError:
        return None
    return max(free_run - dirty, 0) * os.sysconf("SC_PAGE_SIZE")
