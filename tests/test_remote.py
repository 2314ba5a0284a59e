"""Sources read in ranges: S3 (a real SeaweedFS server on 127.0.0.1, tests/s3_server.py) and the Hub with `--stream`
(the local Hub, tests/hub_server.py). Byte identity with the same commands on a local copy, requests per rank and per
file, faults (transient errors retried, a server that goes away)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.api import write_checkpoint
from reshard.plan import MeshSpec
from reshard.read import _content as content
from reshard.read import DEPTH, RANGE
from reshard.read import _ranges as coalesced

from conftest import rank_reports, run_ranks

REPO = Path(__file__).resolve().parents[1]
MESH = MeshSpec(fsdp=4)


def cli(server, *args, env=None, timeout=180, access_key="cli"):
    """`python -m reshard ARGS` against `server` (its environment: endpoint, a key of its own)."""
    full = {**server.environ(access_key), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RESHARD_CACHE_DIR": "",
            **(env or {})}
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          env=full, timeout=timeout)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def same_folders(a: Path, b: Path) -> None:
    """Every rank file byte-identical, and the manifests' tensor and file records equal (only `source` differs)."""
    first, second = files_of(a), files_of(b)
    assert first.keys() == second.keys()
    for name in first:
        if name != "reshard.json":
            assert first[name] == second[name], name
    one, two = (json.loads(f["reshard.json"]) for f in (first, second))
    for key in ("tensors", "order", "files", "coords", "mesh", "copied", "source_layout"):
        assert one.get(key) == two.get(key), key


@pytest.fixture
def uploaded(s3, tiny, tmp_path):
    """A tiny checkpoint and its reshard folder (fsdp 4) in a fresh bucket: (local src, local folder, urls)."""
    src = tiny("qwen3_moe", experts=6)
    folder = tmp_path / "folder"
    write_checkpoint(src, folder, MESH, progress=False)
    bucket = s3.new_bucket("up")
    s3.put_folder(src, f"s3://{bucket}/src")
    s3.put_folder(folder, f"s3://{bucket}/folder")
    s3.clear_log()
    return src, folder, {"src": f"s3://{bucket}/src", "folder": f"s3://{bucket}/folder", "bucket": bucket}


# ---- plan, write, verify, merge from S3 -----------------------------------------------------------------------------

def test_plan_from_s3_reads_headers_only_and_equals_the_local_plan(s3, uploaded):
    src, _, url = uploaded
    remote = cli(s3, "plan", url["src"], "--fsdp", 4, "--json")
    assert remote.returncode == 0, remote.stderr
    local = cli(s3, "plan", src, "--fsdp", 4, "--json")
    doc, ref = json.loads(remote.stdout), json.loads(local.stdout)
    assert {**doc, "source": None} == {**ref, "source": None}
    gets = s3.requests(method="GET", key="src/model.safetensors")
    assert [r.range for r in gets] == ["bytes=0-65535"]  # one request: the header, not a byte of data past it


def test_write_from_s3_is_byte_identical_to_the_local_write_in_few_requests(s3, uploaded, tmp_path):
    src, _, url = uploaded
    result = cli(s3, "write", url["src"], tmp_path / "remote", "--fsdp", 4, "-q")
    assert result.returncode == 0, result.stderr
    write_checkpoint(src, tmp_path / "local", MESH, progress=False)
    same_folders(tmp_path / "remote", tmp_path / "local")
    data = [r for r in s3.requests(method="GET", key="src/model.safetensors") if r.range != "bytes=0-65535"]
    assert all(r.status == 206 for r in data)
    # The 4 rank files are filled together: the source is read front to back, each byte once, in as few requests as
    # the file's size needs (one here: the data is under a range), not once per rank file in the pieces each needs.
    # (Apart from the write identity's few samples of the data: `reshard.read._content`.)
    ranges = sorted(tuple(map(int, r.range.removeprefix("bytes=").split("-"))) for r in data)
    spans = [(start, end) for start, end in ranges if end + 1 - start != content.SAMPLE_BYTES]
    assert len(ranges) - len(spans) == content.SAMPLES, ranges
    assert all(end < start for (_, end), (start, _) in zip(spans, spans[1:])), spans
    data_bytes = (src / "model.safetensors").stat().st_size
    assert len(spans) == -(-data_bytes // RANGE), spans
    verify = cli(s3, "verify", tmp_path / "remote", "--against", url["src"])
    assert verify.returncode == 0 and "equal to s3://" in verify.stdout, verify.stderr


@pytest.mark.slow  # the one-process write from S3 is in the default tests
@pytest.mark.parametrize("how", ["workers", "torchrun"])
def test_a_parallel_write_from_s3_is_the_same_bytes(s3, uploaded, tmp_path, how):
    src, _, url = uploaded
    write_checkpoint(src, tmp_path / "local", MESH, progress=False)
    out = tmp_path / how
    if how == "workers":
        result = cli(s3, "write", url["src"], out, "--fsdp", 4, "--workers", 2, "-q")
    else:
        full = {**s3.environ("torchrun"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "reshard", "write", url["src"], str(out), "--fsdp", "4", "-q"],
                                capture_output=True, text=True, env=full, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    same_folders(out, tmp_path / "local")


@pytest.mark.slow  # dequantizing is in the default tests locally (test_quantized.py)
def test_a_dequantizing_write_from_s3_is_the_local_one_in_ranges(s3, tiny, tmp_path):
    """`--dequantize bf16` from a block-scaled FP8 checkpoint in S3: the same bytes as from the local copy, every
    data request ranged, nothing downloaded whole (each weight file is fetched at most once over)."""
    from reshard.tiny import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny("qwen3_moe", experts=4, dtype="bfloat16"), tmp_path / "fp8", method="fp8",
                              block=(16, 16))
    url = f"s3://{s3.new_bucket('fp8')}/fp8"
    s3.put_folder(fp8, url)
    s3.clear_log()
    result = cli(s3, "write", url, tmp_path / "remote", "--fsdp", 4, "--dequantize", "bf16", "-q")
    assert result.returncode == 0, result.stderr
    write_checkpoint(fp8, tmp_path / "local", MESH, dequantize="bf16", progress=False)
    same_folders(tmp_path / "remote", tmp_path / "local")
    tensors = json.loads((tmp_path / "remote" / "reshard.json").read_text())["tensors"]
    assert any("dequantized_from" in t for t in tensors.values())  # computed from FP8, not copied
    for path in fp8.glob("*.safetensors"):
        gets = s3.requests(method="GET", key=f"fp8/{path.name}")
        assert gets and all(r.range and r.status == 206 for r in gets), gets
        assert sum(r.sent for r in gets) <= 2 * path.stat().st_size, (path.name, [r.range for r in gets])


def test_mesh_to_mesh_and_merge_from_an_s3_reshard_folder_check_its_crcs(s3, uploaded, tmp_path):
    src, folder, url = uploaded
    result = cli(s3, "write", url["folder"], tmp_path / "fsdp2", "--fsdp", 2, "-q", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["source_crc32_checked"] is True
    write_checkpoint(folder, tmp_path / "local-fsdp2", MeshSpec(fsdp=2), progress=False)
    same_folders(tmp_path / "fsdp2", tmp_path / "local-fsdp2")
    merged = cli(s3, "merge", url["folder"], tmp_path / "merged", "-q", "--json")
    assert merged.returncode == 0, merged.stderr
    assert cli(s3, "verify", tmp_path / "merged", "--against", src).returncode == 0


def test_a_flipped_byte_in_an_s3_reshard_folder_is_refused(s3, uploaded, tmp_path):
    _, folder, url = uploaded
    name = "shard-00002-model-00001-of-00001.safetensors"
    s3.put_bytes(f"{url['folder']}/{name}", flipped(folder, name))
    result = cli(s3, "merge", url["folder"], tmp_path / "merged", "-q")
    assert result.returncode == 1 and name in result.stderr and "CRC-32" in result.stderr, result.stderr
    assert not (tmp_path / "merged").exists()


# ---- faults ---------------------------------------------------------------------------------------------------------

def test_transient_errors_are_retried_and_then_named(s3, uploaded, tmp_path):
    _, _, url = uploaded
    s3.fail_next(2, status=503)
    result = cli(s3, "plan", url["src"], "--fsdp", 4)
    assert result.returncode == 0, result.stderr  # the third try of the first request went through
    s3.fail_next(50, status=500)
    result = cli(s3, "write", url["src"], tmp_path / "out", "--fsdp", 4, "-q")
    assert result.returncode == 1, result.stderr
    assert "failed after 4 attempts" in result.stderr and url["src"].split("/")[2] in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# ---- ranges in flight: runs longer than a range, a range that fails mid-overlap ----------------------------------

SMALL_RANGE = 1000  # far below every expert tensor of the tiny checkpoint: each is fetched in several ranges


def _failing_range(monkeypatch, store_cls, *, after: int) -> list[int]:
    """Make every try of the ranged read that starts at the `after`-th data offset seen fail as a reset connection
    would (transient: retried to the limit, quickly); the offsets asked for are returned as they come."""
    import reshard.read._remote as remote

    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    original, seen, doomed = store_cls._get_into, [], []

    def get_into(self, name, path, start, view):
        if start > 0 and start not in seen:
            seen.append(start)
        if len(seen) >= after and not doomed:
            doomed.append(seen[after - 1])
        if doomed and start == doomed[0]:
            raise ConnectionResetError("connection reset by the test")
        return original(self, name, path, start, view)

    monkeypatch.setattr(store_cls, "_get_into", get_into)
    return seen


def _fetch_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(("reshard-fetch", "reshard-range"))]


def test_a_write_from_s3_in_ranges_shorter_than_its_runs_is_the_local_write(s3, uploaded, tmp_path, monkeypatch):

    src, _, url = uploaded
    monkeypatch.setattr(coalesced, "RANGE", SMALL_RANGE)
    write_checkpoint(url["src"], tmp_path / "remote", MESH, progress=False)
    write_checkpoint(src, tmp_path / "local", MESH, progress=False)
    same_folders(tmp_path / "remote", tmp_path / "local")
    from reshard.read._content import SAMPLE_BYTES, SAMPLES

    data = [r for r in s3.requests(method="GET", key="src/model.safetensors") if r.range != "bytes=0-65535"]
    lengths = [int(b) - int(a) + 1 for a, b in (r.range.removeprefix("bytes=").split("-") for r in data)]
    assert lengths.count(SAMPLE_BYTES) >= SAMPLES  # the write identity's samples of the data (read.content)
    fill = [n for n in lengths if n != SAMPLE_BYTES]
    assert max(fill) == SMALL_RANGE and len(fill) > 4 * (DEPTH + 1), lengths  # many ranges, in flight
    assert _fetch_threads() == []


def test_a_range_failing_mid_overlap_leaves_nothing_and_no_thread(s3, uploaded, tmp_path, monkeypatch):
    from reshard.errors import CheckpointError
    import reshard.read._remote as remote

    _, _, url = uploaded
    monkeypatch.setattr(coalesced, "RANGE", SMALL_RANGE)
    seen = _failing_range(monkeypatch, remote.S3Store, after=DEPTH + 3)  # ranges before and after it in flight
    out = tmp_path / "models" / "out"
    out.parent.mkdir()
    with pytest.raises(CheckpointError, match=r"failed after 4 attempts \(ConnectionResetError.*Nothing was kept"):
        write_checkpoint(url["src"], out, MESH, progress=False)
    assert len(seen) > DEPTH + 3  # the failing range was one of several in flight
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert _fetch_threads() == []


def test_a_load_from_s3_in_small_ranges_is_exact_and_a_failing_range_stops_it(s3, uploaded, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    import reshard
    import reshard.read._remote as remote
    import reshard.read._range_file as store
    from reshard.errors import ReshardError

    src, _, url = uploaded
    monkeypatch.setattr(store, "RANGE", SMALL_RANGE)
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    model = reshard.from_pretrained(url["folder"])
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
    assert _fetch_threads() == []
    _failing_range(monkeypatch, remote.S3Store, after=store.DEPTH + 3)
    with pytest.raises(ReshardError, match=r"failed after 4 attempts \(ConnectionResetError"):
        reshard.from_pretrained(url["folder"])
    assert _fetch_threads() == []


def test_a_file_read_ahead_fetches_each_expected_byte_once(s3):
    """RangeFile against the server's log: the expected ranges (two touching, then one after a gap) come in requests
    of at most the block, each byte once, none outside them; a read elsewhere is one request of exactly it. (A wrong
    read-ahead offset once gave the right bytes in 25 requests instead of 11, 1.9x the bytes, and passed every
    default test.)"""
    import random

    from reshard.read import locate
    from reshard.read._range_file import RangeFile

    data = random.Random(61).randbytes(100_000)
    bucket = s3.new_bucket("ahead")
    s3.put_bytes(f"s3://{bucket}/f/blob.safetensors", data)
    store = locate(f"s3://{bucket}/f", data=False).store
    expected = [(8, 30_000), (30_000, 55_000), (60_001, 100_000)]
    s3.clear_log()
    with RangeFile(store, "blob.safetensors", block=7_000, depth=3) as fh:
        fh.expect(expected)
        for start, end in expected:
            fh.seek(start)
            assert fh.read(end - start) == data[start:end], (start, end)
        fh.seek(55_000)
        assert fh.read(5_001) == data[55_000:60_001]  # not expected: exactly what is asked
    asked = sorted(tuple(int(x) for x in r.range.removeprefix("bytes=").split("-"))
                   for r in s3.requests(method="GET", key="f/blob.safetensors"))
    pieces = [(o, min(o + 7_000, 55_000) - 1) for o in range(8, 55_000, 7_000)]
    pieces += [(o, min(o + 7_000, 100_000) - 1) for o in range(60_001, 100_000, 7_000)]
    assert asked == sorted(pieces + [(55_000, 60_000)]), asked
    assert sum(r.sent for r in s3.requests(method="GET", key="f/blob.safetensors")) == 100_000 - 8


READ_BLOCK = 10007  # the largest single GET lowered far below every range and run: each read is several requests, the
# last of each read shorter than the others (a prime: it divides no tensor's bytes)


def test_reads_longer_than_a_request_land_in_place_for_write_and_load(s3, uploaded, tmp_path, monkeypatch):
    """A read longer than `READ_BLOCK` (a fetched range, a file read ahead, a CRC pass) is split into several GETs,
    each written into its own part of the buffer: the write and the load from S3 equal the local ones byte for byte
    (the ranges of `fetch` and `range_file` stay at their sizes, so every read of data is split)."""
    import torch

    import reshard
    import reshard.read._remote as remote

    src, folder, url = uploaded
    monkeypatch.setattr(remote, "READ_BLOCK", READ_BLOCK)
    write_checkpoint(url["src"], tmp_path / "remote", MESH, progress=False)
    write_checkpoint(src, tmp_path / "local", MESH, progress=False)
    same_folders(tmp_path / "remote", tmp_path / "local")
    reference = reshard.from_pretrained(folder).state_dict()
    s3.clear_log()
    model = reshard.from_pretrained(url["folder"])
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
    name = min(p.name for p in folder.glob("shard-*.safetensors"))
    lengths = [int(b) - int(a) + 1 for a, b in (r.range.removeprefix("bytes=").split("-")
                                                for r in s3.requests(method="GET", key=f"folder/{name}"))]
    assert max(lengths) == READ_BLOCK and len(lengths) > 10, lengths  # the patched size is the one in use
    assert _fetch_threads() == []


# ---- loading from S3 ------------------------------------------------------------------------------------------------

def flipped(folder: Path, name: str) -> bytes:
    """The bytes of `folder/name` with one bit of its last tensor's data flipped (the header is intact)."""
    data = bytearray((folder / name).read_bytes())
    data[-5] ^= 0x10
    return bytes(data)


@pytest.mark.multirank
def test_a_flipped_byte_in_a_rank_file_fails_a_load_from_s3_on_every_rank(s3, uploaded, tmp_path):
    """The CRC-32 of every rank file is checked as a load from S3 reads it (a mutant that skipped it for remote
    files passed every default test): rank 1's file is corrupt, and both ranks stop naming it."""
    src, _, url = uploaded
    folder = tmp_path / "fsdp2"
    write_checkpoint(src, folder, MeshSpec(fsdp=2), progress=False)
    target = f"s3://{url['folder'].split('/')[2]}/flipped"
    s3.put_folder(folder, target)
    name = "shard-00002-model-00001-of-00001.safetensors"
    s3.put_bytes(f"{target}/{name}", flipped(folder, name))
    reports = tmp_path / "reports"
    reports.mkdir()
    result = run_ranks("load_remote.py", 2, target, src, reports, env=s3.environ("ranks"), timeout=180, check=False)
    assert result.returncode != 0
    for report in rank_reports(reports, 2):
        assert report["error"].startswith("LoadError"), report
        assert f"rank 1: {name} is corrupt (CRC-32" in report["error"], report["error"]
        assert report["seconds"] < 60, report


@pytest.mark.slow  # 4-rank loads from S3
@pytest.mark.multirank
def test_a_4_rank_load_from_s3_is_exact_and_each_rank_reads_only_its_own_files(s3, uploaded, tmp_path):
    src, folder, url = uploaded
    reports = tmp_path / "reports"
    reports.mkdir()
    run_ranks("load_remote.py", 4, url["folder"], src, reports, env=s3.environ("ranks"), timeout=300)
    manifest = json.loads((folder / "reshard.json").read_text())
    for report in rank_reports(reports, 4):
        assert "error" not in report, report.get("traceback")
        assert report["mismatched"] == [] and report["tensors"] == 25
        rank = report["rank"]
        own = set(manifest["coords"][rank]["files"])
        gets = [r for r in s3.requests(access_key=f"rank{rank}", method="GET") if r.key.startswith("folder/shard-")]
        touched = {r.key.rsplit("/", 1)[-1] for r in gets}
        assert touched == own, (rank, touched)
        # every byte of its files fetched once; the headers twice (the ranks' agreement, the reader's check), each
        # as its 8-byte prefix and the header alone, never a block of data dropped
        heads = [r for r in gets if r.range.startswith(("bytes=0-", "bytes=8-"))]
        assert [r.range for r in heads[:2]] == ["bytes=0-7", f"bytes=8-{heads[1].sent + 7}"], rank
        sizes = sum((folder / name).stat().st_size for name in own)
        assert sum(r.sent for r in gets) == sizes + sum(r.sent for r in heads) // 2, [(r.range, r.sent) for r in gets]


def test_a_one_process_load_and_the_storage_reader_read_s3(s3, uploaded):
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    import reshard

    src, _, url = uploaded
    reference = AutoModelForCausalLM.from_pretrained(src, use_kernels=False).state_dict()
    model = reshard.from_pretrained(url["folder"])
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
    state = {n: torch.zeros_like(t) for n, t in reference.items()}
    reader = reshard.StorageReader(url["folder"])
    dcp.load(state, storage_reader=reader)
    assert all(torch.equal(state[n], reference[n]) for n in reference)


@pytest.mark.slow  # 4-rank loads from S3
@pytest.mark.multirank
def test_a_server_that_goes_away_mid_load_stops_every_rank_with_one_error(tiny, tmp_path):
    """Its own server (killing the session's would break later tests): every rank raises the same LoadError, in
    under 60 s."""
    from s3_server import S3Server

    src = tiny("qwen3_moe", experts=6)
    write_checkpoint(src, tmp_path / "folder", MESH, progress=False)
    server = S3Server.start()
    try:
        bucket = server.new_bucket("gone")
        server.put_folder(tmp_path / "folder", f"s3://{bucket}/folder")
        # rank 2's first request for its file hangs, so the load is surely under way when the server goes
        server.stall_next(1, 30, key="folder/shard-00003-model-00001-of-00001.safetensors")
        reports = tmp_path / "reports"
        reports.mkdir()
        env = server.environ("ranks")
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=4", "--monitor-interval=0.5",
                                 str(REPO / "tests" / "ranks" / "load_remote.py"), f"s3://{bucket}/folder", str(src),
                                 str(reports)], env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while not [r for r in server.requests(method="GET", wait=0) if "/shard-" in r.key]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1)
        killed = time.monotonic()
        server.kill()
        out, err = proc.communicate(timeout=120)
        stopped = time.monotonic() - killed
    finally:
        server.stop()
    assert proc.returncode != 0
    errors = {r["rank"]: r.get("error") for r in rank_reports(reports, 4)}
    assert all(errors.values()), errors
    assert len(set(errors.values())) == 1 and "LoadError" in errors[0], errors
    assert stopped < 60, stopped


@pytest.mark.slow  # a server of its own, killed mid-write
def test_a_server_that_goes_away_mid_write_leaves_out_as_it_was(tiny, tmp_path):
    """Its own server: `write --overwrite` over an existing OUT, the server killed while a data request hangs; the
    command fails naming the URL, and OUT is the old folder, byte for byte, with no temporary beside it."""
    from s3_server import S3Server

    src = tiny("qwen3_moe", experts=6)
    out = tmp_path / "models" / "out"
    write_checkpoint(src, out, MeshSpec(fsdp=2), progress=False)
    before = files_of(out)
    server = S3Server.start()
    try:
        bucket = server.new_bucket("gone")
        server.put_folder(src, f"s3://{bucket}/src")
        env = {**server.environ("cli"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RESHARD_CACHE_DIR": ""}
        proc = subprocess.Popen([sys.executable, "-m", "reshard", "write", f"s3://{bucket}/src", str(out), "--fsdp", "4",
                                 "--overwrite", "-q"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 120
        while not server.requests(method="GET", key="src/model.safetensors", wait=0):  # its header, read
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        # the next request of the file, for data, hangs (the model's layout takes seconds to build before it)
        server.stall_next(1, 60, key="src/model.safetensors")
        time.sleep(8)
        server.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        server.stop()
    assert proc.returncode == 1 and "failed after" in err and f"s3://{bucket}/src" in err, err
    assert files_of(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temporary, no lock left beside it
