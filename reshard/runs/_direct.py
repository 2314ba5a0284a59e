"""Large output files written around the page cache (`O_DIRECT`), in aligned blocks, while the next block is read.

A buffered write makes the kernel allocate, fill and later write back one page-cache page per 4 KiB; at several GB
that costs as much CPU as reading the source and computing its CRC-32, and the dirty pages throttle the writer. A
direct write hands each block to the disk from our own buffer: the CPU only reads the source into the buffer and
computes the CRC-32 there. Measured on ext4 with 2 cores, a 7.76 GB merge: 6.1-11.7 s of system time through the
page cache, 1.7 s direct. The engine takes this path only for a job larger than the page cache's room for dirty
pages (the engine decides, from its `planned_bytes`): a smaller one is faster through it.

The engine (`reshard.runs._engine`) reads the source into the current block through `space`/`advance`; a full block
goes to one of `_WRITERS` threads, which computes its CRC-32s and writes it (zlib and pwrite release the GIL: the
CRC-32s use both cores, and the disk has several requests at once), while the engine reads the next block into
another of the `WRITERS + 1` buffers. The last block is padded with zeros to the alignment and the file cut back to
its size. Where the file system refuses direct I/O (tmpfs, some FUSE and network file systems), `DirectOutput.start`
returns None and the caller copies through the page cache; a direct write refused later (`EINVAL`: an alignment the
device does not take) turns the rest of that file's writes into buffered ones.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

BLOCK_BYTES = 8 << 20  # a multiple of ALIGN; 8 and 16 MiB measured alike: 8 MiB x (WRITERS + 1) is 40 MiB of RAM
ALIGN = 4096  # offsets, lengths and buffer addresses of direct writes: a page, which covers 512 B and 4 KiB sectors
MIN_FILE_BYTES = 64 << 20  # smaller files stay in the page cache: their cost is the file, not its bytes
_WRITERS = 4  # direct writes in flight at once: a 7.76 GB merge took 6.7-7.0 s with 4, 7.2-7.9 s with 2


class BlockRing:
    """The page-aligned buffers (anonymous maps) and the writer threads an engine's direct outputs share."""

    def __init__(self):
        self.maps = [mmap.mmap(-1, BLOCK_BYTES) for _ in range(_WRITERS + 1)]
        self.views = [memoryview(m) for m in self.maps]
        self.pool = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="reshard-write")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for view in self.views:
            view.release()
        for block in self.maps:
            try:
                block.close()
            except BufferError:  # a slice is still held (by an error's traceback): freed with it
                pass


class DirectOutput:
    """One output file filled front to back through a `BlockRing`, its full blocks written directly to disk.

    Each stretch of bytes filled is given a `tag` (the caller's: where the bytes came from). A full block's
    `(start, nbytes, tag)` stretches go with it to a writer thread, where `digest(block, stretches)` runs on the bytes
    before they are written (the CRC-32s: so they use both cores while the next block is read); its results come
    back to `collect`, on the filling thread, in the file's order.
    """

    def __init__(self, fd: int, ring: BlockRing, flags: int, digest, collect):
        self.fd, self.ring, self.flags = fd, ring, flags
        self.digest, self.collect = digest, collect
        self.direct = True
        self.free = list(ring.views)
        self.in_flight: collections.deque = collections.deque()  # (future, buffer), oldest first
        self.view = self.free.pop()
        self.filled = 0  # bytes of the current block filled
        self.stretches: list[tuple[int, int, object]] = []  # (start in the block, nbytes, tag)
        self.offset = 0  # where the current block starts in the file

    @classmethod
    def start(cls, fd: int, ring: BlockRing, digest, collect) -> DirectOutput | None:
        """Switch `fd` (opened for writing, nothing written yet) to direct I/O; None where the file system refuses."""
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except (OSError, AttributeError):  # AttributeError: a platform without O_DIRECT
            return None
        return cls(fd, ring, flags, digest, collect)

    def space(self) -> memoryview:
        """The free part of the current block: fill a prefix of it, then `advance` by its length."""
        return self.view[self.filled:]

    def advance(self, nbytes: int, tag) -> None:
        self.stretches.append((self.filled, nbytes, tag))
        self.filled += nbytes
        if self.filled == len(self.view):
            self._send(self.filled)

    def put(self, data: bytes, tag) -> None:
        """Append `data` (a header: small)."""
        data = memoryview(data)
        while data:
            space = self.space()
            n = min(len(space), len(data))
            space[:n] = data[:n]
            self.advance(n, tag)
            data = data[n:]

    def finish(self, size: int) -> None:
        """Write the last block, wait for every write, cut the padding off (`size`: the file's length) and put the
        file back to buffered I/O. Raises the first error of a digest or a write."""
        if self.filled:
            padded = -(-self.filled // ALIGN) * ALIGN
            self.view[self.filled:padded] = bytes(padded - self.filled)
            self._send(padded)
        try:
            while self.in_flight:
                self._collect_oldest()
        finally:
            self.abort()
        if self.offset != size:
            os.ftruncate(self.fd, size)

    def abort(self) -> None:
        """Wait for the writes in flight (the file must not be closed under them), errors ignored: the caller is
        already failing."""
        while self.in_flight:
            self.in_flight.popleft()[0].exception()
        self._buffered()

    def _send(self, nbytes: int) -> None:
        future = self.ring.pool.submit(self._write, self.view, nbytes, self.offset, self.stretches)
        self.in_flight.append((future, self.view))
        self.offset += nbytes
        if not self.free:  # every buffer is in flight: the oldest is written first, then refilled
            self._collect_oldest()
        self.view, self.filled, self.stretches = self.free.pop(), 0, []

    def _collect_oldest(self) -> None:
        future, buffer = self.in_flight.popleft()
        self.free.append(buffer)
        self.collect(future.result())

    def _write(self, view: memoryview, nbytes: int, offset: int, stretches: list):
        digested = self.digest(view, stretches)
        done = 0
        while done < nbytes:
            try:
                done += os.pwrite(self.fd, view[done:nbytes], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._buffered()  # the device refuses this alignment: the page cache takes the rest of the file
        return digested

    def _buffered(self) -> None:
        if self.direct:
            self.direct = False
            fcntl.fcntl(self.fd, fcntl.F_SETFL, self.flags)
