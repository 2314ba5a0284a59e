"""Filling output files from a remote source: their byte runs grouped into few, large ranged requests.

A run is a stretch contiguous in the source and in the output (`reshard.runs._byte_runs`); an output file of a
remote source may need thousands, one per expert row block. The output files of one job are filled together, so a
source range that several of them share (the rows of one expert tensor, split over the FSDP ranks) is requested once
and its pieces written into each file: the source is read front to back, as a plain sequential download would, not
once per output file in small pieces. Sorted by source offset, the runs that lie
close together (gaps of at most `_GAP` bytes and a quarter of the bytes the request serves, or of `_MIN_GAP`) are
fetched in one request of at most `RANGE` bytes, `DEPTH` in flight while one is written, each read into a buffer
kept for the next, and written where it belongs. Memory holds `DEPTH + 1` ranges, never a tensor. The output
CRC-32 is combined from each run's own CRC-32 in output order (`crc32_combine`), since the runs arrive in source
order; the same CRC-32s are the ranges a reshard folder's files are checked with (`reshard.runs._source_check`).
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..read import DEPTH, RANGE
from ..syscalls import Writeback
from ._byte_runs import Run
from ._crc import crc32_combine

_GAP = 1 << 20  # bytes of a gap read and dropped rather than paid as another request (a request costs ~ms)
_MIN_GAP = 64 << 10  # a gap this small is always read: next to a request's latency its bytes cost nothing


@dataclass(frozen=True)
class _OutputRun(Run):
    """A run of output file number `out` among the files filled together."""

    out: int = 0


@dataclass(frozen=True)
class _Span:
    """One ranged request: `[start, start + length)` of `file`, and the runs it serves (sorted by source offset)."""

    file: str
    start: int
    length: int
    runs: tuple[Run, ...]


def spans(runs: list[Run], *, gap: int = _GAP, block: int = RANGE) -> list[_Span]:
    """The requests that serve `runs`: per file, in source order, neighbours joined across a gap of at most `gap`
    bytes and a quarter of the bytes served so far, while the request stays within `block` bytes; a run longer than
    `block` is served in pieces of `block` bytes."""
    pieces = [r if r.nbytes <= block else replace(r, src=r.src + o, dst=r.dst + o, nbytes=min(block, r.nbytes - o))
              for r in runs for o in range(0, r.nbytes, block)]
    out: list[_Span] = []
    current: list[Run] = []
    useful = 0
    for run in sorted(pieces, key=lambda r: (r.file, r.src)):
        if current:
            first, end = current[0], max(r.src + r.nbytes for r in current)
            # a gap is read while it stays small next to what the request serves (at most a fifth wasted), or tiny
            if (run.file != first.file or run.src - end > max(_MIN_GAP, min(gap, useful // 4))
                    or run.src + run.nbytes - first.src > block):
                out.append(_span(current))
                current, useful = [], 0
        current.append(run)
        useful += run.nbytes
    if current:
        out.append(_span(current))
    return out


def _span(runs: list[Run]) -> _Span:
    start = runs[0].src
    return _Span(runs[0].file, start, max(r.src + r.nbytes for r in runs) - start, tuple(runs))


def fill_fetched(engine, outputs: list[tuple[int, bytes, list[Run]]]) -> list[int]:
    """Write each output's header and the bytes of its runs into its descriptor, `(fd, header, runs)` each, fetched
    through the engine's store; the files' CRC-32s. Each run's CRC-32 is recorded for a checked source file
    (`engine.source_crcs`).

    The runs of all the outputs are requested together in source order, so a range several outputs need is fetched
    once. While one request's bytes are written, the next `DEPTH` are in flight, each read straight into a buffer of
    its own (`Store.readinto`), where the fetching thread also computes its runs' CRC-32s; the buffers, `DEPTH + 1`
    of at most `RANGE` bytes, are the engine's, kept from call to call (their pages fault in once). A failure
    cancels the requests not started and waits for the others: nothing is left running."""
    store = engine.index.store
    tagged: list[_OutputRun] = []
    for out, (fd, header, runs) in enumerate(outputs):
        _pwrite_all(fd, header, 0)
        tagged += [_OutputRun(r.file, r.src, r.dst, r.nbytes, out) for r in runs]
    crcs: list[dict[int, tuple[int, int]]] = [{} for _ in outputs]
    writebacks = [Writeback(fd) for fd, _, _ in outputs]
    requests = spans(tagged, block=RANGE)
    slots = min(len(requests), DEPTH + 1)
    buffers = [_buffer(engine, slot, max(r.length for r in requests[slot::slots])) for slot in range(slots)]
    pool = ThreadPoolExecutor(max_workers=DEPTH, thread_name_prefix="reshard-fetch")

    def fetched(span: _Span, view: memoryview) -> list[int]:  # on a fetch thread: the runs' CRC-32s as well
        store.readinto(span.file, span.start, view)
        return [zlib.crc32(view[run.src - span.start:run.src - span.start + run.nbytes]) for run in span.runs]

    def fetch(i: int):
        span = requests[i]
        return pool.submit(fetched, span, buffers[i % slots][:span.length])

    try:
        pending = [fetch(i) for i in range(min(DEPTH, len(requests)))]
        for i, span in enumerate(requests):
            run_crcs = pending[i].result()
            pending[i] = None
            if i + DEPTH < len(requests):  # into the buffer of request i - 1, written already
                pending.append(fetch(i + DEPTH))
            data = buffers[i % slots]
            for run, crc in zip(span.runs, run_crcs):
                piece = data[run.src - span.start:run.src - span.start + run.nbytes]
                _pwrite_all(outputs[run.out][0], piece, run.dst)
                writebacks[run.out].wrote(run.nbytes)
                crcs[run.out][run.dst] = (crc, run.nbytes)
                remember(engine.source_crcs.segments(run.file), run, piece, crc)
                if engine.progress is not None:
                    engine.progress.update(run.nbytes)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [_file_crc(header, pieces) for (_, header, _), pieces in zip(outputs, crcs)]


def _file_crc(header: bytes, pieces: dict[int, tuple[int, int]]) -> int:
    """The CRC-32 of a file of `header` and the runs whose `(crc, nbytes)` are keyed by file offset: the runs tile
    the file's data, so they are combined in file order."""
    crc = zlib.crc32(header)
    for dst in sorted(pieces):
        crc = crc32_combine(crc, *pieces[dst])
    return crc


def _buffer(engine, slot: int, nbytes: int) -> memoryview:
    """The engine's fetch buffer `slot`, of at least `nbytes`."""
    buffers = engine.fetch_buffers
    while len(buffers) <= slot:
        buffers.append(bytearray(0))
    if len(buffers[slot]) < nbytes:
        buffers[slot] = bytearray(nbytes)
    return memoryview(buffers[slot])


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
