"""`write` and `merge` into a bucket prefix (`reshard.write._bucket`), on the real S3 server the suite runs (SeaweedFS,
tests/s3_server.py): objects byte-identical to the local output, multipart uploads with the marker last, refusals
before anything is read, and nothing left behind by a failure, a SIGTERM or a server that goes away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.api import merge_checkpoint, verify, write_checkpoint
from reshard.errors import OutputError, UsageError
from reshard.manifest import shard_file_name
from reshard.plan import MeshSpec
from reshard.write import _bucket as bucket_output
from reshard.write import _bucket_output as bucket_steps
from reshard.write._claim import CLAIM_NAME, Claim

from conftest import rank_reports, run_ranks

REPO = Path(__file__).resolve().parents[1]
SMALL_PART = 5 << 20  # S3's smallest part (SeaweedFS checks it too): a 10 MB file goes in 2 parts


def client(server):
    """An s3fs client of `server` with credentials of its own (a test may have removed the environment's)."""
    import s3fs
    from s3_server import SECRET

    return s3fs.S3FileSystem(key="checker", secret=SECRET, endpoint_url=server.url, skip_instance_cache=True)


def objects(server, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix`, by name, read straight from the server."""
    fs = client(server)
    listed = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    return {e["Key"].rsplit("/", 1)[-1]: fs.cat_file(f"{bucket}/{e['Key']}") for e in listed
            if not e["Key"].endswith("/")}


def open_uploads(server, bucket: str) -> list:
    """The multipart uploads in progress in `bucket`."""
    return client(server).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def until_held(server, running, why=lambda: "", *, seconds: float = 120) -> None:
    """Wait until `server` holds a stalled request, so whatever the test does next lands mid-upload; fail (with
    `why()`) if `running()` turns false first, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while not server.wait_held(0.1):
        assert running() and time.monotonic() < deadline, why()


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def cli(server, *args, access_key="cli", env_extra=None, **popen):
    env = {**server.environ(access_key), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RESHARD_CACHE_DIR": "",
           **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "reshard", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(bucket_output, "PART_BYTES", SMALL_PART)


@pytest.fixture
def folder(tiny, tmp_path):
    """A tiny checkpoint (embeddings of 10 MB) and its reshard folder at fsdp 4: (src, folder)."""
    src = tiny("qwen3_moe", experts=6, vocab_size=40_000)
    write_checkpoint(src, tmp_path / "folder", MeshSpec(fsdp=4), progress=False)
    return src, tmp_path / "folder"


def test_the_part_size_keeps_a_file_within_s3s_10000_parts():
    assert bucket_output.part_bytes(1) == bucket_output.part_bytes(160 * 10**9) == 16 << 20
    for size in (160 * 10**9 + 1, 700 * 10**9, 5 * 2**40):
        step = bucket_output.part_bytes(size)
        assert step % (1 << 20) == 0 and -(-size // step) <= 10_000 and -(-size // (step - (1 << 20))) > 10_000


# ---- merge into a bucket ------------------------------------------------------------------------------------------

def test_a_merge_into_a_bucket_is_the_local_merge_in_multipart_uploads_marker_last(s3, s3_bucket, folder, tmp_path,
                                                                                    small_parts):
    _, ckpt = folder
    merge_checkpoint(ckpt, tmp_path / "merged", max_shard_size=8_000_000, progress=False)
    s3.clear_log()
    merge_checkpoint(ckpt, f"s3://{s3_bucket}/merged", max_shard_size=8_000_000, progress=False)
    local = files_of(tmp_path / "merged")
    assert len([n for n in local if n.endswith(".safetensors")]) >= 3
    assert objects(s3, s3_bucket, "merged") == local
    log = s3.requests(bucket=s3_bucket, prefix="merged/")
    parts = [r for r in log if r.method == "PUT" and "partNumber=" in r.query]
    for name in (n for n in local if n.endswith(".safetensors")):
        sent = [r for r in parts if r.key == f"merged/{name}"]
        assert len(sent) == -(-len(local[name]) // SMALL_PART) and sum(r.received for r in sent) == len(local[name])
    completes = [r.started for r in log if r.method == "POST" and "uploadId=" in r.query]
    markers = [r.started for r in log if r.method == "PUT" and r.key in ("merged/config.json",
                                                                         "merged/model.safetensors.index.json")]
    assert len(completes) == len([n for n in local if n.endswith(".safetensors")]) and len(markers) == 2
    assert max(completes) < min(markers)  # the marker is written once every file is complete
    assert open_uploads(s3, s3_bucket) == []


def test_a_prefix_holding_a_checkpoint_needs_overwrite_and_stays_whole_until_every_part_is_sent(s3, s3_bucket, folder,
                                                                                                tmp_path):
    _, ckpt = folder
    url = f"s3://{s3_bucket}/merged"
    merge_checkpoint(ckpt, url, max_shard_size=8_000_000, progress=False)
    before = objects(s3, s3_bucket, "merged")
    s3.clear_log()
    with pytest.raises(OutputError, match=r"already holds .* objects\. Pass --overwrite"):
        merge_checkpoint(ckpt, url, progress=False)
    assert not [r for r in s3.requests() if r.method != "GET" and r.method != "HEAD" and "uploads" not in r.query
                and r.key != f"merged/{bucket_output.PROBE}"]
    s3.clear_log()
    merge_checkpoint(ckpt, url, overwrite=True, progress=False)  # 5 GB shards: one file now
    merge_checkpoint(ckpt, tmp_path / "one", progress=False)
    assert objects(s3, s3_bucket, "merged") == files_of(tmp_path / "one") != before  # the old parts removed
    log = s3.requests(bucket=s3_bucket, prefix="merged/")
    deletes = [r for r in log if r.method == "DELETE" and r.key == "merged/model.safetensors.index.json"]
    parts = [r for r in log if r.method == "PUT" and "partNumber=" in r.query]
    completes = [r for r in log if r.method == "POST" and "uploadId=" in r.query]
    claims = [r for r in log if r.method == "PUT" and r.key == f"merged/{CLAIM_NAME}"]
    # the claim record first, every part while the old checkpoint is whole, then its marker goes before any new
    # object appears; the record is removed last
    assert len(claims) == 2 and claims[0].started < min(r.started for r in parts)
    assert deletes and max(r.started for r in parts) < deletes[0].started < min(r.started for r in completes)
    changes = [r for r in log if r.method not in ("GET", "HEAD")]
    assert changes[-1].method == "DELETE" and changes[-1].key == f"merged/{CLAIM_NAME}"


def test_a_prefix_holding_other_objects_is_not_replaced(s3, s3_bucket, folder):
    s3.put_bytes(f"s3://{s3_bucket}/mine/notes.txt", b"keep me")
    with pytest.raises(OutputError, match=r"--overwrite replaces only a complete merge or reshard output, and it "
                                          r"holds notes\.txt and neither"):
        merge_checkpoint(folder[1], f"s3://{s3_bucket}/mine", overwrite=True, progress=False)
    assert objects(s3, s3_bucket, "mine") == {"notes.txt": b"keep me"}


FOREIGN = {"optimizer-state.pt": b"the optimizer", "NOTES.txt": b"my notes", "trainer_state.json": b"{}",
           "checkpoint-100/model.safetensors": b"a sub-prefix"}


@pytest.mark.parametrize("command", ["write", "merge"])
@pytest.mark.parametrize("held", ["reshard output", "merge output", "transformers checkpoint"])
def test_overwrite_replaces_only_what_reshard_wrote_and_names_the_rest(s3, s3_bucket, folder, tmp_path, command,
                                                                       held):
    """Row 2 of issue 60: a prefix holding a reshard write (or a merge) plus objects reshard did not write, or a
    checkpoint another tool wrote, is refused by name, as a local folder is; every object keeps its bytes."""
    src, ckpt = folder
    url = f"s3://{s3_bucket}/out"
    if held == "reshard output":
        s3.put_folder(ckpt, url)
    elif held == "merge output":
        merge_checkpoint(ckpt, tmp_path / "merged", progress=False)
        s3.put_folder(tmp_path / "merged", url)
    else:
        s3.put_folder(src, url)  # a model.safetensors.index.json, but not a merge's
    extra = {} if held == "transformers checkpoint" else FOREIGN
    for name, data in extra.items():
        s3.put_bytes(f"{url}/{name}", data)
    before = bucket_state(s3, s3_bucket)
    source = src if command == "write" else ckpt
    args = ["--fsdp", "2"] if command == "write" else []
    run = cli(s3, command, source, url, *args, "--overwrite")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    if held == "transformers checkpoint" or (command == "write" and held == "merge output"):
        assert "--overwrite replaces only a complete" in last and "Nothing was changed" in last, last
    else:
        assert f"{held} but also holds NOTES.txt, checkpoint-100/, optimizer-state.pt, trainer_state.json" in last
    assert bucket_state(s3, s3_bucket) == before
    changes = [r for r in s3.requests() if r.method in ("PUT", "DELETE") or "uploadId" in r.query]
    assert {r.key for r in changes} <= {f"out/{bucket_output.PROBE}"}  # only the write check's upload, aborted


@pytest.mark.parametrize("command", ["write", "merge"])
def test_overwrite_replaces_a_complete_output_with_its_copied_files(s3, s3_bucket, folder, tmp_path, command):
    """What reshard wrote, the copied config and tokenizer files included, is replaced whole: no object is left of
    the old output that the new one does not have."""
    src, ckpt = folder
    url = f"s3://{s3_bucket}/out"
    if command == "write":
        write_checkpoint(src, url, MeshSpec(fsdp=4), progress=False)
        write_checkpoint(src, url, MeshSpec(fsdp=2), overwrite=True, progress=False)
        write_checkpoint(src, tmp_path / "local", MeshSpec(fsdp=2), progress=False)
    else:
        merge_checkpoint(ckpt, url, max_shard_size=8_000_000, progress=False)
        write_checkpoint(src, tmp_path / "fsdp2", MeshSpec(fsdp=2), progress=False)
        merge_checkpoint(tmp_path / "fsdp2", url, overwrite=True, progress=False)
        merge_checkpoint(tmp_path / "fsdp2", tmp_path / "local", progress=False)
    assert objects(s3, s3_bucket, "out") == files_of(tmp_path / "local")


def bucket_state(server, bucket: str) -> dict[str, tuple[str, bytes]]:
    """Every object of `bucket`: key -> (ETag, bytes), read straight from the server."""
    fs = client(server)
    listed = fs.call_s3("list_objects_v2", Bucket=bucket).get("Contents", [])
    return {e["Key"]: (e["ETag"], fs.cat_file(f"{bucket}/{e['Key']}")) for e in listed}


@pytest.mark.parametrize("command", ["write", "merge"])
@pytest.mark.parametrize("spelling, relation", [
    ("s3://{b}//rs", "is"), ("s3://{b}/./rs/", "is"), ("s3a://{b}/rs", "is"), ("s3://{b}//rs//sub", "is inside"),
    ("s3://{b}/top//", "holds")])
def test_an_output_spelled_as_another_name_for_the_source_is_refused_and_the_source_kept(
        s3, s3_bucket, folder, command, spelling, relation):
    """Row 1 of issue 60: OUT and SRC compared as places, not strings; the source and its neighbours keep every
    byte, and not one request is made."""
    _, ckpt = folder
    source = f"s3://{s3_bucket}/top/rs" if relation == "holds" else f"s3://{s3_bucket}/rs"
    s3.put_folder(ckpt, source)
    s3.put_bytes(f"s3://{s3_bucket}/rs-notes/NOTES.txt", b"a neighbour")
    before = bucket_state(s3, s3_bucket)
    s3.clear_log()
    out = spelling.format(b=s3_bucket)
    args = ["--fsdp", "2"] if command == "write" else []
    run = cli(s3, command, source, out, *args, "--overwrite")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err
    assert f"{'OUT' if command == 'write' else 'DEST'} {out} {relation} SRC {source}" in err, err
    assert "Nothing was changed" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert s3.requests() == []  # refused before the bucket was asked anything
    assert bucket_state(s3, s3_bucket) == before


@pytest.mark.parametrize("case", ["no bucket", "no credentials", "read-only", "whole bucket", "other scheme"])
def test_an_output_that_cannot_be_written_is_refused_before_the_source_is_read(s3, s3_bucket, folder, monkeypatch,
                                                                                case):
    src, _ = folder
    s3.put_folder(src, f"s3://{s3_bucket}/src")
    s3.clear_log()
    url, error, match = f"s3://{s3_bucket}/out", OutputError, None
    if case == "no bucket":
        url, match = "s3://no-such-bucket-here/out", r"the bucket no-such-bucket-here does not exist"
    elif case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        match = r"no AWS credentials were found"
    elif case == "read-only":
        s3.fail_next(1, 403, code="AccessDenied", methods=("POST",))
        match = r"may not write under the prefix \(access denied\)"
    elif case == "whole bucket":
        url, error, match = f"s3://{s3_bucket}", UsageError, r"a prefix, s3://bucket/prefix, not a whole bucket"
    else:
        url, error, match = f"gs://{s3_bucket}/out", UsageError, r"not this scheme"
    with pytest.raises(error, match=match + r".*Nothing was read or written"):
        write_checkpoint(f"s3://{s3_bucket}/src", url, MeshSpec(fsdp=2), progress=False)
    assert not s3.requests(prefix="src/")  # not even a listing of the source
    assert open_uploads(s3, s3_bucket) == []


# ---- an --overwrite that ends early: the old checkpoint stays whole, or the rerun completes it (issue 60, row 3) ---

def old_and_new(s3, bucket: str, folder, tmp_path, command: str):
    """An old checkpoint at s3://bucket/out (fsdp 4, or a merge in 8 MB files) and the command that replaces it
    (fsdp 2, or a merge in one file), with the local output that command makes: (url, args, local)."""
    src, ckpt = folder
    url = f"s3://{bucket}/out"
    if command == "write":
        write_checkpoint(src, url, MeshSpec(fsdp=4), progress=False)
        write_checkpoint(src, tmp_path / "local", MeshSpec(fsdp=2), progress=False)
        return url, ["write", src, url, "--fsdp", "2", "--overwrite"], tmp_path / "local"
    merge_checkpoint(ckpt, url, max_shard_size=8_000_000, progress=False)
    merge_checkpoint(ckpt, tmp_path / "local", progress=False)
    return url, ["merge", ckpt, url, "--overwrite"], tmp_path / "local"


def without_claim(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.endswith(CLAIM_NAME)}


def rerun_completes(s3, bucket: str, args, local: Path) -> None:
    """The same command again: it succeeds, the prefix holds exactly the new output, and it verifies."""
    run = cli(s3, *args)
    _, err = run.communicate(timeout=180)
    assert run.returncode == 0, err
    assert objects(s3, bucket, "out") == files_of(local)
    assert open_uploads(s3, bucket) == []


@pytest.mark.parametrize("command", ["write", "merge"])
@pytest.mark.parametrize("fault", ["500 on every PUT", "500 on every part", "SIGTERM mid-part", "SIGKILL mid-part"])
def test_an_overwrite_ending_before_the_swap_leaves_the_old_checkpoint_whole(s3, s3_bucket, folder, tmp_path,
                                                                           small_parts, command, fault):
    url, args, local = old_and_new(s3, s3_bucket, folder, tmp_path, command)
    before = bucket_state(s3, s3_bucket)
    data = f"out/{min(n for n in files_of(local) if n.endswith('.safetensors'))}"
    if fault.startswith("500"):
        s3.fail_next(10_000, 500, methods=("PUT",), key=None if fault == "500 on every PUT" else data)
        run = cli(s3, *args)
        _, err = run.communicate(timeout=180)
        s3.clear_faults()
        assert run.returncode == 1, err
    else:
        s3.stall_next(1, 60, methods=("PUT",), key=data)
        run = cli(s3, *args)
        until_held(s3, lambda: run.poll() is None, lambda: run.communicate())
        run.send_signal(signal.SIGTERM if fault.startswith("SIGTERM") else signal.SIGKILL)
        _, err = run.communicate(timeout=60)
        s3.release_stalls()
        assert run.returncode == (128 + signal.SIGTERM if fault.startswith("SIGTERM") else -signal.SIGKILL), err
    s3.wait_idle(30)
    after = bucket_state(s3, s3_bucket)
    assert without_claim(after) == before  # every object of the old checkpoint, byte for byte, with its ETag
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if fault != "SIGKILL mid-part":
        assert f"The checkpoint that was at {url} is unchanged and loads." in last, err
        assert "Traceback" not in err and "nothing partial" not in last
        assert after == before and open_uploads(s3, s3_bucket) == []  # the claim and every upload gone
    else:  # killed: the record and the open uploads stay; the old checkpoint still verifies
        assert set(after) - set(before) == {f"out/{CLAIM_NAME}"}
        assert Claim.parse(after[f"out/{CLAIM_NAME}"][1]).state == "sending"
    assert verify(url).ok
    refused = cli(s3, *args[:-1])  # without --overwrite: refused, and the record is named
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 1 and "Pass --overwrite" in err, err
    rerun_completes(s3, s3_bucket, args, local)
    print(f"{fault}, {command}: {last}")


@pytest.mark.parametrize("command", ["write", "merge"])
@pytest.mark.parametrize("fault", ["500 on the marker", "SIGKILL mid-swap"])
def test_an_overwrite_ending_in_the_swap_says_so_and_the_rerun_completes_it(s3, s3_bucket, folder, tmp_path,
                                                                          command, fault):
    """Past the last part, S3 cannot keep the old checkpoint: the last line says it no longer loads, the record
    names every object there, and the rerun with --overwrite completes the replacement."""
    url, args, local = old_and_new(s3, s3_bucket, folder, tmp_path, command)
    marker = f"out/{'reshard.json' if command == 'write' else 'model.safetensors.index.json'}"
    if fault.startswith("500"):
        s3.fail_next(10_000, 500, methods=("PUT",), key=marker)
        run = cli(s3, *args)
        _, err = run.communicate(timeout=180)
        assert run.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert f"The checkpoint that was at {url} no longer loads" in last and "--overwrite to complete" in last
    else:
        s3.stall_next(1, 60, methods=("PUT",), key=marker)
        run = cli(s3, *args)
        until_held(s3, lambda: run.poll() is None, lambda: run.communicate())
        run.kill()
        _, err = run.communicate(timeout=60)
        s3.release_stalls()
        last = "(killed)"
    s3.clear_faults()
    s3.wait_idle(30)
    after = bucket_state(s3, s3_bucket)
    claim = Claim.parse(after[f"out/{CLAIM_NAME}"][1])
    assert claim.state == "swapping" and {k[len("out/"):] for k in after} <= {CLAIM_NAME, *claim.replacing,
                                                                              *claim.new}
    if fault.startswith("500"):
        assert marker not in after
    refused = cli(s3, *args[:-1])  # without --overwrite: refused, and the record is named
    _, refusal = refused.communicate(timeout=120)
    assert refused.returncode == 1 and CLAIM_NAME in refusal and "which --overwrite completes" in refusal, refusal
    rerun_completes(s3, s3_bucket, args, local)
    assert verify(url).ok
    print(f"{fault}, {command}: {last}")


def test_a_failing_part_is_retried_then_named_and_every_upload_aborted(s3, s3_bucket, folder, tmp_path,
                                                                       small_parts):
    _, ckpt = folder
    merge_checkpoint(ckpt, tmp_path / "merged", max_shard_size=8_000_000, progress=False)
    first = min(n for n in files_of(tmp_path / "merged") if n.endswith(".safetensors"))
    # both parts of the first file fail on every attempt
    s3.fail_next(2 * bucket_output.ATTEMPTS, 500, methods=("PUT",), key=f"failing/{first}")
    with pytest.raises(OutputError, match=rf"failing/{first}: uploading part 1 of 2 \(bytes 0-5242879\) failed "
                                          r"after 4 attempts .* aborted \d+ multipart uploads? "):
        merge_checkpoint(ckpt, f"s3://{s3_bucket}/failing", max_shard_size=8_000_000, progress=False)
    assert open_uploads(s3, s3_bucket) == []
    assert objects(s3, s3_bucket, "failing") == {}  # no file, no marker


def test_a_part_the_server_holds_is_given_up_at_its_deadline_and_sent_again(s3, s3_bucket, folder, monkeypatch):
    """A server that takes a part and stops reading it: botocore's read timeout never starts, so the part's own
    deadline (here 1 s + its bytes at 8 MiB/s) ends the try, and the write goes on, exact."""
    src, ckpt = folder
    monkeypatch.setattr(bucket_output, "READ_TIMEOUT_S", 1)
    monkeypatch.setattr(bucket_output, "_SLOWEST_UPLOAD", 8 << 20)
    held = f"held/{shard_file_name(0, 0, 1)}"
    s3.stall_next(1, 120, methods=("PUT",), key=held)
    started = time.monotonic()
    try:
        write_checkpoint(src, f"s3://{s3_bucket}/held", MeshSpec(fsdp=4), progress=False)
        took = time.monotonic() - started
    finally:
        s3.release_stalls()
    assert objects(s3, s3_bucket, "held") == files_of(ckpt)
    assert took < 60, took  # the held try lasted about 2 s, not the server's 120
    puts = s3.requests(method="PUT", key=held)
    assert [r.fault for r in puts] == ["stall", None], puts  # given up once, then sent again
    assert open_uploads(s3, s3_bucket) == []


def test_a_failure_after_the_uploads_completed_removes_them(s3, s3_bucket, folder, monkeypatch):
    def fail(step):
        raise OSError(5, "injected")

    monkeypatch.setattr(bucket_steps, "complete_hook", fail)
    with pytest.raises(OutputError, match=r"aborted 0 multipart uploads and removed [2-9] objects it had completed; "
                                          r"no commit marker was written"):
        merge_checkpoint(folder[1], f"s3://{s3_bucket}/late", progress=False)
    assert objects(s3, s3_bucket, "late") == {} and open_uploads(s3, s3_bucket) == []


# ---- write into a bucket -------------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_a_write_into_a_bucket_is_the_local_write_and_loads_exactly_on_5_ranks(s3, s3_bucket, folder, tmp_path):
    src, _ = folder
    url = f"s3://{s3_bucket}/fsdp5"
    write_checkpoint(src, tmp_path / "local", MeshSpec(fsdp=5), progress=False)
    s3.clear_log()
    write_checkpoint(src, url, MeshSpec(fsdp=5), progress=False)
    assert objects(s3, s3_bucket, "fsdp5") == files_of(tmp_path / "local")
    writes = [r for r in s3.requests(bucket=s3_bucket) if r.method in ("PUT", "POST")]
    assert writes[-1].key == "fsdp5/reshard.json" and writes[-1].method == "PUT"
    reports = tmp_path / "reports"
    reports.mkdir()
    run_ranks("load_remote.py", 5, url, src, reports, env=s3.environ("ranks"), timeout=300)
    for report in rank_reports(reports, 5):
        assert "error" not in report, report.get("traceback")
        assert report["mismatched"] == [] and report["tensors"] == 25


@pytest.mark.multirank
def test_a_torchrun_write_into_a_bucket_sends_each_rank_file_from_the_rank_that_wrote_it(s3, s3_bucket, folder,
                                                                                          tmp_path):
    src, _ = folder
    write_checkpoint(src, tmp_path / "local", MeshSpec(fsdp=4), progress=False)
    s3.clear_log()
    run_ranks("cli_as_rank.py", 2, "write", src, f"s3://{s3_bucket}/ranks", "--fsdp", 4, "-q",
              env=s3.environ("ranks"), timeout=300)
    assert objects(s3, s3_bucket, "ranks") == files_of(tmp_path / "local")
    sent = {}
    for r in s3.requests(bucket=s3_bucket, method="PUT"):
        if "partNumber=" in r.query:
            sent.setdefault(r.access_key, set()).add(r.key.rsplit("/", 1)[-1])
    rank_files = [f for f in files_of(tmp_path / "local") if f.startswith("shard-")]
    assert sorted(sent) == ["rank0", "rank1"] and sent["rank0"].isdisjoint(sent["rank1"])
    assert sent["rank0"] | sent["rank1"] >= set(rank_files)
    written = {r.key.rsplit("/", 1)[-1]: r.access_key for r in s3.requests(bucket=s3_bucket)
               if r.method == "POST" and "uploadId=" in r.query}
    assert set(written.values()) == {"rank0"}  # rank 0 completes every upload
    assert s3.requests(bucket=s3_bucket, method="PUT")[-1].key == "ranks/reshard.json"


def test_node_local_into_a_bucket_is_refused_before_anything_is_read(s3, s3_bucket, folder):
    with pytest.raises(UsageError, match=r"--node-local writes a copy to each node's own disk; into a bucket"):
        write_checkpoint(folder[0], f"s3://{s3_bucket}/x", MeshSpec(fsdp=2), distributed=True, node_local=True,
                         progress=False)


def test_sigterm_mid_upload_leaves_no_marker_and_no_upload_in_progress(s3, s3_bucket, folder):
    src, _ = folder
    # a part of the first rank file hangs: the write is surely mid-upload when the signal comes
    held = f"cut/{shard_file_name(0, 0, 1)}"
    s3.stall_next(1, 60, methods=("PUT",), key=held)
    proc = cli(s3, "write", src, f"s3://{s3_bucket}/cut", "--fsdp", 4, "-q")
    until_held(s3, lambda: proc.poll() is None, lambda: proc.communicate())
    assert s3.requests(method="POST", key=held, wait=0), "the held part's upload was opened first"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    s3.release_stalls()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "aborted" in err and "no commit marker was written" in err, err
    assert "reshard.json" not in objects(s3, s3_bucket, "cut")
    s3.wait_idle(30)
    assert open_uploads(s3, s3_bucket) == []


def test_a_server_that_goes_away_mid_upload_ends_in_a_clear_error(folder):
    """Its own server (killing the session's would break later tests)."""
    from s3_server import S3Server

    src, _ = folder
    server = S3Server.start()
    try:
        bucket = server.new_bucket("gone")
        server.stall_next(1, 60, methods=("PUT",))
        proc = cli(server, "write", src, f"s3://{bucket}/out", "--fsdp", 4, "-q")
        deadline = time.monotonic() + 120
        while not server.requests(method="POST", wait=0, prefix="out/shard-"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(1)
        killed = time.monotonic()
        server.kill()
        _, err = proc.communicate(timeout=120)
        stopped = time.monotonic() - killed
    finally:
        server.stop()
    assert proc.returncode == 1, err
    assert f"s3://{bucket}/out/shard-" in err and "failed after" in err and "could not be removed" in err, err
    assert "Traceback" not in err and stopped < 60, (stopped, err)


def test_an_orphaned_send_that_dies_with_its_connection_prints_nothing(caplog):
    """The flake behind the test above: aiohttp's body-sending task died with the connection after its request had
    failed, and asyncio printed 'Task exception was never retrieved' and a traceback at exit."""
    import s3fs

    from reshard.read._source import s3_filesystem

    loop = s3_filesystem(s3fs).loop
    handler = loop.get_exception_handler()
    message = "Task exception was never retrieved"
    with caplog.at_level("ERROR", logger="asyncio"):
        handler(loop, {"message": message, "exception": ConnectionResetError("Cannot write to closing transport")})
        assert caplog.records == []
        handler(loop, {"message": message, "exception": ValueError("a bug of ours")})  # anything else is shown
    assert [r.getMessage() for r in caplog.records] == [message]


# ---- merge across nodes into a bucket -------------------------------------------------------------------------------

def merge_across_nodes(s3, bucket: str, tiny, tmp_path, prefix: str, max_shard_size: int, *, model=None, **run):
    """2 simulated nodes x 2 ranks: a node-local write, then `merge --node-local` into s3://bucket/prefix; the log is
    cleared before the merge. Returns (the merge's `NodesResult`, the same merge on one machine as files)."""
    from nodes import run_nodes

    src = tiny("qwen3_moe", **(model or {"experts": 4}))
    mount_at = tmp_path / "disk"
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in (mount_at, *node_dirs):
        d.mkdir()
    env = {**s3.environ("ranks"), "PYTHONPATH": str(REPO), "RESHARD_S3_PART_MIB": "5"}
    write = run_nodes("cli_as_rank.py", "write", src, mount_at / "ep", "--fsdp", 4, "--ep", 2, "--node-local", "-q",
                      mount_at=mount_at, node_dirs=node_dirs, env=env, timeout=240)
    assert [n.returncode for n in write.nodes] == [0, 0], [n.stderr[-3000:] for n in write.nodes]
    s3.clear_log()
    merge = run_nodes("cli_as_rank.py", "merge", mount_at / "ep", f"s3://{bucket}/{prefix}", "--node-local",
                      "--max-shard-size", max_shard_size, "-q", mount_at=mount_at, node_dirs=node_dirs, env=env,
                      timeout=240, **run)
    write_checkpoint(src, tmp_path / "whole", MeshSpec(fsdp=4, ep=2), progress=False)
    merge_checkpoint(tmp_path / "whole", tmp_path / "reference", max_shard_size=max_shard_size, progress=False)
    return merge, files_of(tmp_path / "reference")


def sent_per_node(s3, bucket: str) -> dict[int, int]:
    """Bytes of every PUT (parts and objects) by node, from the access keys `rank{RANK}` (2 ranks per node)."""
    sent: dict[int, int] = {}
    for r in s3.requests(bucket=bucket, method="PUT"):
        node = int(r.access_key.removeprefix("rank")) // 2
        sent[node] = sent.get(node, 0) + r.received
    return sent


def test_a_merge_across_nodes_into_a_bucket_equals_the_local_merge(s3, s3_bucket, tiny, tmp_path):
    """The objects equal a merge of the same files on one machine; each node sends the files whose bytes it holds
    (here each file is one part), and rank 0 completes every upload."""
    merge, reference = merge_across_nodes(s3, s3_bucket, tiny, tmp_path, "merged", 150_000)
    assert [n.returncode for n in merge.nodes] == [0, 0], [n.stderr[-3000:] for n in merge.nodes]
    assert objects(s3, s3_bucket, "merged") == reference
    sent = sent_per_node(s3, s3_bucket)
    total = sum(len(b) for b in reference.values())
    assert sum(sent.values()) == total and 0 < sent[0] < total and 0 < sent[1] < total, sent
    log = s3.requests(bucket=s3_bucket)
    assert {r.access_key for r in log if r.method == "POST" and "uploadId=" in r.query} == {"rank0"}
    assert open_uploads(s3, s3_bucket) == []
    print(f"merge across nodes into s3: bytes sent per node {sent} of {total}")


def test_node_copies_of_two_checkpoints_one_without_a_write_id_merge_nothing_into_a_bucket(s3, s3_bucket, tiny,
                                                                                           tmp_path):
    """Issue 61, row 4 into S3: node 0 holds v1's ranks 0-1 written by an older reshard (no write_id), node 1 v2's
    ranks 2-3 (one shape, other weights). `merge --node-local` into the bucket exited 0 with 21-23 of 33 keys
    matching neither; now every rank stops naming the copy without an identity, and no object is written."""
    import json

    from nodes import run_nodes

    v1, v2 = tiny("qwen3_moe", experts=4), tiny("qwen3_moe", experts=4, seed=1)
    mount_at, node_dirs = tmp_path / "disk", [tmp_path / "node0", tmp_path / "node1"]
    for d in (mount_at, *node_dirs):
        d.mkdir()
    for node, (src, ranks) in enumerate(((v1, "0-1"), (v2, "2-3"))):
        wrote = subprocess.run([sys.executable, "-m", "reshard", "write", str(src), str(node_dirs[node] / "ep"),
                                "--fsdp", "4", "--ep", "2", "--ranks", ranks, "-q"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert wrote.returncode == 0, wrote.stderr
    manifest = node_dirs[0] / "ep" / "reshard.json"
    document = json.loads(manifest.read_text())
    del document["write_id"]
    manifest.write_text(json.dumps(document))
    s3.clear_log()
    merge = run_nodes("cli_as_rank.py", "merge", mount_at / "ep", f"s3://{s3_bucket}/mixed", "--node-local", "-q",
                      mount_at=mount_at, node_dirs=node_dirs, env={**s3.environ("ranks"), "PYTHONPATH": str(REPO)},
                      timeout=240)
    for node in merge.nodes:
        assert node.returncode != 0, node.stderr[-3000:]
        # each of the node's 2 ranks says it (torchrun's own traceback of the failed job follows)
        assert node.stderr.count("holds a copy with no write_id (written by a reshard older than write identities)"
                                 ) == 2, node.stderr[-3000:]
    assert objects(s3, s3_bucket, "mixed") == {} and not s3.requests(bucket=s3_bucket, method="PUT")


@pytest.mark.slow  # simulated nodes, 60 MB through the process group and the bucket
def test_every_node_uploads_its_share_of_a_multipart_merge(s3, s3_bucket, tiny, tmp_path):
    """Files of several 5 MiB parts (RESHARD_S3_PART_MIB) whose bytes lie on both nodes: every node sends parts of them, about its share,
    a part spanning both nodes' bytes filled over the process group; the objects equal the local merge."""
    merge, reference = merge_across_nodes(s3, s3_bucket, tiny, tmp_path, "parts", 40_000_000,
                                          model={"experts": 4, "vocab_size": 80_000})
    assert [n.returncode for n in merge.nodes] == [0, 0], [n.stderr[-3000:] for n in merge.nodes]
    assert objects(s3, s3_bucket, "parts") == reference
    largest = max(len(b) for b in reference.values())
    parts = [r for r in s3.requests(bucket=s3_bucket, method="PUT") if "partNumber=" in r.query]
    by_file: dict[str, set] = {}
    for r in parts:
        by_file.setdefault(r.key, set()).add(int(r.access_key.removeprefix("rank")) // 2)
    assert largest > 3 * SMALL_PART and any(nodes == {0, 1} for nodes in by_file.values()), by_file
    sent = sent_per_node(s3, s3_bucket)
    total = sum(len(b) for b in reference.values())
    assert sum(sent.values()) == total and all(0.25 * total < sent[n] < 0.75 * total for n in (0, 1)), sent
    assert open_uploads(s3, s3_bucket) == []
    print(f"multipart merge across nodes into s3: bytes sent per node {sent} of {total}")


@pytest.mark.slow  # simulated nodes
def test_sigterm_mid_upload_across_nodes_leaves_no_marker_and_no_upload(s3, s3_bucket, tiny, tmp_path):
    """SIGTERM to every rank (as torchrun forwards it) while a part is held by the server: every upload is aborted,
    no marker is written, nothing stays in the multipart listing."""
    import threading

    s3.stall_next(1, 60, methods=("PUT",))
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(result=merge_across_nodes(
        s3, s3_bucket, tiny, tmp_path, "cut", 40_000_000, model={"experts": 4, "vocab_size": 80_000})))
    worker.start()
    until_held(s3, worker.is_alive, seconds=240)
    pids = rank_pids(f"s3://{s3_bucket}/cut")
    assert len(pids) == 4, pids
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    time.sleep(2)
    s3.release_stalls()
    worker.join(240)
    merge, _ = done["result"]
    assert all(n.returncode != 0 for n in merge.nodes), [(n.returncode, n.stderr[-2000:]) for n in merge.nodes]
    err = "".join(n.stderr for n in merge.nodes)
    assert "no commit marker was written" in err, err[-3000:]
    assert not {"config.json", "model.safetensors.index.json"} & set(objects(s3, s3_bucket, "cut"))
    s3.wait_idle(30)
    assert open_uploads(s3, s3_bucket) == []


@pytest.mark.slow  # simulated nodes
def test_a_node_killed_mid_upload_stops_every_rank_and_leaves_no_upload(s3, s3_bucket, tiny, tmp_path):
    """Node 1 dies (SIGKILL to its agent and ranks) while a part is held by the server: node 0's ranks stop within
    60 s with an error, every upload is aborted, no marker is written."""
    import threading

    s3.stall_next(1, 60, methods=("PUT",))
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(result=merge_across_nodes(
        s3, s3_bucket, tiny, tmp_path, "died", 40_000_000, model={"experts": 4, "vocab_size": 80_000})))
    worker.start()
    until_held(s3, worker.is_alive, seconds=240)
    pids = rank_pids(f"s3://{s3_bucket}/died")
    ranks = {pid: int(dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in v)["RANK"]) for pid in pids}
    node_1 = next(pid for pid, rank in ranks.items() if rank >= 2)
    os.killpg(os.getpgid(node_1), signal.SIGKILL)  # the node's shell, agent and ranks: one process group
    killed = time.monotonic()
    s3.release_stalls()
    node_0 = [pid for pid, rank in ranks.items() if rank < 2]
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in node_0):
        assert time.monotonic() - killed < 90, "node 0's ranks still run 90 s after node 1 died"
        time.sleep(0.2)
    stopped = time.monotonic() - killed
    worker.join(240)
    merge, _ = done["result"]
    assert merge.nodes[0].returncode != 0, merge.nodes[0].stderr[-3000:]
    assert stopped < 60, stopped
    ranks_said = merge.nodes[0].stderr.split("ChildFailedError")[0]  # torchrun's own report follows the ranks'
    assert "Error: " in ranks_said and "Traceback" not in ranks_said.split("Error: ", 1)[0], ranks_said[-3000:]
    assert not {"config.json", "model.safetensors.index.json"} & set(objects(s3, s3_bucket, "died"))
    s3.wait_idle(30)
    assert open_uploads(s3, s3_bucket) == []
    print(f"node 1 killed mid-upload: node 0 stopped {stopped:.1f} s later: {ranks_said.strip()[-600:]}")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "zombie"


def rank_pids(argument: str) -> list[int]:
    """The rank processes (not their torchrun agents) this test started whose arguments hold `argument`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().decode().split("\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if (argument in args and "torch.distributed.run" not in args
                and any(a.endswith("cli_as_rank.py") for a in args)):
            found.append(int(entry.name))
    return found


def test_a_merge_by_worker_processes_into_a_bucket_is_the_same(s3, s3_bucket, folder, tmp_path):
    """`--workers 2`: the workers' files wait in the spool and are sent by the process that completes the output."""
    _, ckpt = folder
    merge_checkpoint(ckpt, tmp_path / "merged", max_shard_size=8_000_000, progress=False)
    merge_checkpoint(ckpt, f"s3://{s3_bucket}/workers", max_shard_size=8_000_000, progress=False, workers=2)
    assert objects(s3, s3_bucket, "workers") == files_of(tmp_path / "merged")
    assert open_uploads(s3, s3_bucket) == []


# ---- RESHARD_S3_PART_MIB: read where it is used, never clamped (issue 61, row 8) ----------------------------------

@pytest.mark.parametrize("value", ["abc", "4.5", "0", "-3", "4", "5121", "6000", "0x10"])
def test_a_bad_part_size_is_refused_in_one_line_before_any_request(s3, s3_bucket, folder, value):
    src, _ = folder
    run = cli(s3, "write", src, f"s3://{s3_bucket}/out", "--fsdp", "2", env_extra={"RESHARD_S3_PART_MIB": value})
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2 and "Traceback" not in err, err
    assert f"RESHARD_S3_PART_MIB='{value}': the S3 part size is a whole number of MiB from 5 to 5120" in err
    assert s3.requests() == []


def test_the_part_size_is_read_only_by_a_command_that_writes_a_bucket(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_S3_PART_MIB", "abc")  # a local write never needs it
    write_checkpoint(tiny("qwen3_moe", experts=2), tmp_path / "out", MeshSpec(fsdp=2), progress=False)
    for value, mib in (("5", 5), (" 5120 ", 5120), ("", 16)):
        monkeypatch.setenv("RESHARD_S3_PART_MIB", value)
        assert bucket_output.configured_part_bytes() == mib << 20
    monkeypatch.delenv("RESHARD_S3_PART_MIB")
    assert bucket_output.configured_part_bytes() == 16 << 20
