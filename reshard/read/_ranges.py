"""Many byte ranges of a source read in few requests: `Store.read_ranges`.

A reader of many ranges (an output file of a remote source needs thousands, one per expert row block) asks for them
all at once. Sorted by source offset, the ranges that lie close together (gaps of at most `GAP` bytes and a quarter of
the bytes the request serves, or of `MIN_GAP`) are read in one request of at most `RANGE` bytes; a range longer than
that is read in pieces. A store that pays for each request (an object store, a peer node) keeps `Store.in_flight`
requests going while the caller uses the bytes of the one that arrived, each read straight into a buffer kept for
the next: memory holds `in_flight + 1` requests, never a tensor. A local folder reads them one after another.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from ._range_file import RANGE

GAP = 1 << 20  # bytes of a gap read and dropped rather than paid as another request (a request costs ~ms)
MIN_GAP = 64 << 10  # a gap this small is always read: next to a request's latency its bytes cost nothing


@dataclass(frozen=True)
class ByteRange:
    """Bytes `[start, start + length)` of source file `name`."""

    name: str
    start: int
    length: int


class Piece(NamedTuple):
    """Bytes of range number `index` of those asked, from `offset` into it (a range longer than one request arrives in
    several pieces); `data` is valid only while the caller's `deliver` runs; `digest` is `each(data)`, computed on the
    thread the bytes arrived on (None without `each`)."""

    index: int
    offset: int
    data: memoryview
    digest: object


@dataclass(frozen=True)
class _Request:
    """One request: `[start, start + length)` of `name`, and the pieces it serves, `(index, offset, at, length)`
    each, `at` the piece's first byte in the source file (sorted by it)."""

    name: str
    start: int
    length: int
    pieces: tuple[tuple[int, int, int, int], ...]


def requests(ranges: Sequence[ByteRange], *, gap: int = GAP, block: int | None = None) -> list[_Request]:
    """The requests that serve `ranges`: per file, in source order, neighbours joined across a gap of at most `gap`
    bytes and a quarter of the bytes served so far, while the request stays within `block` bytes (default `RANGE`); a
    range longer than `block` is served in pieces of `block` bytes, an empty one by none."""
    block = RANGE if block is None else block
    pieces = [(r.name, r.start + o, i, o, min(block, r.length - o))
              for i, r in enumerate(ranges) for o in range(0, r.length, block)]
    out: list[_Request] = []
    current: list[tuple[str, int, int, int, int]] = []
    useful = 0
    for piece in sorted(pieces, key=lambda p: (p[0], p[1])):
        name, at, _, _, length = piece
        if current:
            first, end = current[0], max(p[1] + p[4] for p in current)
            # a gap is read while it stays small next to what the request serves (at most a fifth wasted), or tiny
            if name != first[0] or at - end > max(MIN_GAP, min(gap, useful // 4)) or at + length - first[1] > block:
                out.append(_request(current))
                current, useful = [], 0
        current.append(piece)
        useful += length
    if current:
        out.append(_request(current))
    return out


def _request(pieces: list[tuple[str, int, int, int, int]]) -> _Request:
    start = pieces[0][1]
    return _Request(pieces[0][0], start, max(p[1] + p[4] for p in pieces) - start,
                    tuple((i, o, at, length) for _, at, i, o, length in pieces))


def read_ranges(store, ranges: Sequence[ByteRange], deliver: Callable[[Piece], None], *, in_flight: int,
                buffers: list[bytearray] | None, each: Callable[[memoryview], object] | None) -> None:
    """`Store.read_ranges` (its documentation says what), `in_flight` requests ahead of the one delivered."""
    todo = requests(ranges)
    if not todo:
        return
    buffers = [] if buffers is None else buffers
    slots = min(len(todo), in_flight + 1)
    views = [_buffer(buffers, slot, max(r.length for r in todo[slot::slots])) for slot in range(slots)]

    def fetched(request: _Request, view: memoryview) -> list:  # on a fetch thread when in flight: `each` there too
        store.readinto(request.name, request.start, view)
        if each is None:
            return [None] * len(request.pieces)
        return [each(view[at - request.start:at - request.start + length]) for _, _, at, length in request.pieces]

    def handed(request: _Request, view: memoryview, digests: list) -> None:
        for (i, offset, at, length), digest in zip(request.pieces, digests):
            deliver(Piece(i, offset, view[at - request.start:at - request.start + length], digest))

    if in_flight == 0:
        for request in todo:
            view = views[0][:request.length]
            handed(request, view, fetched(request, view))
        return
    pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="reshard-fetch")

    def fetch(i: int):
        return pool.submit(fetched, todo[i], views[i % slots][:todo[i].length])

    try:
        pending = [fetch(i) for i in range(min(in_flight, len(todo)))]
        for i, request in enumerate(todo):
            digests = pending[i].result()
            pending[i] = None
            if i + in_flight < len(todo):  # into the buffer of request i - 1, delivered already
                pending.append(fetch(i + in_flight))
            handed(request, views[i % slots][:request.length], digests)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failure leaves nothing running


def _buffer(buffers: list[bytearray], slot: int, nbytes: int) -> memoryview:
    """Buffer `slot` of the caller's, of at least `nbytes`: kept from call to call, so its pages fault in once."""
    while len(buffers) <= slot:
        buffers.append(bytearray(0))
    if len(buffers[slot]) < nbytes:
        buffers[slot] = bytearray(nbytes)
    return memoryview(buffers[slot])
