"""`Store.read_ranges`: many ranges of a source in few requests, each store kind with its own number in flight.

Checked against the file's own bytes: every range delivered exactly once, bit for bit, whatever the order asked; the
requests joined, split and kept apart as documented; a failure leaves no fetch thread running."""

from __future__ import annotations

import os
import random
import threading
import zlib

import pytest

from reshard.read import ByteRange, JoinedStore, LocalStore, Store
from reshard.read import _ranges as coalesced


class _Counted(LocalStore):
    """A local folder that counts its requests, read `in_flight` at a time (as an object store is)."""

    def __init__(self, root, in_flight: int):
        super().__init__(root)
        self.in_flight, self.asked, self.lock = in_flight, [], threading.Lock()

    def readinto(self, name, start, view):
        with self.lock:
            self.asked.append((name, start, len(view)))
        super().readinto(name, start, view)


@pytest.fixture
def folder(tmp_path):
    rng = random.Random(7)
    for name, size in (("a.bin", 300_000), ("b.bin", 90_000)):
        (tmp_path / name).write_bytes(rng.randbytes(size))
    return tmp_path


def _gathered(store: Store, ranges: list[ByteRange], **kw) -> dict[int, bytearray]:
    """Each range's bytes put together from its pieces; a byte delivered twice, or a piece out of its range, fails."""
    got: dict[int, bytearray] = {}
    filled: dict[int, set[int]] = {}

    def deliver(piece) -> None:
        asked = ranges[piece.index]
        assert 0 <= piece.offset and piece.offset + len(piece.data) <= asked.length, piece
        done = filled.setdefault(piece.index, set())
        here = set(range(piece.offset, piece.offset + len(piece.data)))
        assert not done & here, f"bytes of range {piece.index} delivered twice"
        done |= here
        got.setdefault(piece.index, bytearray(asked.length))[piece.offset:piece.offset + len(piece.data)] = piece.data
        if kw.get("each") is zlib.crc32:
            assert piece.digest == zlib.crc32(piece.data)

    store.read_ranges(ranges, deliver, **kw)
    return got


@pytest.mark.parametrize("in_flight", [0, 3])
def test_every_range_arrives_once_and_equal_to_the_file(folder, in_flight, monkeypatch):
    monkeypatch.setattr(coalesced, "RANGE", 4096)  # ranges longer than one request, and many requests
    rng = random.Random(in_flight)
    sizes = {"a.bin": 300_000, "b.bin": 90_000}
    ranges = []
    for _ in range(200):
        name = rng.choice(sorted(sizes))
        start = rng.randrange(sizes[name])
        ranges.append(ByteRange(name, start, rng.randrange(min(20_000, sizes[name] - start) + 1)))
    store = _Counted(folder, in_flight)
    buffers: list[bytearray] = []
    got = _gathered(store, ranges, buffers=buffers, each=zlib.crc32)
    for i, r in enumerate(ranges):
        expected = (folder / r.name).read_bytes()[r.start:r.start + r.length]
        assert bytes(got.get(i, b"")) == expected, i
    assert all(length <= 4096 for _, _, length in store.asked)
    assert len(store.asked) < sum(-(-r.length // 4096) for r in ranges)  # neighbours were joined
    assert len(buffers) == min(len(store.asked), in_flight + 1)  # the caller's buffers, reused
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-fetch")]


def test_neighbours_join_gaps_are_bounded_and_files_stay_apart():
    ranges = [ByteRange("a", 0, 100), ByteRange("a", 100, 100), ByteRange("b", 200, 10),
              ByteRange("a", 200 + coalesced.MIN_GAP, 10), ByteRange("a", 10 << 20, 10), ByteRange("a", 5, 0)]
    requests = coalesced.requests(ranges, block=1 << 20)
    assert [(r.name, r.start, r.length) for r in requests] == [
        ("a", 0, 210 + coalesced.MIN_GAP),  # a gap of MIN_GAP is read
        ("a", 10 << 20, 10),  # a gap of 10 MiB is not
        ("b", 200, 10),  # another file, another request
    ]
    assert [i for r in requests for i, *_ in r.pieces] == [0, 1, 3, 4, 2]  # the empty range asks for nothing
    split = coalesced.requests([ByteRange("a", 7, 2500)], block=1000)
    assert [(r.start, r.length, r.pieces) for r in split] == [
        (7, 1000, ((0, 0, 7, 1000),)), (1007, 1000, ((0, 1000, 1007, 1000),)), (2007, 500, ((0, 2000, 2007, 500),))]


@pytest.mark.parametrize("in_flight", [0, 3])
def test_a_failing_caller_or_read_stops_the_requests_and_leaves_no_thread(folder, in_flight, monkeypatch):
    monkeypatch.setattr(coalesced, "RANGE", 1000)
    ranges = [ByteRange("a.bin", start, 1000) for start in range(0, 200_000, 2000)]
    store = _Counted(folder, in_flight)

    def stop_at_third(piece) -> None:
        if piece.index == 2:
            raise KeyError("the caller's own failure")

    with pytest.raises(KeyError, match="the caller's own failure"):
        store.read_ranges(ranges, stop_at_third)
    assert len(store.asked) <= 3 + in_flight  # no request made after the failure but those already in flight
    os.unlink(folder / "b.bin")
    truncated = [ByteRange("a.bin", 299_000, 5000)]
    with pytest.raises(Exception, match="the file ends at byte 300000"):
        _Counted(folder, in_flight).read_ranges(truncated, lambda piece: None)
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-fetch")]


def test_a_joined_store_reads_each_name_from_its_own_store(folder, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    (other / "c.bin").write_bytes(bytes(range(256)) * 10)
    joined = JoinedStore(_Counted(folder, 0), "extras/", _Counted(other, 2))
    assert joined.in_flight == 2
    ranges = [ByteRange("extras/c.bin", 10, 100), ByteRange("a.bin", 50, 20)]
    got = _gathered(joined, ranges)
    assert bytes(got[0]) == (bytes(range(256)) * 10)[10:110]
    assert bytes(got[1]) == (folder / "a.bin").read_bytes()[50:70]


def test_verify_compares_runs_longer_than_a_request_where_they_are(tiny, tmp_path, monkeypatch):
    """verify's comparison with the source reads through `read_ranges`: with requests far shorter than the runs,
    each piece is compared with the written bytes at its own offset, and a byte flipped deep in a run is found."""
    from reshard.api import verify_folder, write_checkpoint
    from reshard.plan import MeshSpec

    src = tiny("qwen3_moe", experts=4)
    out = tmp_path / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=2), progress=False)
    monkeypatch.setattr(coalesced, "RANGE", 1000)
    assert verify_folder(out, against=src, checksums=False).ok
    shard = sorted(out.glob("shard-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1500] ^= 0x01  # inside the file's last run, over a request's length from its start
    shard.write_bytes(bytes(raw))
    result = verify_folder(out, against=src, checksums=False)
    assert not result.ok and any("differs from the source" in p for p in result.problems), result.problems
