"""Check the source files a write or merge reads against the CRC-32s their manifest records, from the bytes read anyway.

A reshard folder's manifest records one CRC-32 per whole file. A mesh-to-mesh `write` or a `merge` from it copies
byte runs with the kernel (`copy_file_range`), so those bytes never pass through the process; without a check, a
flipped bit in a source file would be copied and stamped with a fresh, valid CRC in the output. Reading each file
whole once more to check it doubled the time of a merge, so the engine's one background read of the copied runs (the
read that computes the output's CRC-32, `reshard.runs._engine`) also keeps the CRC-32 of each source range it reads
(`reshard.runs._crc.Segments`). Each writer (this process, a `--workers` process, a rank of a torchrun job) reports its
ranges; the process that completes the output combines them per file, reads only the bytes no writer read (a header,
mostly) and refuses the output when a file's CRC-32 differs. So damage is found at the end of the write, not at the
next copied block, but still before the output is put in place: nothing is kept. A file no writer read gives no byte
to the output and is not read.

A folder saved by `save_pretrained(..., distributed_checkpoint=True)` records no CRC: nothing is recorded or checked
(the commands say that the bytes were not checked).
"""

from __future__ import annotations

import zlib

from ..errors import CheckpointError
from ..read import READ_BLOCK
from ._crc import Disagreement, Segments, whole_file_crc

_CHECK_BUFFER_BYTES = 1 << 20  # one reused 1 MiB buffer for the bytes no writer read


class SourceCrcs:
    """The CRC-32s of the source ranges the writers of one output read, by file, and their check.

    Args:
        index: the source; a reshard folder's `crc32` names each file's CRC-32. Files it does not name (every file
            of a saved folder, or of the checkpoint `--extras-from` names) are neither recorded nor checked.
    """

    def __init__(self, index):
        self.expected: dict[str, str] = getattr(index, "crc32", None) or {}
        self.index = index
        self.mine: dict[str, Segments] = {}
        self.others: dict[str, list] = {}  # file -> the ranges of each other writer that reported some

    def checks(self, file: str) -> bool:
        """Whether `file` has a CRC-32 to check against (its ranges read are recorded)."""
        return file in self.expected

    def segments(self, file: str) -> Segments | None:
        """This writer's known ranges of `file`, to add to; None when `file` has no CRC-32 to check against."""
        if file not in self.expected:
            return None
        if file not in self.mine:
            self.mine[file] = Segments()
        return self.mine[file]

    def report(self) -> dict[str, list[tuple[int, int, int]]]:
        """This writer's ranges, `(offset, length, crc)` by file, for the process that checks (small: adjacent
        ranges are coalesced, a file read in order is one range)."""
        return {file: segments.items() for file, segments in self.mine.items()}

    def add_report(self, report: dict[str, list]) -> None:
        """Another writer's ranges (its `report`)."""
        for file, ranges in report.items():
            self.others.setdefault(file, []).append(ranges)

    def check(self) -> list[str]:
        """Check every file any writer read, reading only what no writer read; returns the files checked.

        Raises:
            CheckpointError: a file's CRC-32 differs from its manifest's, two reads of its bytes differ, or it cannot
                be read; naming the file.
        """
        files = sorted(self.mine.keys() | self.others.keys())
        for file in files:
            reported = [self.mine[file].items()] if file in self.mine else []
            self._check(file, reported + self.others.get(file, []))
        return files

    def _check(self, file: str, reported: list) -> None:
        store = self.index.store
        where = store.url(file)
        try:
            size = store.size(file)
        except OSError as e:
            raise CheckpointError(f"{where}: cannot be read to check its CRC-32 ({e.strerror or e}); nothing was "
                                  "kept.", path=where) from e
        try:
            found = whole_file_crc(reported, size, _reader(store, file))
        except Disagreement as e:
            raise CheckpointError(f"{where}: {e}: the file changed during the write, or the nodes of a torchrun job "
                                  "hold copies of it that differ. Nothing was kept. Make every copy whole and the "
                                  "same, then run the command again.", path=where) from e
        wanted = self.expected[file]
        if f"{found:08x}" != wanted:
            raise CheckpointError(f"{where}: CRC-32 {found:08x}, but reshard.json records {wanted}: the file is "
                                  "damaged (its bytes changed after it was written). Nothing was kept: copying it "
                                  "would stamp the damage with a fresh CRC. Copy the file again from a good copy, or "
                                  "write the folder again from its source.", path=where)


def _reader(store, file: str):
    """`(offset, length) -> CRC-32` of `file`'s bytes there, read through its store a buffer at a time (a request
    at a time from a remote one)."""
    view = memoryview(bytearray(READ_BLOCK if store.remote else _CHECK_BUFFER_BYTES))

    def read_crc(offset: int, length: int) -> int:
        crc, done = 0, 0
        while done < length:
            n = min(length - done, len(view))
            store.readinto(file, offset + done, view[:n])
            crc = zlib.crc32(view[:n], crc)
            done += n
        return crc

    return read_crc
