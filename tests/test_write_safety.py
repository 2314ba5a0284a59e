"""`reshard write` can never destroy or duplicate data.

- Only allow-listed top-level metadata is copied beside the shards (never `.git`, `original/`, other weight
  formats), and the free-space check counts it. Hub sources download only the indexed weights and that metadata.
- `--overwrite` replaces only an empty folder or a complete reshard output, never the source or a folder holding it.
- The swap of a new output for an old one leaves OUT the whole old or the whole new folder whenever it stops:
  interrupted (Ctrl-C, SIGTERM) or killed (SIGKILL) at each step, with the atomic exchange and with the fallback.
- One writer per OUT: a lock beside it, held by a live process on any host; stale temporaries go only when it is free.
- Sub-byte dtypes are refused when the headers are read, before anything is planned or written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
from click.testing import CliRunner

import reshard.write._durable as durable
import reshard.write._shards as write_module
import reshard.write._staged as staged
from reshard.api import plan_checkpoint, verify, write_checkpoint
from reshard.read._checkpoint import METADATA_PATTERNS
from reshard.read import parse_header
from reshard.cli import cli
from reshard.errors import CheckpointError, OutputError
from reshard.plan import MeshSpec

from conftest import two_file_source

REPO = Path(__file__).resolve().parents[1]
MESH = MeshSpec(fsdp=4)
OLD_MESH = MeshSpec(fsdp=2)
SUBPROCESS_TIMEOUT = 120


def write_cli(*args: str):
    return CliRunner().invoke(cli, ["write", *map(str, args), "-q"])


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (hidden ones too) with a digest of its bytes: equal trees have equal dicts."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link:{os.readlink(path)}"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def beside(out: Path) -> list[str]:
    """What a write to `out` may leave next to it: temporaries, the aside old output, the lock file."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.reshard-*"))


def mesh_of(out: Path) -> int:
    return json.loads((out / "reshard.json").read_text())["mesh"]["fsdp"]


def assert_complete(out: Path, src: Path, fsdp: int) -> None:
    """OUT is a whole reshard output of `src` for --fsdp `fsdp`: every file, CRC and byte checked."""
    assert out.is_dir(), f"{out} is missing"
    assert mesh_of(out) == fsdp
    verify(out, against=src)


# ---- what is copied ----------------------------------------------------------------------------------------------

METADATA = ["LICENSE", "README.md", "chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
            "modeling_custom.py", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]


def cluttered_source(tiny_src: Path, dest: Path, *, consolidated: bool = False) -> Path:
    """A tiny checkpoint as a `git clone` of a Hub repo with extra formats would hold it."""
    shutil.copytree(tiny_src, dest)
    weights = (dest / "model.safetensors").read_bytes()
    for name in METADATA:
        if not (dest / name).exists():
            (dest / name).write_text(f"{name}\n")
    lfs = dest / ".git" / "lfs" / "objects" / "ab" / "cd"
    lfs.mkdir(parents=True)
    (lfs / hashlib.sha256(weights).hexdigest()).write_bytes(weights)  # git-lfs' second copy of the weights
    (dest / ".git" / "config").write_text("[core]\n")
    (dest / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (dest / "original").mkdir()
    (dest / "original" / "consolidated.00.pth").write_bytes(weights)
    (dest / "original" / "params.json").write_text("{}")
    if consolidated:
        (dest / "consolidated.safetensors").write_bytes(weights)  # the same tensors, another runtime's copy
    for name in ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "model-q4.gguf"):
        (dest / name).write_bytes(b"\0" * 64)
    (dest / "docs").mkdir()
    (dest / "docs" / "notes.txt").write_text("not at the top level\n")
    return dest


@pytest.mark.parametrize("consolidated", [False, True], ids=["git-clone", "with-consolidated"])
def test_only_allow_listed_metadata_is_copied(tiny, tmp_path, consolidated):
    src = cluttered_source(tiny("qwen3_moe", experts=2), tmp_path / "src", consolidated=consolidated)
    out = tmp_path / "out"
    write_checkpoint(src, out, MESH, progress=False)
    manifest = json.loads((out / "reshard.json").read_text())
    shards = [f"shard-{c:05d}-model-00001-of-00001.safetensors" for c in (1, 2, 3, 4)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*METADATA, "reshard.json", *shards])
    assert manifest["copied"] == METADATA
    for name in METADATA:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert beside(out) == []
    verify(out, against=src)


def test_free_space_check_counts_the_copied_files(tiny, tmp_path, monkeypatch):
    src = cluttered_source(tiny("qwen3_moe", experts=2), tmp_path / "src")
    (src / "big.txt").write_bytes(b"x" * (3 << 20))  # larger than every shard together
    plan = plan_checkpoint(src, MESH).plan
    data = sum(spec.nbytes for c in range(MESH.num_coords) for spec, _, _ in
               write_module.coordinate_chunks(plan, c))
    needed = data + sum((src / name).stat().st_size for name in [*METADATA, "big.txt"])
    usage = namedtuple("usage", "total used free")
    out = tmp_path / "out"

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, needed - 1))
    from reshard.plan import human_bytes

    with pytest.raises(OutputError, match=re.escape(f"{human_bytes(needed - 1)} free, the output needs "
                                                    f"{human_bytes(needed)}.")):
        write_checkpoint(src, out, MESH, progress=False)
    assert not out.exists() and beside(out) == []

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, needed))
    write_checkpoint(src, out, MESH, progress=False)
    assert (out / "big.txt").stat().st_size == 3 << 20


# ---- Hub sources: what is downloaded -----------------------------------------------------------------------------

COMMIT = "c" * 40


class FakeHub:
    """Stands in for `huggingface_hub.snapshot_download`: filters a local "repo" with huggingface-hub's own pattern
    matcher into `snapshots/<commit>/`, and records every call's patterns."""

    def __init__(self, repo: Path, cache: Path):
        self.repo, self.snapshot, self.calls = repo, cache / "snapshots" / COMMIT, []

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.repo)) for p in self.repo.rglob("*") if p.is_file())

    def __call__(self, repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append((revision, allow_patterns, ignore_patterns))
        self.snapshot.mkdir(parents=True, exist_ok=True)
        for name in filter_repo_objects(self.files(), allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (self.snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.repo / name, self.snapshot / name)
        return str(self.snapshot)

    def downloaded(self) -> list[str]:
        return sorted(str(p.relative_to(self.snapshot)) for p in self.snapshot.rglob("*") if p.is_file())


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def make(repo: Path) -> FakeHub:
        hub = FakeHub(repo, tmp_path / "cache" / "models--org--moe")
        monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
        return hub

    monkeypatch.chdir(tmp_path)  # `org/moe` is never a local path
    return make


@pytest.mark.parametrize("sharded", [True, False], ids=["index", "single-file"])
def test_hub_write_downloads_only_the_indexed_weights_and_metadata(tiny, tmp_path, fake_hub, sharded):
    src = tiny("qwen3_moe", experts=2)
    repo = tmp_path / "repo"
    if sharded:
        _, weights = two_file_source(src, repo)
    else:
        shutil.copytree(src, repo)
        weights = ["model.safetensors"]
    blob = (src / "model.safetensors").read_bytes()
    for name in ("tokenizer.json", "chat_template.jinja", "README.md", ".gitattributes"):
        (repo / name).write_text(name)
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.00.pth").write_bytes(blob)
    (repo / "original" / "params.json").write_text("{}")
    (repo / "original" / "tokenizer.model").write_text("sp")
    (repo / "consolidated.safetensors").write_bytes(blob)
    (repo / "pytorch_model.bin").write_bytes(blob)
    if sharded:
        (repo / "extra-not-indexed.safetensors").write_bytes(blob)
    hub = fake_hub(repo)

    out = tmp_path / "out"
    write_checkpoint("org/moe", out, MESH, progress=False)
    manifest = json.loads((out / "reshard.json").read_text())
    metadata = sorted(["README.md", "chat_template.jinja", "config.json", "generation_config.json",
                       "tokenizer.json", *(["model.safetensors.index.json"] if sharded else [])])
    assert hub.downloaded() == sorted([*metadata, *weights])
    for _, allow, ignore in hub.calls:
        assert allow is not None and {"original/*", "*.pth", "consolidated.*"} <= set(ignore)
    (_, metadata_only, _), (revision, allow, _) = hub.calls
    assert metadata_only == list(METADATA_PATTERNS)
    assert allow == [*METADATA_PATTERNS, *(weights if sharded else ["*.safetensors"])]
    assert revision == COMMIT  # the weights come from the commit the index was read at
    assert manifest["copied"] == [m for m in metadata if m != "model.safetensors.index.json"]
    verify(out, against=src)


# ---- --overwrite never replaces the source or anything not ours --------------------------------------------------

@pytest.mark.parametrize("where", ["out-is-src", "out-holds-src", "out-holds-src-file", "out-is-a-link-to-src",
                                   "out-is-src-by-dotdot", "out-inside-src-through-a-link", "out-holds-src-by-dotdot"])
def test_overwrite_refuses_the_source(tiny, tmp_path, where):
    models = tmp_path / "models"
    src = models / "src"
    shutil.copytree(tiny("qwen3_moe", experts=2), src)
    (models / "unrelated.txt").write_text("someone else's")
    source, out = {
        "out-is-src": (src, src),
        "out-holds-src": (src, models),
        "out-holds-src-file": (src / "model.safetensors", models),
        "out-is-a-link-to-src": (src, tmp_path / "link"),
        "out-is-src-by-dotdot": (src, models / "nowhere" / ".." / "src"),
        "out-inside-src-through-a-link": (src, tmp_path / "link" / "fsdp4"),
        "out-holds-src-by-dotdot": (src, tmp_path / "link" / ".."),  # the link's target's parent: models
    }[where]
    (tmp_path / "link").symlink_to(src)
    before = tree(tmp_path)
    t0 = time.monotonic()
    result = write_cli(source, out, "--fsdp", "4", "--overwrite")
    assert result.exit_code == 1, result.output
    assert "source" in result.output and "Nothing was changed" in result.output and "Traceback" not in result.output
    assert time.monotonic() - t0 < 30
    assert tree(tmp_path) == before  # nothing touched: no temporary, no lock file, every byte as it was


def written(tiny, tmp_path: Path, name: str = "out") -> tuple[Path, Path]:
    """The tiny source and an existing OUT written from it for --fsdp 2 (tests overwrite it with --fsdp 4)."""
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / name
    write_checkpoint(src, out, OLD_MESH, progress=False)
    return src, out


@pytest.mark.parametrize("content", ["a-file", "output-plus-file", "output-plus-folder", "foreign-manifest",
                                     "out-is-a-file"])
def test_overwrite_refuses_anything_but_a_reshard_output(tiny, tmp_path, content):
    src, out = written(tiny, tmp_path)
    if content == "a-file":
        shutil.rmtree(out)
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif content == "output-plus-file":
        (out / "notes.txt").write_text("mine")  # allow-listed name, but not one this write copied
    elif content == "output-plus-folder":
        (out / "runs").mkdir()
        (out / "runs" / "eval.json").write_text("{}")
    elif content == "foreign-manifest":
        (out / "reshard.json").write_text(json.dumps({"format": "something-else"}))
    else:
        shutil.rmtree(out)
        out.write_text("a file")
    before = tree(tmp_path)
    if content == "out-is-a-file":  # the CLI refuses it as a bad call (exit 2); the library says why
        with pytest.raises(OutputError, match="it is not a folder") as info:
            write_checkpoint(src, out, MESH, overwrite=True, progress=False)
        message = str(info.value)
        assert "it is not a folder" in message
    else:
        result = write_cli(src, out, "--fsdp", "4", "--overwrite")
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        message = result.output
    assert "--overwrite replaces only an empty folder or a complete reshard output" in message
    assert "Nothing was changed" in message
    assert tree(tmp_path) == before


def test_overwrite_replaces_an_output_written_before_copied_was_recorded(tiny, tmp_path):
    src, out = written(tiny, tmp_path)
    manifest = json.loads((out / "reshard.json").read_text())
    del manifest["copied"]
    (out / "reshard.json").write_text(json.dumps(manifest))
    result = write_cli(src, out, "--fsdp", "4", "--overwrite")
    assert result.exit_code == 0, result.output
    assert_complete(out, src, 4)
    assert beside(out) == []


# ---- the swap: OUT is the whole old or the whole new folder whenever it stops ------------------------------------

STEPS = {"exchange": ["before-swap", "swapped", "done"],
         "renames": ["before-swap", "old-moved", "swapped", "done"]}
CASES = [(mode, step) for mode, steps in STEPS.items() for step in steps]


def use_mode(monkeypatch, mode: str) -> None:
    if mode == "renames":  # a kernel or file system without RENAME_EXCHANGE
        monkeypatch.setattr(staged, "exchange", lambda a, b: False)
    else:
        assert durable.renameat2() is not None, "this test needs Linux renameat2"


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "SIGTERM"])
@pytest.mark.parametrize("mode,step", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_swap_interrupted_at_every_step(tiny, tmp_path, monkeypatch, mode, step, how):
    src, out = written(tiny, tmp_path)
    use_mode(monkeypatch, mode)
    seen = []

    def hook(name):
        # at every step OUT is a whole output; only the fallback's held-signal window has it aside
        if name == "old-moved":
            assert not out.exists() and len(beside(out)) == 3  # the new temporary, OUT aside, the lock
        else:
            assert_complete(out, src, 4 if name in ("swapped", "done") else 2)
        seen.append(name)
        if name == step:
            if how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler raises here, unless the signal is held
            else:
                raise KeyboardInterrupt(name)

    monkeypatch.setattr(staged, "swap_hook", hook)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(src, out, MESH, overwrite=True, progress=False)
    held = how == "SIGTERM" and step == "old-moved"  # delivered once both renames are done
    new = step in ("swapped", "done") or held
    assert_complete(out, src, 4 if new else 2)
    assert beside(out) == []  # the interrupted write removed its temporary, the old OUT and its lock
    if held:
        assert seen[-1] == "old-moved", "the swap's second rename must finish before the held signal is handled"


SWAP_KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import reshard.write._staged as w
    from reshard.api import write_checkpoint
    from reshard.plan._mesh import MeshSpec

    if {mode!r} == "renames":
        w.exchange = lambda a, b: False

    def hook(step):
        if step == {step!r}:
            os.kill(os.getpid(), signal.SIGKILL)

    w.swap_hook = hook
    write_checkpoint({src!r}, {out!r}, MeshSpec(fsdp=4), overwrite=True, progress=False)
""")


@pytest.mark.parametrize("mode,step", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_swap_killed_at_every_step(tiny, tmp_path, mode, step):
    src, out = written(tiny, tmp_path)
    code = SWAP_KILLER.format(repo=str(REPO), mode=mode, step=step, src=str(src), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if (mode, step) == ("renames", "old-moved"):
        # the one instant OUT is aside: the next write to OUT puts it back, whole, before anything else
        assert not out.exists()
        aside = [p for p in out.parent.glob(f".{out.name}.reshard-tmp-old-*")]
        assert len(aside) == 1 and mesh_of(aside[0]) == 2
        result = write_cli(src, out, "--fsdp", "4")  # no --overwrite: it puts OUT back, then refuses
        assert result.exit_code == 1 and "already exists" in result.output
        assert_complete(out, src, 2)
    else:
        assert_complete(out, src, 4 if step in ("swapped", "done") else 2)
    # whatever a SIGKILL left beside OUT (temporaries, the lock file) goes with the next write
    result = write_cli(src, out, "--fsdp", "4", "--overwrite")
    assert result.exit_code == 0, result.output
    assert_complete(out, src, 4)
    assert beside(out) == []


def test_a_swap_is_never_neither_when_the_new_folder_cannot_be_renamed_in(tiny, tmp_path, monkeypatch):
    """The fallback's second rename fails (any OSError): the old OUT goes back where it was."""
    src, out = written(tiny, tmp_path)
    use_mode(monkeypatch, "renames")
    real_rename = os.rename

    def rename(a, b):
        if Path(b) == out and ".reshard-tmp-" in Path(a).name and "-old-" not in Path(a).name:
            raise OSError(5, "Input/output error")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OutputError, match="write failed"):
        write_checkpoint(src, out, MESH, overwrite=True, progress=False)
    assert_complete(out, src, 2)
    assert beside(out) == []


# ---- one writer per OUT ------------------------------------------------------------------------------------------

BLOCKED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import reshard.write._staged as w

    ready, release = Path({ready!r}), Path({release!r})

    def hook(step):
        if step == "before-swap":  # the new folder is complete, OUT not yet replaced
            ready.write_text("ready")
            deadline = time.monotonic() + 60
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)

    w.swap_hook = hook
    from reshard.cli import main
    sys.argv = ["reshard", "write", {src!r}, {out!r}, "--fsdp", "4", "--overwrite", "-q"]
    main()
""")


def test_a_second_writer_to_the_same_out_exits_1(tiny, tmp_path):
    src, out = written(tiny, tmp_path)
    ready, release = tmp_path / "ready", tmp_path / "release"
    code = BLOCKED_WRITER.format(repo=str(REPO), ready=str(ready), release=str(release), src=str(src), out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while not ready.exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first writer did not get to its swap in time"
            time.sleep(0.05)
        its_tmp = out.parent / f".{out.name}.reshard-tmp-{first.pid}"
        assert (its_tmp / "reshard.json").exists()
        before = tree(its_tmp)

        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "reshard", "write", str(src), str(out), "--fsdp", "4",
                                 "--overwrite", "-q"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                                env=env)
        assert time.monotonic() - t0 < 30
        assert second.returncode == 1, second.stderr
        assert f"another reshard write (host {socket.gethostname()}, pid {first.pid}) is writing {out}" in second.stderr
        assert "Traceback" not in second.stderr
        assert tree(its_tmp) == before, "the second writer touched the first one's temporary folder"
        assert_complete(out, src, 2)
    finally:
        release.write_text("go")
        try:
            _, err = first.communicate(timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            first.kill()
            raise
    assert first.returncode == 0, err
    assert_complete(out, src, 4)
    assert beside(out) == []


def test_stale_temporaries_are_removed_only_when_their_lock_is_free(tiny, tmp_path):
    import fcntl

    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    # a writer on another host of a shared file system: its pid means nothing here, its lock is what counts
    theirs = tmp_path / ".out.reshard-tmp-999999"
    theirs.mkdir()
    (theirs / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"in progress")
    fd = os.open(tmp_path / ".out.reshard-lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"otherhost 999999\n")
        with pytest.raises(OutputError, match="another reshard write \\(host otherhost, pid 999999\\)") as info:
            write_checkpoint(src, out, MESH, progress=False)
        assert "another reshard write (host otherhost, pid 999999)" in str(info.value)
        assert (theirs / "shard-00001-model-00001-of-00001.safetensors").read_bytes() == b"in progress"
        assert not out.exists()
    finally:
        os.close(fd)  # that writer is gone
    # a temporary named after a live pid (here, pid 1) is stale all the same once its lock is free
    live = tmp_path / ".out.reshard-tmp-1"
    live.mkdir()
    write_checkpoint(src, out, MESH, progress=False)
    assert not theirs.exists() and not live.exists()
    assert_complete(out, src, 4)
    assert beside(out) == []


def test_only_the_temporaries_of_this_out_are_cleaned(tiny, tmp_path):
    """An OUT whose name is a glob pattern must not match another OUT's temporaries."""
    src = tiny("qwen3_moe", experts=2)
    other = tmp_path / ".mixtral.reshard-tmp-123"
    other.mkdir()
    write_checkpoint(src, tmp_path / "m*", MESH, progress=False)
    assert other.is_dir()
    assert_complete(tmp_path / "m*", src, 4)


# ---- dtypes reshard cannot split ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_sub_byte_dtype_is_refused_at_plan_time(tiny, tmp_path, dtype):
    src = tmp_path / "src"
    shutil.copytree(tiny("qwen3_moe", experts=2), src)
    path = src / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    key = "model.norm.weight"  # replicated: today it is planned, and its header claims bytes never written
    info = header[key]
    begin = info["data_offsets"][0]
    bits = {"F4": 4}.get(dtype, 6)
    end = begin + math.ceil(math.prod(info["shape"]) * bits / 8)  # the packed size a valid header states
    header[key] = {**info, "dtype": dtype, "data_offsets": [begin, end]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])

    result = CliRunner().invoke(cli, ["plan", str(src), "--fsdp", "4"])
    assert result.exit_code == 1
    assert f"entry {key!r} has dtype {dtype}" in result.output and "sub-byte" in result.output
    assert "Traceback" not in result.output
    out = tmp_path / "out"
    result = write_cli(src, out, "--fsdp", "4")
    assert result.exit_code == 1 and "sub-byte" in result.output
    assert not out.exists() and beside(out) == []


def test_unknown_and_sub_byte_dtypes_name_the_entry():
    for dtype, fragment in (("F4", "sub-byte"), ("F3", "does not know")):
        with pytest.raises(CheckpointError, match=fragment) as info:
            parse_header(json.dumps({"w": {"dtype": dtype, "shape": [8], "data_offsets": [0, 4]}}).encode(),
                         file="x.safetensors", file_size=None)
        assert "x.safetensors" in str(info.value) and "'w'" in str(info.value)
