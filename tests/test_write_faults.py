"""`reshard write` under faults: each one leaves no partial output and says what happened.

"No partial output" means: OUT does not exist (or is untouched when it existed before), and no
`.OUT.reshard-tmp-*` folder is left beside it. The one exception is SIGKILL, which no process can clean up after:
the temporary folder may remain, but OUT must not appear, and the next write to OUT removes the stale folder.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
from click.testing import CliRunner

import reshard.write._files as output_files
from reshard.runs import Engine
from reshard.api import verify, write_checkpoint
from reshard.cli import cli
from reshard.errors import CheckpointError, OutputError
from reshard.plan import MeshSpec

from conftest import two_file_source

REPO = Path(__file__).resolve().parents[1]
MESH = MeshSpec(fsdp=4)


def leftovers(out: Path) -> list[str]:
    """Temporary folders of writes to `out` still beside it."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.reshard-tmp-*"))


def assert_nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} exists after a failed write"
    assert leftovers(out) == [], f"temporary folders left: {leftovers(out)}"


def copy_source(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def write_cli(*args: str):
    return CliRunner().invoke(cli, ["write", *map(str, args), "-q"])


# ---- the output folder -----------------------------------------------------------------------------------------

def test_existing_output_is_refused_then_overwritten(tiny, tmp_path):
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = write_cli(src, out, "--fsdp", "4")
    assert result.exit_code == 1
    assert "already exists" in result.output and "--overwrite" in result.output
    assert "Traceback" not in result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert leftovers(out) == []

    # --overwrite replaces only an empty folder or a reshard output: a folder holding anything else is refused too
    result = write_cli(src, out, "--fsdp", "4", "--overwrite")
    assert result.exit_code == 1
    assert "keep.txt" in result.output and "not a reshard output" in result.output and "Traceback" not in result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder, no lock file

    (out / "keep.txt").unlink()  # an empty folder is replaced
    result = write_cli(src, out, "--fsdp", "2", "--overwrite")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "reshard.json").read_text())["mesh"]["fsdp"] == 2

    result = write_cli(src, out, "--fsdp", "4", "--overwrite")  # and so is a reshard output
    assert result.exit_code == 0, result.output
    assert json.loads((out / "reshard.json").read_text())["mesh"]["fsdp"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # neither the old OUT nor a temporary nor the lock
    verify(out, against=src)


# ---- the source ------------------------------------------------------------------------------------------------

def test_corrupt_source_header(tiny, tmp_path):
    src = copy_source(tiny("qwen3_moe", experts=2), tmp_path / "src")
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"#garble#"  # the JSON header now starts with garbage; the length prefix is intact
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        write_checkpoint(src, out, MESH, progress=False)
    assert "model.safetensors" in str(info.value) and "not valid JSON" in str(info.value)
    assert_nothing_left(out)
    result = write_cli(src, out, "--fsdp", "4")
    assert result.exit_code == 1 and "model.safetensors" in result.output and "Traceback" not in result.output
    assert_nothing_left(out)


def test_missing_source_shard(tiny, tmp_path):
    src, names = two_file_source(tiny("mixtral", experts=8), tmp_path / "src")
    good = tmp_path / "good"
    write_checkpoint(src, good, MESH, progress=False)  # the two-file source itself is fine
    verify(good, against=src)
    (src / names[1]).unlink()
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        write_checkpoint(src, out, MESH, progress=False)
    assert names[1] in str(info.value) and "does not exist" in str(info.value)
    assert_nothing_left(out)
    result = write_cli(src, out, "--fsdp", "4")
    assert result.exit_code == 1 and names[1] in result.output and "Traceback" not in result.output
    assert_nothing_left(out)


# ---- the disk --------------------------------------------------------------------------------------------------

def enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_at_fsync(tiny, tmp_path, monkeypatch):
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # every shard is written, the first is on disk, the second one fails
            assert len(list(next(iter(tmp_path.glob(".out.reshard-tmp-*"))).glob("shard-*"))) == 4
            raise enospc()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutputError, match="(?i)no space left") as info:
        write_checkpoint(src, out, MESH, progress=False)
    assert len(calls) == 2
    assert "no space left" in str(info.value).lower()
    assert_nothing_left(out)


def test_disk_full_in_the_copy_loop(tiny, tmp_path, monkeypatch):
    src = tiny("mixtral", experts=8)
    out = tmp_path / "out"
    real_copy, copies = Engine._copy_some, []

    def copy_some(self, src_fd, out_fd, n, src, dst):
        copies.append(n)
        if len(copies) == 30:  # well into the second file: some of its bytes are already written
            raise enospc()
        return real_copy(self, src_fd, out_fd, n, src, dst)

    monkeypatch.setattr(Engine, "_copy_some", copy_some)
    result = write_cli(src, out, "--fsdp", "5")
    assert result.exit_code == 1
    assert "no space left" in result.output.lower() and "Traceback" not in result.output
    assert_nothing_left(out)


def test_disk_full_when_a_file_reserves_its_blocks(tiny, tmp_path, monkeypatch):
    """Each file reserves its exact size before its first byte (fallocate): a disk that fills meanwhile fails there,
    with the usual message, and nothing is left."""
    src = tiny("mixtral", experts=8)
    out = tmp_path / "out"
    reserved = []

    def fallocate(fd, mode, offset, length):
        reserved.append(length)
        if len(reserved) == 3:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return os.ftruncate(fd, length) or 0  # reserve the size, as the kernel does

    monkeypatch.setattr(output_files, "_fallocate", lambda: fallocate)
    result = write_cli(src, out, "--fsdp", "5")
    assert result.exit_code == 1 and len(reserved) == 3
    assert "no space left" in result.output.lower() and "Traceback" not in result.output
    assert_nothing_left(out)


def test_every_file_reserves_exactly_its_size(tiny, tmp_path, monkeypatch):
    """The reserved size is the file's final size (a reservation past it would leave zeros behind the last tensor)."""
    src = tiny("mixtral", experts=8)
    reserved = {}
    real_create = output_files.create_sized

    def create_sized(path, size):
        reserved[Path(path).name] = size
        return real_create(path, size)

    monkeypatch.setattr(output_files, "create_sized", create_sized)
    write_checkpoint(src, tmp_path / "out", MeshSpec(fsdp=5), progress=False)
    written = {p.name: p.stat().st_size for p in (tmp_path / "out").glob("shard-*.safetensors")}
    assert reserved == written and len(written) == 5


def test_not_enough_free_space_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 4096, 4096))
    with pytest.raises(OutputError, match="4.00 KiB free, the output needs") as info:
        write_checkpoint(src, out, MESH, progress=False)
    assert "4.00 KiB free, the output needs" in str(info.value) and "Nothing was changed" in str(info.value)
    assert_nothing_left(out)


# ---- interruptions: a real process, stopped after its first file ----------------------------------------------

SLOW_WRITE = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    # a shell may start background jobs with SIGINT ignored; a terminal's Ctrl-C raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import reshard.write._shards as w
    first_file_written = Path({marker!r})
    stock_write_file = w.write_rank_file

    def slow_write_file(path, *args):
        entry = stock_write_file(path, *args)
        if not first_file_written.exists():
            first_file_written.write_text(str(path))
            time.sleep(120)  # the test signals it long before; teardown kills it otherwise
        return entry

    w.write_rank_file = slow_write_file
    from reshard.cli import main
    sys.argv = ["reshard", "write", {src!r}, {out!r}, "--fsdp", "4", "-q"]
    main()
""")


class SlowWriter:
    def __init__(self, src: Path, out: Path):
        self.out = out
        self.marker = out.parent / f"{out.name}.first-file"
        code = SLOW_WRITE.format(repo=str(REPO), marker=str(self.marker), src=str(src), out=str(out))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_for_first_file(self, timeout: float = 180) -> Path:
        deadline = time.monotonic() + timeout
        while not self.marker.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"the writer exited {self.proc.returncode} early: {self.proc.communicate()}")
            if time.monotonic() > deadline:
                pytest.fail("the writer did not finish its first file in time")
            time.sleep(0.05)
        first = Path(self.marker.read_text())
        assert first.exists() and first.parent.name.startswith(f".{self.out.name}.reshard-tmp-")
        assert not self.out.exists()
        return first

    def stop(self, sig: int) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the writer did not stop within 30 s of signal {sig}")
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def slow_writers(tiny, tmp_path_factory):
    """Three writers started at once (they spend most of their time importing), one per signal."""
    src = tiny("qwen3_moe", experts=2)
    root = tmp_path_factory.mktemp("interrupted")
    writers = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        (root / sig.name).mkdir()
        writers[sig] = SlowWriter(src, root / sig.name / "out")
    yield src, writers
    for writer in writers.values():
        if writer.proc.poll() is None:
            writer.proc.kill()
            writer.proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupted_write_leaves_nothing(slow_writers, sig):
    _, writers = slow_writers
    writer = writers[sig]
    writer.wait_for_first_file()
    code, err = writer.stop(sig)
    assert code == 128 + sig, err  # 143 for SIGTERM, 130 for Ctrl-C, as a shell reports a process they killed
    assert f"interrupted ({sig.name})" in err and "Traceback" not in err
    assert_nothing_left(writer.out)


def test_killed_write_leaves_no_output_and_next_write_cleans_up(slow_writers):
    src, writers = slow_writers
    writer = writers[signal.SIGKILL]
    first = writer.wait_for_first_file()
    code, _ = writer.stop(signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert not writer.out.exists()
    stale = leftovers(writer.out)
    assert stale == [first.parent.name], "SIGKILL cannot be cleaned up after: the temporary folder should remain"
    assert not (first.parent / "reshard.json").exists()
    write_checkpoint(src, writer.out, MESH, progress=False)
    assert leftovers(writer.out) == []
    verify(writer.out, against=src)
