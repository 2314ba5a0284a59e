"""Check the CRC-32 of each source file a write or merge reads against the one its manifest records.

A reshard folder's manifest records one CRC-32 per whole file. A mesh-to-mesh `write` or a `merge` from it copies
byte runs with the kernel (`copy_file_range`), so those bytes never pass through the process; without a check, a
flipped bit in a source file would be copied and stamped with a fresh, valid CRC in the output. So every source
file a writer opens is read once more, whole, through one reused buffer, on a background thread while the copy
runs (`zlib.crc32` releases the GIL: the check uses the second core), and the write fails before anything is kept
when a file's CRC-32 differs. A file no writer opens gives no byte to the output, so it is not read.

A folder saved by `save_pretrained(..., distributed_checkpoint=True)` records no CRC: nothing to check against
(`SourceCheck(None, ...)` checks nothing; the commands say that the bytes were not checked).
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import CheckpointError

CHECK_BUFFER_BYTES = 1 << 20  # one reused 1 MiB buffer: a fresh block per read costs page faults


class SourceCheck:
    """CRC-32 of whole source files, each once, on one background thread, against `expected`.

    Args:
        expected: file name -> the 8-hex-digit CRC-32 its manifest records; None (or a file it does not name): that
            file is not checked.
        path_of: file name -> its path.
        where: the source folder, for messages.
    """

    def __init__(self, expected: dict[str, str] | None, path_of, where: str):
        self.expected = expected or {}
        self.path_of = path_of
        self.where = where
        self.failure: str | None = None  # set by the background thread at the first mismatch
        self._jobs: dict[str, Future] = {}
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None

    def start(self, file: str) -> None:
        """Queue `file` for checking (once; a file without a recorded CRC is skipped)."""
        if file in self._jobs or file not in self.expected:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-source-crc")
        self._jobs[file] = self._pool.submit(self._check, file)

    def raise_if_failed(self) -> None:
        """Raise at once if a checked file already failed (the copy calls this between blocks)."""
        if self.failure is not None:
            raise CheckpointError(self.failure, path=self.where)

    def finish(self) -> list[str]:
        """Wait for every queued check; the files checked, in queue order.

        Raises:
            CheckpointError: a file's CRC-32 differs from its manifest's, or it cannot be read; naming the file.
        """
        for job in self._jobs.values():
            job.result()
        self.raise_if_failed()
        return list(self._jobs)

    def close(self) -> None:
        """Stop the background thread (a check in progress stops at its next block)."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _check(self, file: str) -> None:
        path = self.path_of(file)
        crc, buffer = 0, bytearray(CHECK_BUFFER_BYTES)
        view = memoryview(buffer)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            self._fail(f"{path}: cannot be read to check its CRC-32 ({e.strerror or e}); nothing was kept.")
            return
        try:
            while not self._stop.is_set():
                got = os.readv(fd, [view])
                if got <= 0:
                    break
                crc = zlib.crc32(view[:got], crc)
        finally:
            os.close(fd)
        if self._stop.is_set():
            return
        found, wanted = f"{crc:08x}", self.expected[file]
        if found != wanted:
            self._fail(f"{path}: CRC-32 {found}, but reshard.json records {wanted}: the file is damaged (its bytes "
                       "changed after it was written). Nothing was kept: copying it would stamp the damage with a "
                       "fresh CRC. Copy the file again from a good copy, or write the folder again from its source.")

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
