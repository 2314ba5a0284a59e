"""CRC-32 arithmetic, so that a source file's whole-file CRC-32 follows from the byte ranges the writers read anyway.

A reshard folder's manifest records one CRC-32 per whole file, but a writer reads byte runs, in output order, and
several writers may each read a part of one file. zlib's CRC-32 of a concatenation follows from the parts' CRC-32s
and the second part's length (`crc32_combine`, as zlib defines it; zlib's own C function is not exposed in Python).
So each run's CRC-32, computed once from the bytes the output's CRC job reads, gives both the output file's CRC-32 and
a known range of the source file's (`Segments`); the whole file's follows from its known ranges and the bytes between
them (`whole_file_crc`), which are all that is read again.

Appending n bytes multiplies a CRC by x^(8n) modulo zlib's polynomial, the product of x^(2^(k+3)) over the bits k
set in n. Each x^(2^k) is a linear map of the CRC's 32 bits, kept as four byte-indexed tables (built once, when first
needed: there are 32), so that moving a CRC past any length costs four lookups per bit set in it: microseconds,
where zlib's bit-serial products, written in Python, take about half a millisecond.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from array import array
from functools import lru_cache

_POLY = 0xEDB88320  # zlib's CRC-32 polynomial, reflected: bit 31 is x^0


def _times_x(b: int) -> int:
    return (b >> 1) ^ _POLY if b & 1 else b >> 1


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, both reflected (zlib's `multmodp`)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = _times_x(b)
    return p


def _x2n_table() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..31 (zlib's `x2n_table`; x^(2^(k+32)) = x^(2^k) for this polynomial)."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()


@lru_cache(maxsize=32)  # bounded: there are 32 of them
def _power_tables(k: int) -> tuple[array, array, array, array]:
    """The map crc -> crc * x^(2^k) as one table per byte of the CRC (`k` modulo 32)."""
    column, columns = _X2N[k % 32], [0] * 32
    for bit in range(31, -1, -1):  # bit 31 is x^0: its image is x^(2^k) itself; bit j-1's is bit j's times x
        columns[bit] = column
        column = _times_x(column)
    tables = []
    for byte in range(4):
        table = array("I", [0]) * 256
        for value in range(1, 256):
            low = value & -value
            table[value] = table[value ^ low] ^ columns[8 * byte + low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def crc32_shift(crc: int, nbytes: int) -> int:
    """The CRC-32 `crc` of some bytes, moved past `nbytes` more: `crc32_combine(crc, 0, nbytes)`.

    x^(8 * nbytes) is the product of x^(2^(k+3)) over the bits k set in `nbytes`: one table lookup per set bit."""
    while nbytes and crc:  # linear: 0 stays 0
        low = nbytes & -nbytes
        t0, t1, t2, t3 = _power_tables(low.bit_length() + 2)
        crc = t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]
        nbytes ^= low
    return crc


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's `crc32_combine`: the CRC-32 of A + B from `crc1` of A, `crc2` of B and B's length `len2`."""
    return crc32_shift(crc1, len2) ^ crc2


class Segments:
    """The byte ranges of one file whose CRC-32 is known: disjoint, sorted, adjacent ones coalesced.

    One writer's ranges: a range read again (a replicated tensor's bytes, in several output files) is not added
    twice; `split` tells which parts of a run are known already, so only the others are added.
    """

    def __init__(self):
        self.starts: list[int] = []
        self.spans: list[list[int]] = []  # [start, end, crc] per range, in the order of `starts`

    def split(self, start: int, end: int) -> list[tuple[int, int, bool]]:
        """`[start, end)` in pieces `(start, end, known)`, in order."""
        pieces, at, spans = [], start, self.spans
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while i < len(spans) and spans[i][0] < end:
            s, e, _ = spans[i]
            i += 1
            if e <= at:
                continue
            if s > at:
                pieces.append((at, s, False))
            pieces.append((max(s, at), min(e, end), True))
            at = min(e, end)
        if at < end:
            pieces.append((at, end, False))
        return pieces

    def extend(self, start: int, data) -> bool:
        """Know `data`'s bytes at `start` when they continue the last known range (extending its CRC-32 with
        `zlib.crc32`, no combining); False, and nothing done, when they do not."""
        if not self.spans or self.spans[-1][1] != start:
            return False
        last = self.spans[-1]
        last[1], last[2] = start + len(data), zlib.crc32(data, last[2])
        return True

    def add(self, start: int, end: int, crc: int) -> None:
        """Know `crc` for `[start, end)`, a range no known one overlaps (a piece `split` says is unknown)."""
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.spans[i - 1][1] == start:  # coalesce with the range before
            before = self.spans[i - 1]
            before[1], before[2] = end, crc32_combine(before[2], crc, end - start)
            i -= 1
        else:
            self.starts.insert(i, start)
            self.spans.insert(i, [start, end, crc])
        if i + 1 < len(self.spans) and self.spans[i + 1][0] == self.spans[i][1]:  # ... and with the one after
            span, after = self.spans[i], self.spans.pop(i + 1)
            del self.starts[i + 1]
            span[1], span[2] = after[1], crc32_combine(span[2], after[2], after[1] - after[0])

    def items(self) -> list[tuple[int, int, int]]:
        """`(offset, length, crc)` of every known range, in order."""
        return [(s, e - s, crc) for s, e, crc in self.spans]


class Disagreement(ValueError):
    """Two reads of the same bytes of a file gave different CRC-32s."""

    def __init__(self, offset: int, length: int):
        super().__init__(f"bytes {offset}-{offset + length - 1} read twice gave different CRC-32s")
        self.offset, self.length = offset, length


def whole_file_crc(reported, size: int, read_crc) -> int:
    """The CRC-32 of a file of `size` bytes from the ranges writers know, reading only what they do not give.

    Args:
        reported: each writer's `(offset, length, crc)` ranges (`Segments.items`) for this file; one writer's are
            disjoint, several writers' may overlap (each read a replicated tensor, or each its own copy of the file).
        size: the file's size.
        read_crc: `(offset, length) -> CRC-32` of the file's bytes there, for what no range gives: the gaps (a
            header, bytes no output uses), and where ranges overlap, the overlap.

    Raises:
        Disagreement: a range's bytes are not those another range (or the file) holds there.
    """
    crc, at, used = 0, 0, {}
    for offset, length, known in sorted((r for ranges in reported for r in ranges), key=lambda r: (r[0], -r[1])):
        end = offset + length
        if end <= at:  # read before, by another writer: the same bytes, or the file differs where they read
            seen = used.get((offset, length))
            if (seen if seen is not None else read_crc(offset, length)) != known:
                raise Disagreement(offset, length)
            continue
        if offset > at:
            crc = crc32_combine(crc, read_crc(at, offset - at), offset - at)
        if offset < at:  # overlaps the ranges before: the CRC-32 of its new part follows from the overlap's
            known ^= crc32_shift(read_crc(offset, at - offset), end - at)
        else:
            used[offset, length] = known
        crc, at = crc32_combine(crc, known, end - max(offset, at)), end
    if size > at:
        crc = crc32_combine(crc, read_crc(at, size - at), size - at)
    return crc


class BlockCrcs:
    """The CRC-32s of a file written in direct blocks: each block's, computed by the writer thread that writes it
    (`digest`), combined in the file's order on the filling thread (`collect`) into the file's `crc`. A stretch tagged
    `(segments, start)` is a checked source's bytes: its CRC-32 is also kept for that source range."""

    def __init__(self, checksum: bool, lock: threading.Lock):
        self.checksum, self.lock, self.crc = checksum, lock, 0

    def digest(self, block: memoryview, stretches: list) -> list:
        """`[nbytes, crc]` per piece of the block, in order: consecutive untagged stretches as one."""
        pieces, plain = [], None
        for start, nbytes, tag in stretches:
            data = block[start:start + nbytes]
            if tag is None:
                if self.checksum:
                    if plain is None:
                        plain = [0, 0]
                        pieces.append(plain)
                    plain[0], plain[1] = plain[0] + nbytes, zlib.crc32(data, plain[1])
                continue
            crc, plain = zlib.crc32(data), None
            with self.lock:
                _know_crc(tag[0], tag[1], data, crc)
            pieces.append([nbytes, crc])
        return pieces

    def collect(self, pieces: list) -> None:
        if self.checksum:
            for nbytes, crc in pieces:
                self.crc = crc32_combine(self.crc, crc, nbytes)


def _know_crc(segments: Segments, start: int, data: memoryview, crc: int) -> None:
    """Keep `crc`, the CRC-32 of `data`, a checked source's bytes from `start`, for the parts not yet known."""
    pieces = segments.split(start, start + len(data))
    if len(pieces) == 1 and not pieces[0][2]:
        segments.add(start, start + len(data), crc)
    else:  # a range read again (a replicated tensor, in several output files) is kept once
        for s, e, seen in pieces:
            if not seen:
                segments.add(s, e, zlib.crc32(data[s - start:e - start]))
