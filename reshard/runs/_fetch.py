"""Filling output files from a remote source: their byte runs read through the store's `read_ranges`.

A run is a stretch contiguous in the source and in the output (`reshard.runs._byte_runs`); an output file of a
remote source may need thousands, one per expert row block. The output files of one job are filled together, so a
source range that several of them share (the rows of one expert tensor, split over the FSDP ranks) is requested once
and its pieces written into each file: the store reads the source front to back in few large requests
(`reshard.read.Store.read_ranges`), as a plain sequential download would, not once per output file in small pieces.
The output CRC-32 is combined from each run's own CRC-32 in output order (`crc32_combine`), since the runs arrive in
source order; the same CRC-32s are the ranges a reshard folder's files are checked with (`reshard.runs._source_check`).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import replace

from ..read import ByteRange, Piece
from ..syscalls import Writeback
from ._byte_runs import Run
from ._crc import crc32_combine


def fill_fetched(engine, outputs: list[tuple[int, bytes, list[Run]]]) -> list[int]:
    """Write each output's header and the bytes of its runs into its descriptor, `(fd, header, runs)` each, read
    through the engine's store; the files' CRC-32s. Each run's CRC-32 is recorded for a checked source file
    (`engine.source_crcs`).

    The runs of all the outputs are asked for together (`Store.read_ranges`), so a range several outputs need is
    fetched once; each piece's CRC-32 is computed on the thread its bytes arrived on, while this one writes. The
    store's buffers are the engine's, kept from call to call."""
    runs: list[tuple[int, Run]] = []
    for out, (fd, header, placed) in enumerate(outputs):
        _pwrite_all(fd, header, 0)
        runs += [(out, run) for run in placed]
    crcs: list[dict[int, tuple[int, int]]] = [{} for _ in outputs]
    writebacks = [Writeback(fd) for fd, _, _ in outputs]

    def write(piece: Piece) -> None:
        out, whole = runs[piece.index]
        run = whole if len(piece.data) == whole.nbytes else replace(
            whole, src=whole.src + piece.offset, dst=whole.dst + piece.offset, nbytes=len(piece.data))
        _pwrite_all(outputs[out][0], piece.data, run.dst)
        writebacks[out].wrote(run.nbytes)
        crcs[out][run.dst] = (piece.digest, run.nbytes)
        remember(engine.source_crcs.segments(run.file), run, piece.data, piece.digest)
        if engine.progress is not None:
            engine.progress.update(run.nbytes)

    engine.index.store.read_ranges([ByteRange(run.file, run.src, run.nbytes) for _, run in runs], write,
                                   buffers=engine.fetch_buffers, each=zlib.crc32)
    return [_file_crc(header, pieces) for (_, header, _), pieces in zip(outputs, crcs)]


def _file_crc(header: bytes, pieces: dict[int, tuple[int, int]]) -> int:
    """The CRC-32 of a file of `header` and the runs whose `(crc, nbytes)` are keyed by file offset: the runs tile
    the file's data, so they are combined in file order."""
    crc = zlib.crc32(header)
    for dst in sorted(pieces):
        crc = crc32_combine(crc, *pieces[dst])
    return crc


def remember(known, run: Run, piece, crc: int) -> None:
    """Record the CRC-32 of the ranges of `run` a checked source file has not had yet (a range read again, a
    replicated tensor in several files, is kept once); `crc` is the whole run's."""
    if known is None:
        return
    for start, end, seen in known.split(run.src, run.src + run.nbytes):
        if not seen:
            whole = start == run.src and end == run.src + run.nbytes
            known.add(start, end, crc if whole else zlib.crc32(piece[start - run.src:end - run.src]))


def _pwrite_all(fd: int, data, position: int) -> None:
    data, done = memoryview(data).cast("B"), 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)
