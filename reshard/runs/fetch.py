"""Filling an output file from a remote source: its byte runs grouped into few, large ranged requests.

A run is a stretch contiguous in the source and in the output (`reshard.runs.byte_runs`); an output file of a
remote source may need thousands, one per expert row block. Sorted by source offset, the runs of one file that lie
close together (gaps of at most `GAP` bytes and a quarter of the bytes the request serves, or of `MIN_GAP`) are
fetched in one request of at most `READ_BLOCK` bytes, `PREFETCH` at once, and written where each belongs. Memory
holds the requests in flight, never a tensor. The output CRC-32 is combined from each run's own CRC-32 in output
order (`crc32_combine`), since the runs arrive in source order; the same CRC-32s are the ranges a reshard folder's
files are checked with (`reshard.runs.source_check`).
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..read.store import READ_BLOCK
from ..syscalls import Writeback
from .byte_runs import Run
from .crc import crc32_combine

GAP = 1 << 20  # bytes of a gap read and dropped rather than paid as another request (a request costs ~ms)
MIN_GAP = 64 << 10  # a gap this small is always read: next to a request's latency its bytes cost nothing
PREFETCH = 4  # requests in flight: S3 serves parallel streams faster than one


@dataclass(frozen=True)
class Span:
    """One ranged request: `[start, start + length)` of `file`, and the runs it serves (sorted by source offset)."""

    file: str
    start: int
    length: int
    runs: tuple[Run, ...]


def spans(runs: list[Run], *, gap: int = GAP, block: int = READ_BLOCK) -> list[Span]:
    """The requests that serve `runs`: per file, in source order, neighbours joined across a gap of at most `gap`
    bytes and a quarter of the bytes served so far, while the request stays within `block` bytes; a run longer than
    `block` is served in pieces of `block` bytes."""
    pieces = [Run(r.file, r.src + o, r.dst + o, min(block, r.nbytes - o)) for r in runs
              for o in range(0, r.nbytes, block)]
    out: list[Span] = []
    current: list[Run] = []
    useful = 0
    for run in sorted(pieces, key=lambda r: (r.file, r.src)):
        if current:
            first, end = current[0], max(r.src + r.nbytes for r in current)
            # a gap is read while it stays small next to what the request serves (at most a fifth wasted), or tiny
            if (run.file != first.file or run.src - end > max(MIN_GAP, min(gap, useful // 4))
                    or run.src + run.nbytes - first.src > block):
                out.append(_span(current))
                current, useful = [], 0
        current.append(run)
        useful += run.nbytes
    if current:
        out.append(_span(current))
    return out


def _span(runs: list[Run]) -> Span:
    start = runs[0].src
    return Span(runs[0].file, start, max(r.src + r.nbytes for r in runs) - start, tuple(runs))


def fill_fetched(engine, out_fd: int, header: bytes, runs: list[Run]) -> int:
    """Write `header` and the bytes of `runs` into `out_fd`, fetched through the engine's store; the file's CRC-32.
    Each run's CRC-32 is recorded for a checked source file (`engine.source_crcs`)."""
    store, crcs = engine.index.store, {}
    _pwrite_all(out_fd, header, 0)
    requests = spans(runs)
    writeback = Writeback(out_fd)
    with ThreadPoolExecutor(max_workers=PREFETCH, thread_name_prefix="reshard-fetch") as pool:
        pending = [pool.submit(store.read, span.file, span.start, span.length) for span in requests[:PREFETCH]]
        for i, span in enumerate(requests):
            data = memoryview(pending[i].result())
            pending[i] = None  # the request's bytes are freed once written
            if i + PREFETCH < len(requests):
                nxt = requests[i + PREFETCH]
                pending.append(pool.submit(store.read, nxt.file, nxt.start, nxt.length))
            for run in span.runs:
                piece = data[run.src - span.start:run.src - span.start + run.nbytes]
                _pwrite_all(out_fd, piece, run.dst)
                writeback.wrote(run.nbytes)
                crcs[run.dst] = (zlib.crc32(piece), run.nbytes)
                _remember(engine.source_crcs.segments(run.file), run, piece)
                if engine.progress is not None:
                    engine.progress.update(run.nbytes)
    crc = zlib.crc32(header)
    for dst in sorted(crcs):  # the runs tile the file's data: combined in file order
        crc = crc32_combine(crc, *crcs[dst])
    return crc


def _remember(known, run: Run, piece) -> None:
    """Record the CRC-32 of the ranges of `run` a checked source file has not had yet (a range read again, a
    replicated tensor in several files, is kept once)."""
    if known is None:
        return
    for start, end, seen in known.split(run.src, run.src + run.nbytes):
        if not seen:
            known.add(start, end, zlib.crc32(piece[start - run.src:end - run.src]))


def _pwrite_all(fd: int, data, position: int) -> None:
    data, done = memoryview(data).cast("B"), 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)
