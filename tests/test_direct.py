"""Large output files go around the page cache (`O_DIRECT`, reshard/runs/_direct.py): the same bytes, the same CRC-32s,
damage still refused, and every way it can fail ends in the page cache path or a clean error, never a hang.

The thresholds are lowered here so that tiny files take the direct path: every file at least 0 bytes of data, in
blocks of 8 KiB (runs cross blocks, the last block is padded and cut back), and once with the real 8 MiB block.
"""

from __future__ import annotations

import errno
import fcntl
import filecmp
import mmap
import os
import shutil
import threading
import types
from pathlib import Path

import pytest

import reshard.runs._direct as direct_io
import reshard.runs._engine as engine
import reshard.runs._source_check as source_check
from reshard.api import merge_checkpoint, verify_folder, write_checkpoint
from reshard.errors import CheckpointError, OutputError
from reshard.plan import MeshSpec
from reshard.runs._direct import ALIGN, BLOCK_BYTES, DirectOutput
from reshard.syscalls import dirty_room, page_cache_room

from conftest import hang_guard


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} exists"
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == []


JOBS = {
    "write": lambda f, out: write_checkpoint(f["src"], out, MeshSpec(fsdp=4, ep=2), progress=False),
    "merge": lambda f, out: merge_checkpoint(f["good"], out, progress=False),
    "mesh-to-mesh": lambda f, out: write_checkpoint(f["good"], out, MeshSpec(fsdp=4, ep=2), progress=False),
}


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory):
    """The source, a reshard folder of it at fsdp 3, one with a data byte flipped, and each job's output through the
    page cache (the thresholds as shipped: these files are far below them)."""
    root = tmp_path_factory.mktemp("direct")
    found = {"src": tiny("qwen3_moe", experts=4), "good": root / "fsdp3"}
    write_checkpoint(found["src"], found["good"], MeshSpec(fsdp=3), progress=False)
    found["bad"] = root / "flipped"
    shutil.copytree(found["good"], found["bad"])
    victim = sorted(found["bad"].glob("shard-*.safetensors"))[0]
    raw = bytearray(victim.read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    raw[data_start + (len(raw) - data_start) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    for name, job in JOBS.items():
        job(found, root / f"reference-{name}")
    return found, root


@pytest.fixture(params=[2 * ALIGN, BLOCK_BYTES], ids=["8KiB-blocks", "8MiB-blocks"])
def direct(request, monkeypatch):
    """Every output file takes the direct path; `started` holds, per file, whether direct I/O was on."""
    monkeypatch.setattr(engine, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(engine, "page_cache_room", lambda: 0)  # as if the page cache were full of dirty pages
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", request.param)
    started: list[bool] = []
    real = DirectOutput.start.__func__

    def start(cls, fd, ring, *hooks):
        out = real(cls, fd, ring, *hooks)
        started.append(out is not None)
        return out

    monkeypatch.setattr(DirectOutput, "start", classmethod(start))
    return started


def direct_writes(monkeypatch, fail):
    """Route os.pwrite through `fail(n)` for the n-th write made with O_DIRECT on (it raises, or returns None to let
    the write happen); returns the list of n's seen."""
    real, seen = os.pwrite, []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append(len(seen) + 1)
            fail(len(seen))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return seen


@pytest.mark.parametrize("job", list(JOBS))
def test_direct_outputs_are_the_page_cache_ones_byte_for_byte(folders, direct, tmp_path, monkeypatch, job):
    """... and a reshard folder's CRC-32s come from the blocks' one read: the source check reads only the headers."""
    found, root = folders
    checked, real = [], source_check._reader

    def reader(store, file):
        read_crc = real(store, file)
        return lambda offset, length: (checked.append(length), read_crc(offset, length))[1]

    monkeypatch.setattr(source_check, "_reader", reader)
    with hang_guard(120):
        JOBS[job](found, tmp_path / "out")
    headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in found["good"].glob("shard-*"))
    assert sum(checked) == (0 if job == "write" else headers)
    assert direct and all(direct), direct  # every file went around the page cache
    assert len(direct) == len(list((tmp_path / "out").glob("*.safetensors")))
    assert same_files(root / f"reference-{job}", tmp_path / "out")  # reshard.json's CRC-32s included
    if job != "merge":
        assert verify_folder(tmp_path / "out", against=found["src"]).ok
    assert not [t.name for t in threading.enumerate() if t.name.startswith("reshard-write")]  # the ring is closed


@pytest.mark.parametrize("job", ["merge", "mesh-to-mesh"])
def test_a_flipped_byte_is_still_refused_with_nothing_kept(folders, direct, tmp_path, job):
    found, _ = folders
    with pytest.raises(CheckpointError, match="CRC-32"), hang_guard(120):
        JOBS[job]({**found, "good": found["bad"]}, tmp_path / "out")
    assert direct and all(direct)
    nothing_left(tmp_path / "out")


def test_a_file_system_without_direct_io_gets_the_page_cache_path(folders, direct, tmp_path, monkeypatch):
    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs and many FUSE file systems answer
        return fcntl.fcntl(fd, cmd, arg)

    monkeypatch.setattr(direct_io, "fcntl", types.SimpleNamespace(F_GETFL=fcntl.F_GETFL, F_SETFL=fcntl.F_SETFL,
                                                                  fcntl=refusing))
    found, root = folders
    JOBS["merge"](found, tmp_path / "out")
    assert direct and not any(direct)
    assert same_files(root / "reference-merge", tmp_path / "out")


def test_a_direct_write_refused_midway_finishes_through_the_page_cache(folders, direct, tmp_path, monkeypatch):
    """EINVAL on the second direct write of a file (an alignment the device does not take): that write and the rest
    of the file go through the page cache; the bytes are the same."""
    def fail(n):
        if n == 2:
            raise OSError(errno.EINVAL, "Invalid argument")

    seen = direct_writes(monkeypatch, fail)
    found, root = folders
    with hang_guard(120):
        JOBS["mesh-to-mesh"](found, tmp_path / "out")
    assert 2 in seen
    assert same_files(root / "reference-mesh-to-mesh", tmp_path / "out")


@pytest.mark.parametrize("job", list(JOBS))
def test_a_full_disk_in_a_writer_thread_fails_the_job_with_nothing_left(folders, direct, tmp_path, monkeypatch, job):
    at = 3 if direct_io.BLOCK_BYTES < (1 << 20) else 1  # mid-file in small blocks; a tiny file is one 8 MiB block

    def fail(n):
        if n == at:
            raise OSError(errno.ENOSPC, "No space left on device")

    seen = direct_writes(monkeypatch, fail)
    found, _ = folders
    with pytest.raises(OutputError, match="(?i)space") as info, hang_guard(120):
        JOBS[job](found, tmp_path / "out")
    assert at in seen
    assert "space" in str(info.value).lower(), str(info.value)
    nothing_left(tmp_path / "out")
    assert not [t.name for t in threading.enumerate() if t.name.startswith("reshard-write")]


def test_a_source_that_shrinks_mid_copy_is_a_short_read_with_nothing_left(folders, direct, tmp_path, monkeypatch):
    real, calls = os.preadv, []

    def preadv(fd, buffers, offset):
        if isinstance(buffers[0].obj, mmap.mmap):  # a read into a block, not a header's
            calls.append(offset)
            if len(calls) == 5:
                return 0  # end of file, where bytes were promised
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    found, _ = folders
    with pytest.raises(OutputError, match="short read"), hang_guard(120):
        JOBS["merge"](found, tmp_path / "out")
    assert len(calls) == 5
    nothing_left(tmp_path / "out")


@pytest.mark.parametrize("room, goes_direct", [(0, True), (None, True), (1 << 50, False)],
                         ids=["page-cache-full", "room-unknown", "room-to-spare"])
def test_a_file_goes_around_the_page_cache_only_when_it_would_be_throttled(folders, direct, tmp_path, monkeypatch,
                                                                           room, goes_direct):
    """A file the page cache takes without throttling is copied by the kernel; one that would push it past the
    point where writers are throttled (or where that is unknown) goes direct."""
    monkeypatch.setattr(engine, "page_cache_room", lambda: room)
    found, root = folders
    JOBS["merge"](found, tmp_path / "out")
    assert direct == ([True] if goes_direct else [])
    assert same_files(root / "reference-merge", tmp_path / "out")


def test_the_room_for_dirty_pages_is_read_from_vmstat():
    page = os.sysconf("SC_PAGE_SIZE")
    text = "nr_free_pages 5\nnr_dirty 100\nnr_writeback 20\nnr_dirty_threshold 1000\nnr_dirty_background_threshold 500\n"
    assert dirty_room(text) == (750 - 120) * page  # throttling starts halfway between the two thresholds
    assert dirty_room(text.replace("nr_dirty 100", "nr_dirty 900")) == 0
    assert dirty_room("nr_free_pages 5\n") is None  # a kernel that does not say: unknown, not zero
    room = page_cache_room()
    assert room is None or room >= 0


@pytest.mark.parametrize("spare", [0, -1], ids=["job-fits", "job-one-byte-over"])
def test_a_job_goes_around_the_page_cache_when_it_would_not_fit_there(folders, direct, tmp_path, monkeypatch, spare):
    """The decision is the whole job's: every file of a job that fits the page cache's room goes through it, every
    large file of one that does not goes around it; the bytes are the same."""
    found, root = folders
    reference = root / "reference-mesh-to-mesh"
    files = sorted(reference.glob("shard-*.safetensors"))
    data = sum(p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little") for p in files)
    monkeypatch.setattr(engine, "page_cache_room", lambda: data + spare)
    JOBS["mesh-to-mesh"](found, tmp_path / "out")
    assert direct == ([] if spare == 0 else [True] * len(files))
    assert same_files(reference, tmp_path / "out")
