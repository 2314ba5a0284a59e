"""Header reading and validation (`reshard.read._checkpoint`) over hand-built safetensors files, and Hub sources.

Every malformed input must raise `CheckpointError` naming the file (and the entry, where there is one); nothing
here reads tensor data, and nothing touches the network (Hub tests run offline against a hand-built cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import examples
from reshard.read import INDEX_NAME
from reshard.read import MAX_HEADER_BYTES, parse_header
from reshard.read._safetensors_header import read_header
from reshard.read._source import read_checkpoint
from reshard.errors import CheckpointError, ReshardError

REPO_ROOT = Path(__file__).resolve().parents[1]
FILE_1 = "model-00001-of-00002.safetensors"
FILE_2 = "model-00002-of-00002.safetensors"


# ---- helpers ------------------------------------------------------------------------------------------------------

def write_raw(path: Path, header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    """A safetensors file byte by byte: 8-byte little-endian length, the header, then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def f32(shape, begin):
    n = 4
    for d in shape:
        n *= d
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, begin + n]}


def sharded_folder(root: Path) -> Path:
    """Two files and an index, like `save_pretrained` with a small max_shard_size."""
    root.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(4, dtype=torch.int64)},
              str(root / FILE_1), metadata={"format": "pt"})
    save_file({"c": torch.ones(5, dtype=torch.bfloat16)}, str(root / FILE_2), metadata={"format": "pt"})
    write_index(root, {"a": FILE_1, "b": FILE_1, "c": FILE_2})
    (root / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (root / "tokenizer.json").write_text("{}")
    return root


def write_index(root: Path, weight_map: dict) -> None:
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def raises(source, *fragments: str) -> CheckpointError:
    with pytest.raises(CheckpointError, match=re.escape(fragments[0])) as info:
        read_checkpoint(source)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


# ---- valid sources ------------------------------------------------------------------------------------------------

def test_sharded_folder_headers_match_the_bytes(tmp_path):
    root = sharded_folder(tmp_path / "ckpt")
    index = read_checkpoint(root)

    assert index.root == root and index.revision is None and index.config == {"model_type": "toy"}
    assert [h.name for h in index.files] == [FILE_1, FILE_2]
    assert {k: (t.file, t.dtype, t.shape) for k, t in index.tensors.items()} == {
        "a": (FILE_1, "F32", (2, 3)), "b": (FILE_1, "I64", (4,)), "c": (FILE_2, "BF16", (5,))}
    assert index.other_files == ("config.json", "tokenizer.json")
    assert index.total_bytes == 24 + 32 + 10
    # data_start is absolute: the bytes there are the tensor's own
    for key, entry in index.tensors.items():
        blob = (root / entry.file).read_bytes()[entry.data_start:entry.data_start + entry.nbytes]
        with safe_open(str(root / entry.file), framework="pt") as f:
            assert blob == f.get_tensor(key).view(torch.uint8).numpy().tobytes()
            assert index.files[[h.name for h in index.files].index(entry.file)].metadata == f.metadata()


def test_header_length_and_digest_are_pinned(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "x": f32([2], 0)}
    raw = json.dumps(header).encode()
    path = write_raw(tmp_path / "x.safetensors", raw, b"\0" * 8)
    parsed = read_header(path)
    assert parsed.header_bytes == 8 + len(raw)
    assert parsed.size == 8 + len(raw) + 8
    assert parsed.metadata == {"format": "pt"}
    assert parsed.tensors[0].data_start == 8 + len(raw)
    assert parsed.digest == hashlib.sha256(raw).hexdigest()


def test_single_safetensors_file_source(tmp_path):
    save_file({"w": torch.zeros(3, 4), "v": torch.zeros(2, dtype=torch.float16)}, str(tmp_path / "weights.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))

    index = read_checkpoint(str(tmp_path / "weights.safetensors"))
    assert index.source == str(tmp_path / "weights.safetensors")
    assert index.root == tmp_path
    assert [h.name for h in index.files] == ["weights.safetensors"]
    assert {k: t.shape for k, t in index.tensors.items()} == {"w": (3, 4), "v": (2,)}
    assert index.config == {"model_type": "toy"}


def test_folder_without_index_reads_every_file(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "part1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "part2.safetensors"))
    index = read_checkpoint(tmp_path)
    assert {k: t.file for k, t in index.tensors.items()} == {"a": "part1.safetensors", "b": "part2.safetensors"}


def test_symlink_inside_the_folder_is_accepted(tmp_path):
    root = sharded_folder(tmp_path / "ckpt")
    (root / "real").mkdir()
    shutil.move(root / FILE_2, root / "real" / FILE_2)
    (root / FILE_2).symlink_to(Path("real") / FILE_2)
    assert read_checkpoint(root).tensors["c"].file == FILE_2


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    raises(str(tmp_path / "weights.bin"), "weights.bin", "not a .safetensors file")


def test_missing_source_folder(tmp_path):
    raises(tmp_path / "absent", str(tmp_path / "absent"), "no such file or folder")


def test_folder_with_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    raises(tmp_path, str(tmp_path), "no .safetensors files")


# ---- the index is validated before any name in it is trusted ------------------------------------------------------

@pytest.mark.parametrize("entry, fragment", [
    ("../x.safetensors", "leaves the checkpoint folder"),
    ("ABS", "leaves the checkpoint folder"),
    ("x.bin", "only .safetensors files are supported"),
    ("missing.safetensors", "does not exist"),
])
def test_bad_index_entries(tmp_path, entry, fragment):
    root = sharded_folder(tmp_path / "ckpt")
    save_file({"c": torch.ones(5, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))  # ckpt/../x.safetensors
    if entry == "ABS":
        entry = str(tmp_path / "x.safetensors")  # an existing file: refused for its path, not for being missing
        assert os.path.isabs(entry)
    (root / "x.bin").write_bytes(b"\0" * 8)
    write_index(root, {"a": FILE_1, "b": FILE_1, "c": entry})

    error = raises(root, INDEX_NAME, "'c'", repr(entry), fragment)
    assert isinstance(error, ValueError) and isinstance(error, ReshardError)


def test_index_symlink_out_of_the_folder(tmp_path):
    root = sharded_folder(tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(root / FILE_2, outside)
    (root / FILE_2).symlink_to(outside)
    raises(root, INDEX_NAME, "'c'", FILE_2, "link out of the checkpoint folder")


def test_unindexed_symlink_out_of_the_folder(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    raises(tmp_path / "ckpt", "model.safetensors", "link out of the checkpoint folder")


def test_index_names_a_key_its_file_lacks(tmp_path):
    root = sharded_folder(tmp_path / "ckpt")
    write_index(root, {"a": FILE_1, "b": FILE_1, "c": FILE_2, "ghost": FILE_2})
    raises(root, INDEX_NAME, "'ghost'", FILE_2, "does not hold it")


def test_index_points_a_key_at_the_wrong_file(tmp_path):
    root = sharded_folder(tmp_path / "ckpt")
    write_index(root, {"a": FILE_1, "b": FILE_1, "c": FILE_1})
    raises(root, INDEX_NAME, "'c'", FILE_1, "does not hold it")


def test_index_that_is_not_json(tmp_path):
    root = sharded_folder(tmp_path / "ckpt")
    (root / INDEX_NAME).write_text("{weight_map:")
    raises(root, INDEX_NAME, "not a valid safetensors index")


def test_tensor_in_two_files(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "p1.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "p2.safetensors"))
    raises(tmp_path, "'a'", "p1.safetensors", "p2.safetensors", "appears in both")


# ---- malformed files ----------------------------------------------------------------------------------------------

def test_truncated_data(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(16, 16)}, str(path))
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    raises(tmp_path, "model.safetensors", f"describes {size} bytes but the file has {size - 100}", "truncated")


def test_length_prefix_larger_than_the_file(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"w": f32([1], 0)}, b"\0" * 4, length=5000)
    raises(tmp_path, "model.safetensors", "says 5000 bytes", "truncated or not a safetensors file")


def test_length_prefix_over_the_cap(tmp_path):
    # a sparse file larger than the claimed header: only the cap can refuse it, and nothing is read past 8 bytes
    path = write_raw(tmp_path / "model.safetensors", b"{}", length=MAX_HEADER_BYTES + 1)
    with open(path, "r+b") as f:
        f.truncate(MAX_HEADER_BYTES + 4096)
    raises(tmp_path, "model.safetensors", str(MAX_HEADER_BYTES + 1), str(MAX_HEADER_BYTES), "cap")


def test_file_shorter_than_the_length_prefix(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\0\0")
    raises(tmp_path, "model.safetensors", "3 bytes", "too few")


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
])
def test_header_that_is_not_a_json_object(tmp_path, raw, fragment):
    write_raw(tmp_path / "model.safetensors", raw)
    raises(tmp_path, "model.safetensors", fragment)


def test_unknown_dtype(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    raises(tmp_path, "model.safetensors", "'w'", "'F33'", "does not know")


def test_offsets_inconsistent_with_shape(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}},
              b"\0" * 24)
    raises(tmp_path, "model.safetensors", "'w'", "holds 20 bytes", "F32 [2, 3] needs 24")


def test_overlapping_tensors(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"a": f32([4], 0), "b": f32([4], 8)}, b"\0" * 24)
    raises(tmp_path, "model.safetensors", "'b'", "overlaps")


def test_entry_without_offsets(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4)
    raises(tmp_path, "model.safetensors", "'w'", "lacks dtype, shape or data_offsets")


@pytest.mark.parametrize("header", [
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}},
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}},
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}},
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}},
    {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
    {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}},
    {"w": [1, 2]},
])
def test_malformed_entries_name_the_entry(header):
    with pytest.raises(CheckpointError, match="bad.safetensors") as info:
        parse_header(json.dumps(header).encode(), file="bad.safetensors", file_size=None)
    assert "bad.safetensors" in str(info.value) and "'w'" in str(info.value)


@pytest.mark.parametrize("metadata", [[1, 2], {"format": 1}, "pt"])
def test_metadata_must_be_a_string_map(metadata):
    with pytest.raises(CheckpointError, match="bad.safetensors.*__metadata__"):
        parse_header(json.dumps({"__metadata__": metadata}).encode(), file="bad.safetensors", file_size=None)


_scalars = (st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False) | st.text(max_size=4)
            | st.sampled_from(["F32", "BF16", "U8", "dtype", "shape", "data_offsets"]))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["dtype", "shape", "data_offsets", "x", "__metadata__"]), inner, max_size=4), max_leaves=12)


@settings(max_examples=examples(300), deadline=None)
@given(header=st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), _json, max_size=3),
       size=st.none() | st.integers(0, 10**6))
def test_any_json_header_parses_or_raises_checkpoint_error(header, size):
    try:
        parsed = parse_header(json.dumps(header).encode(), file="f.safetensors", file_size=size)
    except CheckpointError as e:
        assert "f.safetensors" in str(e)
    else:
        assert {t.name for t in parsed.tensors} == set(header) - {"__metadata__"}


# ---- metadata only: tensor data is never read ---------------------------------------------------------------------

def test_read_checkpoint_reads_exactly_the_headers(tmp_path, monkeypatch):
    """Every byte a local source serves passes `LocalStore.readinto`: counted there, it is the prefix and the JSON
    header of each file, not one byte of data (the syscall test below checks the same from outside)."""
    import mmap

    from reshard.read import LocalStore

    root = sharded_folder(tmp_path / "ckpt")
    expected = {name: read_header(root / name).header_bytes for name in (FILE_1, FILE_2)}
    counts: dict[str, int] = {}
    real_readinto = LocalStore.readinto

    def counting_readinto(self, name, start, view):
        if name.endswith(".safetensors"):
            counts[name] = counts.get(name, 0) + len(view)
        return real_readinto(self, name, start, view)

    def no_mmap(*args, **kwargs):
        raise AssertionError("read_checkpoint mapped a file")

    monkeypatch.setattr(LocalStore, "readinto", counting_readinto)
    monkeypatch.setattr(mmap, "mmap", no_mmap)
    monkeypatch.setattr("safetensors.safe_open", no_mmap)
    read_checkpoint(root)
    assert counts == expected  # 8-byte prefix + JSON header per file, not one byte of data


_RCHAR_SCRIPT = r"""
import json, mmap, sys
def rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])
from reshard.read._source import read_checkpoint
def refuse(*a, **k):
    raise AssertionError("mmap")
mmap.mmap = refuse
rchar()
before = rchar()
index = read_checkpoint(sys.argv[1])
after = rchar()
print(json.dumps({"read": after - before, "headers": sum(h.header_bytes for h in index.files),
                  "data": index.total_bytes}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="the kernel's per-process read counter is Linux-only")
def test_read_checkpoint_syscall_bytes_are_headers_only(tmp_path):
    """Whatever read path the code takes (read, readinto, os.read), the kernel counts it: 512 MiB stay unread."""
    root = tmp_path / "big"
    root.mkdir()
    half = 256 * 2**20
    for i, name in enumerate((FILE_1, FILE_2)):
        path = write_raw(root / name, {"__metadata__": {"format": "pt"},
                                       f"w{i}": {"dtype": "U8", "shape": [half], "data_offsets": [0, half]}})
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size + half)  # sparse: costs no disk
    write_index(root, {"w0": FILE_1, "w1": FILE_2})
    (root / "config.json").write_text("{}")
    result = subprocess.run([sys.executable, "-c", _RCHAR_SCRIPT, str(root)], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout)
    assert counts["data"] == 2 * half
    assert counts["headers"] <= counts["read"] < counts["headers"] + 64 * 1024, counts


# ---- Hub sources, offline, from a hand-built cache ----------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty huggingface-hub cache, offline, with sockets disabled; returns a function that caches a repo."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    # huggingface_hub reads these once, at import
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("a test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.chdir(tmp_path)  # so `org/name` is never a local path

    def cache_repo(repo_id: str, files: list[Path], *, links: bool = True) -> Path:
        """Lay out `files` as huggingface-hub does: blobs, links from snapshots/<commit>/, refs/main."""
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / COMMIT
        (repo / "blobs").mkdir(parents=True)
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
        for i, src in enumerate(files):
            if links:
                blob = repo / "blobs" / f"{i:040x}"
                shutil.copy(src, blob)
                (snapshot / src.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
            else:
                shutil.copy(src, snapshot / src.name)
        return snapshot

    return cache_repo


def _same_tensors(a, b) -> bool:
    return {k: (t.file, t.dtype, t.shape, t.data_start) for k, t in a.tensors.items()} == \
        {k: (t.file, t.dtype, t.shape, t.data_start) for k, t in b.tensors.items()}


@pytest.mark.parametrize("links", [True, False], ids=["blob-links", "copies"])
@pytest.mark.parametrize("need_data", [False, True])
def test_hub_repo_read_offline_from_the_cache(tiny, offline_hub, links, need_data):
    folder = tiny("qwen3_moe")
    snapshot = offline_hub("org/tiny-moe", sorted(p for p in folder.iterdir() if p.is_file()), links=links)

    index = read_checkpoint("org/tiny-moe", need_data=need_data)
    assert index.source == "org/tiny-moe"
    assert index.root is not None and index.root.resolve() == snapshot.resolve()
    assert index.config["model_type"] == "qwen3_moe"
    assert _same_tensors(index, read_checkpoint(folder))
    assert "config.json" in index.other_files


def test_hub_sharded_repo_with_index_and_blob_links(tmp_path, offline_hub):
    folder = sharded_folder(tmp_path / "src")
    offline_hub("org/sharded", sorted(p for p in folder.iterdir() if p.is_file()))
    index = read_checkpoint("org/sharded", revision=COMMIT, need_data=True)
    assert index.revision == COMMIT
    assert _same_tensors(index, read_checkpoint(folder))


def test_hub_link_out_of_the_repo_cache_is_still_refused(tmp_path, offline_hub):
    folder = sharded_folder(tmp_path / "src")
    snapshot = offline_hub("org/sneaky", sorted(p for p in folder.iterdir() if p.is_file()), links=False)
    (snapshot / FILE_2).unlink()
    (snapshot / FILE_2).symlink_to(folder / FILE_2)  # outside models--org--sneaky
    with pytest.raises(CheckpointError, match="link out of the checkpoint folder"):
        read_checkpoint("org/sneaky")


def test_hub_repo_not_cached_offline(offline_hub):
    with pytest.raises(CheckpointError, match="org/not-cached") as info:
        read_checkpoint("org/not-cached")
    message = str(info.value)
    assert "org/not-cached" in message
    assert "HF_HUB_OFFLINE" in message and "cache" in message
    assert "hf download org/not-cached" in message and "local folder" in message
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_hub_repo_with_only_metadata_cached_offline(tmp_path, offline_hub):
    """A snapshot with config.json but no weights: plan would fetch headers remotely, which offline cannot."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    folder = sharded_folder(tmp_path / "src")
    offline_hub("org/partial", [folder / "config.json"])
    with pytest.raises(CheckpointError, match="org/partial.*offline mode") as info:
        read_checkpoint("org/partial")
    assert isinstance(info.value.__cause__, OfflineModeIsEnabled)  # refused by huggingface-hub, not by our socket guard

    with pytest.raises(CheckpointError, match="no .safetensors files") as info:
        read_checkpoint("org/partial", need_data=True)
    message = str(info.value)
    assert "org/partial" in message and "no .safetensors files" in message and "HF_HUB_OFFLINE" in message
    assert "hf download org/partial" in message
