"""A source file's CRC-32 from the ranges writers read (reshard.runs._crc, reshard.runs._source_check).

The arithmetic is compared with `zlib.crc32` of the concatenated bytes (hypothesis); the whole-file CRC of ranges
several writers read is compared with the file's, and a bit flipped in any byte a writer or the checker used must
change it (or be refused as two reads that differ), while a flip in a byte nobody used must not. The commands then
check a reshard folder source from one read: the check itself reads only the files' headers, in one process and with
`--workers 2`, and the outputs are byte-identical either way.
"""

from __future__ import annotations

import filecmp
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard.runs._source_check as source_check
from reshard.api import merge_checkpoint, write_checkpoint
from reshard.plan import MeshSpec
from reshard.runs._crc import Disagreement, Segments, crc32_combine, crc32_shift, whole_file_crc

from conftest import examples, hang_guard

PROPERTY = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the arithmetic ----------------------------------------------------------------------------------------------

@settings(max_examples=examples(400), **PROPERTY)
@given(st.binary(max_size=3000), st.binary(max_size=3000), st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a, b, c):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    ab_c = crc32_combine(crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)), zlib.crc32(c), len(c))
    assert ab_c == zlib.crc32(a + b + c)
    assert crc32_shift(zlib.crc32(a), len(b)) ^ zlib.crc32(b) == zlib.crc32(a + b)


@settings(max_examples=30, **PROPERTY)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3 << 20))
def test_shift_is_appending_zeros_at_any_length(crc, n):
    zeros = bytes(n)
    assert crc32_shift(crc, n) == zlib.crc32(zeros, crc) ^ zlib.crc32(zeros)


@settings(max_examples=examples(200), **PROPERTY)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**70), st.integers(0, 2**70))
def test_shifts_of_huge_lengths_compose(crc, m, n):
    assert crc32_shift(crc32_shift(crc, m), n) == crc32_shift(crc, m + n)


# ---- one writer's ranges, and several writers' ------------------------------------------------------------------

def record(data: bytes, runs, small: bool = False) -> Segments:
    """What the engine's CRC job keeps for `runs` `(start, length)` read from `data`, in that order: as for large
    runs (the pieces `split` says are unknown, added), or as for small ones (first `extend`ing the last range)."""
    segments = Segments()
    for start, length in runs:
        end = min(start + length, len(data))
        if small and segments.extend(start, data[start:end]):
            continue
        for s, e, seen in segments.split(start, end):
            if not seen:
                segments.add(s, e, zlib.crc32(data[s:e]))
    return segments


def runs_in(size: int):
    return st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, size)), max_size=12)


@st.composite
def file_and_writers(draw):
    """(a file's bytes, each writer's runs and whether it records them as small runs)."""
    size = draw(st.integers(1, 600))
    data = draw(st.binary(min_size=size, max_size=size))
    return data, draw(st.lists(st.tuples(runs_in(size), st.booleans()), min_size=1, max_size=4))


def covered(runs, size: int) -> set[int]:
    return {i for start, length in runs for i in range(start, min(start + length, size))}


class Reader:
    """`read_crc` over `data`, remembering each byte it read."""

    def __init__(self, data: bytes):
        self.data, self.read = data, []

    def __call__(self, offset: int, length: int) -> int:
        self.read += range(offset, offset + length)
        return zlib.crc32(self.data[offset:offset + length])


@settings(max_examples=examples(300), **PROPERTY)
@given(file_and_writers())
def test_one_writers_ranges_are_disjoint_coalesced_and_exact(case):
    data, writers = case
    for runs, small in writers:
        items = record(data, runs, small).items()
        assert all(o + n < o2 for (o, n, _), (o2, _, _) in zip(items, items[1:])), "sorted, apart, coalesced"
        assert all(crc == zlib.crc32(data[o:o + n]) for o, n, crc in items)
        assert {i for o, n, _ in items for i in range(o, o + n)} == covered(runs, len(data))


@settings(max_examples=examples(300), **PROPERTY)
@given(file_and_writers())
def test_the_whole_file_crc_reads_only_what_no_writer_gives(case):
    data, writers = case
    reader = Reader(data)
    reported = [record(data, runs, small).items() for runs, small in writers]
    assert whole_file_crc(reported, len(data), reader) == zlib.crc32(data)
    union = covered([run for runs, _ in writers for run in runs], len(data))
    assert set(range(len(data))) - union <= set(reader.read)  # the gaps
    if len(writers) == 1:
        assert sorted(reader.read) == sorted(set(range(len(data))) - union)  # the gaps only, each once


@settings(max_examples=examples(400), **PROPERTY)
@given(file_and_writers(), st.data())
def test_a_flipped_bit_anywhere_used_is_found_and_nowhere_else(case, draw):
    """Each writer read its own copy (the ranks of a job on several nodes), the checker its own; one bit flipped in
    one of them must be found exactly when a byte of it was used: read by that writer, or by the checker."""
    data, writers = case
    who = draw.draw(st.integers(-1, len(writers) - 1), label="who (-1: the checker)")
    at = draw.draw(st.integers(0, len(data) - 1), label="byte")
    bit = draw.draw(st.integers(0, 7), label="bit")
    damaged = bytearray(data)
    damaged[at] ^= 1 << bit
    copies = [bytes(damaged) if w == who else data for w in range(len(writers))]
    reader = Reader(bytes(damaged) if who == -1 else data)
    try:
        found = whole_file_crc([record(copies[w], runs, small).items() for w, (runs, small) in enumerate(writers)],
                               len(data), reader)
    except Disagreement:
        found = None
    used = at in reader.read if who == -1 else at in covered(writers[who][0], len(data))
    assert (found != zlib.crc32(data)) == used


def test_two_writers_that_read_the_same_range_differently_disagree():
    data = bytes(range(200))
    other = bytearray(data)
    other[50] ^= 4
    reported = [record(data, [(40, 20)]).items(), record(bytes(other), [(40, 20)]).items()]
    with pytest.raises(Disagreement, match="bytes 40-59"):
        whole_file_crc(reported, len(data), Reader(data))


# ---- the commands: one read of each source byte -----------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tiny, tmp_path_factory):
    """(the source, a reshard folder of it at fsdp 3)."""
    src = tiny("qwen3_moe", experts=4)
    out = tmp_path_factory.mktemp("crc") / "fsdp3"
    write_checkpoint(src, out, MeshSpec(fsdp=3), progress=False)
    return src, out


@pytest.fixture
def check_reads(monkeypatch):
    """The bytes the source check itself reads, by file size: it reads only what no writer read."""
    read: list[int] = []
    real = source_check._reader

    def counting(store, file):
        read_crc = real(store, file)

        def counted(offset, length):
            read.append(length)
            return read_crc(offset, length)

        return counted

    monkeypatch.setattr(source_check, "_reader", counting)
    return read


def header_bytes(folder: Path) -> int:
    """The 8-byte length and JSON header of every rank file: the bytes no output holds."""
    return sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in folder.glob("shard-*.safetensors"))


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def test_a_merge_checks_its_source_reading_only_the_headers_again(folder, check_reads, tmp_path):
    _, good = folder
    summary = merge_checkpoint(good, tmp_path / "merged", progress=False)
    assert summary.source_crc32_checked is True
    assert sum(check_reads) == header_bytes(good)
    check_reads.clear()
    with hang_guard(300):
        merge_checkpoint(good, tmp_path / "merged-2", progress=False, workers=2)  # each worker its own files
    assert sum(check_reads) == header_bytes(good)
    assert same_files(tmp_path / "merged", tmp_path / "merged-2")


def test_mesh_to_mesh_checks_its_source_from_one_read_in_one_process_and_with_workers(folder, check_reads, tmp_path):
    """fsdp 4 x ep 2 replicates the non-expert tensors: each is read for two coordinates, by one writer or by two."""
    _, good = folder
    write_checkpoint(good, tmp_path / "one", MeshSpec(fsdp=4, ep=2), progress=False)
    assert sum(check_reads) == header_bytes(good)  # a range read again by the same writer is kept once
    check_reads.clear()
    with hang_guard(300):
        write_checkpoint(good, tmp_path / "two", MeshSpec(fsdp=4, ep=2), progress=False, workers=2)
    assert sum(check_reads) == header_bytes(good)  # two workers' equal ranges (replicated tensors) are compared
    assert same_files(tmp_path / "one", tmp_path / "two")
