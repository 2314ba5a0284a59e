"""The S3 test server itself (tests/s3_server.py): real SeaweedFS behind the logging proxy. Ranged reads are single
logged GETs, each client's access key is logged, faults reach the clients, and what s3fs's retries do with them
(attempts and time) is pinned here, since the loader's error handling is built on it:

- s3fs wraps every call twice in its own retry loop (`S3FileSystem.retries`, a class attribute, default 5: once in
  `_call_s3`, once around get-and-read in `cat_file`), and botocore retries inside (legacy mode: 4 retries, backoff
  rand * 2**n s). s3fs itself retries only timeouts, body errors and "SlowDown": a 503 ServiceUnavailable costs 5
  GETs, a SlowDown 25, a stalled server up to 125 read timeouts.
- `config_kwargs={"retries": {"total_max_attempts": 1}}` turns botocore's off (legacy `max_attempts` counts retries,
  not attempts); `fs.retries = 1` turns s3fs's off (`retries` is not an __init__ argument; 0 breaks s3fs).
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import io
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import parse_qs

import pytest
import s3fs
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

from s3_server import REGION, S3Server, S3ServerError

MIB = 1 << 20


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def filesystem(s3fs_retries: int | None = None, *, endpoint_url: str | None = None,
               **config) -> "s3fs.S3FileSystem":
    """A fresh s3fs client (endpoint and key from the environment unless given); `s3fs_retries`: s3fs's own loops;
    `config`: botocore's Config."""
    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint_url, config_kwargs=config)
    if s3fs_retries is not None:
        fs.retries = s3fs_retries
    return fs


def minimal(*, endpoint_url: str | None = None, **config) -> "s3fs.S3FileSystem":
    """One request per read: no retry in botocore, none in s3fs."""
    return filesystem(1, endpoint_url=endpoint_url, retries={"total_max_attempts": 1}, **config)


def botocore_client():
    """A plain (synchronous) botocore S3 client from the environment."""
    import botocore.session

    return botocore.session.get_session().create_client("s3")


def raw_get(server: S3Server, path: str, method: str = "GET") -> tuple[int, bytes]:
    """An unsigned request through the proxy (weed takes it: it checks no credentials)."""
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# ---- reads and the log -----------------------------------------------------------------------------------------

def test_ranged_cat_file_is_one_logged_get(s3, s3_bucket):
    data = blob(MIB)
    s3.put_bytes(f"s3://{s3_bucket}/dir/blob.bin", data)
    assert s3.requests() == []  # setup goes to weed directly: neither logged nor faulted

    fs = s3fs.S3FileSystem()
    got = fs.cat_file(f"{s3_bucket}/dir/blob.bin", start=1000, end=5000)  # keywords: the 2nd parameter is version_id

    assert got == data[1000:5000]
    [req] = s3.requests()
    assert (req.method, req.bucket, req.key, req.range, req.status, req.sent, req.access_key, req.fault) == \
        ("GET", s3_bucket, "dir/blob.bin", "bytes=1000-4999", 206, 4000, "test", None)


def test_range_head_and_listing_semantics(s3, s3_bucket):
    """What weed answers for the requests a loader makes, through the proxy."""
    from botocore.exceptions import ClientError

    data = blob(MIB, seed=1)
    s3.put_bytes(f"s3://{s3_bucket}/blob", data)
    for i in range(5):
        s3.put_bytes(f"s3://{s3_bucket}/many/{i}", bytes([i]) * i)
    client = botocore_client()

    def get(rng):
        resp = client.get_object(Bucket=s3_bucket, Key="blob", Range=rng)
        return resp["ResponseMetadata"]["HTTPStatusCode"], resp["ContentRange"], resp["Body"].read()

    size = len(data)
    assert get("bytes=-5") == (206, f"bytes {size - 5}-{size - 1}/{size}", data[-5:])
    assert get(f"bytes={size - 7}-") == (206, f"bytes {size - 7}-{size - 1}/{size}", data[-7:])
    assert get(f"bytes={size - 3}-{size + 100}") == (206, f"bytes {size - 3}-{size - 1}/{size}", data[-3:])
    with pytest.raises(ClientError, match="InvalidRange"):
        get(f"bytes={size}-")
    head = client.head_object(Bucket=s3_bucket, Key="blob")
    assert head["ContentLength"] == size and head["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    assert head["AcceptRanges"] == "bytes"

    keys, token = [], None
    for _ in range(10):  # bounded: 5 keys, 2 a page
        page = client.list_objects_v2(Bucket=s3_bucket, Prefix="many/", MaxKeys=2,
                                      **({"ContinuationToken": token} if token else {}))
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page["IsTruncated"]:
            break
        token = page["NextContinuationToken"]
    assert keys == [f"many/{i}" for i in range(5)]

    log = s3.requests()
    assert [(r.method, r.range, r.status) for r in log[:5]] == [
        ("GET", "bytes=-5", 206), ("GET", f"bytes={size - 7}-", 206), ("GET", f"bytes={size - 3}-{size + 100}", 206),
        ("GET", f"bytes={size}-", 416), ("HEAD", None, 200)]
    assert [r.sent for r in log[:3]] == [5, 7, 3] and log[4].sent == 0
    listings = log[5:]
    assert len(listings) == 3 and all(r.key == "" and "list-type=2" in r.query for r in listings)


def test_each_client_access_key_is_logged(s3, s3_bucket):
    files = {f"rank{r}.safetensors": blob(10_000, seed=r) for r in range(3)}
    for name, data in files.items():
        s3.put_bytes(f"s3://{s3_bucket}/ckpt/{name}", data)

    # Two clients in this process, each with its own key id ...
    for rank in (0, 1):
        fs = s3fs.S3FileSystem(key=f"rank{rank}", secret="x", skip_instance_cache=True)
        assert fs.cat_file(f"{s3_bucket}/ckpt/rank{rank}.safetensors", start=0, end=100) == \
            files[f"rank{rank}.safetensors"][:100]
    # ... and a rank process configured only by its environment.
    code = ("import sys, s3fs; sys.stdout.buffer.write(s3fs.S3FileSystem().cat_file(sys.argv[1], start=3, end=13))")
    proc = subprocess.run([sys.executable, "-c", code, f"{s3_bucket}/ckpt/rank2.safetensors"],
                          env=s3.environ("rank2"), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout == files["rank2.safetensors"][3:13]

    touched = {r: {q.key for q in s3.requests(method="GET", access_key=f"rank{r}")} for r in range(3)}
    assert touched == {r: {f"ckpt/rank{r}.safetensors"} for r in range(3)}
    assert {q.access_key for q in s3.requests()} == {"rank0", "rank1", "rank2"}


# ---- faults ----------------------------------------------------------------------------------------------------

def test_fail_next_answers_the_status_then_heals(s3, s3_bucket):
    data = blob(3000)
    s3.put_bytes(f"s3://{s3_bucket}/a", data)
    s3.put_bytes(f"s3://{s3_bucket}/b", data)

    s3.fail_next(2, 503)
    s3.fail_next(1, 404, key="b", methods=("HEAD",))
    status, body = raw_get(s3, f"/{s3_bucket}/a")
    assert status == 503 and b"<Code>ServiceUnavailable</Code>" in body and f"/{s3_bucket}/a".encode() in body
    assert raw_get(s3, f"/{s3_bucket}/a", "HEAD")[0] == 200  # GETs only, by default
    assert raw_get(s3, f"/{s3_bucket}/b")[0] == 503
    assert raw_get(s3, f"/{s3_bucket}/a") == (200, data)  # two used up: weed answers again
    assert raw_get(s3, f"/{s3_bucket}/a", "HEAD")[0] == 200  # the HEAD fault is for key "b" only
    assert raw_get(s3, f"/{s3_bucket}/b", "HEAD") == (404, b"")
    assert s3.pending_faults() == 0
    assert [(r.method, r.key, r.status, r.fault, r.access_key) for r in s3.requests()] == [
        ("GET", "a", 503, "fail", None), ("HEAD", "a", 200, None, None), ("GET", "b", 503, "fail", None),
        ("GET", "a", 200, None, None), ("HEAD", "a", 200, None, None), ("HEAD", "b", 404, "fail", None)]


@pytest.mark.parametrize("s3fs_retries, botocore, code, expected", [
    (1, {"total_max_attempts": 1}, None, 1),
    (1, {"max_attempts": 0}, None, 1),
    (1, {"max_attempts": 1}, None, 2),  # legacy `max_attempts` is the number of retries
    (3, {"total_max_attempts": 1}, None, 1),  # s3fs does not retry a 503 ServiceUnavailable ...
    (3, {"total_max_attempts": 1}, "SlowDown", 3),  # ... but a SlowDown, in its own loop
    (1, {"mode": "standard"}, None, 3),  # standard mode: 3 attempts
], ids=["total1", "max0", "max1", "s3fs3-503", "s3fs3-slowdown", "standard"])
def test_s3fs_retry_knobs(s3, s3_bucket, s3fs_retries, botocore, code, expected):
    s3.put_bytes(f"s3://{s3_bucket}/f", blob(100))
    fs = filesystem(s3fs_retries, retries=botocore)
    fs.cat_file(f"{s3_bucket}/f", start=0, end=1)  # connected: the time below is the retries'
    s3.clear_log()

    s3.fail_next(10, 503, code=code)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="injected by the test proxy"):
        fs.cat_file(f"{s3_bucket}/f", start=0, end=10)
    took = time.monotonic() - t0
    assert len(s3.requests(method="GET", fault="fail")) == expected
    assert s3.pending_faults() == 10 - expected
    assert took < 3 + 2, took  # the slowest: standard mode's two backoffs, at most 1 + 2 s


def test_drop_next_resets_mid_body_and_s3fs_retries(s3, s3_bucket):
    size = 256 * 1024
    data = blob(size, seed=2)
    s3.put_bytes(f"s3://{s3_bucket}/f", data)
    fs = filesystem()

    s3.drop_next(1)
    assert fs.cat_file(f"{s3_bucket}/f", start=0, end=size) == data  # the retry returns every byte
    first, second = s3.requests(method="GET")
    assert (first.status, first.fault, first.sent) == (206, "drop", size // 2)
    assert (second.status, second.fault, second.sent) == (206, None, size)

    # s3fs retries a short body in its own loop only: 5 GETs by default, 1 with fs.retries = 1.
    import aiohttp

    for fs, expected in ((filesystem(), 5), (minimal(), 1)):
        s3.clear_log()
        s3.drop_next(10)
        with pytest.raises(aiohttp.ClientPayloadError):
            fs.cat_file(f"{s3_bucket}/f", start=0, end=size)
        assert [r.fault for r in s3.requests(method="GET")] == ["drop"] * expected
        s3.clear_faults()


def test_stall_next_hits_the_read_timeout(s3, s3_bucket):
    """Stalls far longer than the read timeout, released once the client has given up: no waiting, no race."""
    data = blob(MIB, seed=3)
    s3.put_bytes(f"s3://{s3_bucket}/f", data)
    fs = minimal(read_timeout=0.5)
    fs.cat_file(f"{s3_bucket}/f", start=0, end=1)  # connected: the times below are the timeouts'
    s3.clear_log()

    # Stalled before the headers: botocore's read timeout.
    s3.stall_next(1, 60)
    t0 = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        fs.cat_file(f"{s3_bucket}/f", start=0, end=100)
    assert time.monotonic() - t0 < 5
    s3.release_stalls()
    [req] = s3.requests(method="GET")
    assert req.fault == "stall" and req.range == "bytes=0-99"

    # Stalled halfway through the body: aiohttp's read timeout, an fsspec FSTimeoutError.
    from fsspec.exceptions import FSTimeoutError

    s3.clear_log()
    s3.stall_next(1, 60, mid_body=True)
    t0 = time.monotonic()
    with pytest.raises(FSTimeoutError):
        fs.cat_file(f"{s3_bucket}/f", start=0, end=MIB)
    assert time.monotonic() - t0 < 5
    s3.release_stalls()
    [req] = s3.requests(method="GET")
    # Half the body, then the stall; the proxy's next write after it can still land in the dead socket's buffer.
    assert (req.fault, req.status) == ("stall", 206) and MIB // 2 <= req.sent < MIB

    # A timeout is one of the errors s3fs retries itself: the second GET answers.
    s3.clear_log()
    s3.stall_next(1, 60)
    fs = filesystem(2, read_timeout=0.5, retries={"total_max_attempts": 1})
    assert fs.cat_file(f"{s3_bucket}/f", start=5, end=MIB) == data[5:]
    s3.release_stalls()
    assert [r.fault for r in s3.requests(method="GET")] == ["stall", None]


# ---- uploads ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("client", ["s3fs", "botocore"])
def test_multipart_upload_through_the_proxy(s3, s3_bucket, client):
    data = blob(12_000_000, seed=4)
    part = 5 * MIB
    if client == "s3fs":
        fs = s3fs.S3FileSystem(skip_instance_cache=True, fixed_upload_size=True)
        with fs.open(f"{s3_bucket}/big.bin", "wb", block_size=part) as f:
            f.write(data)
    else:  # botocore sends `Expect: 100-continue` with a file-like part over 1 MiB; the proxy answers it
        plain = botocore_client()
        upload = plain.create_multipart_upload(Bucket=s3_bucket, Key="big.bin")["UploadId"]
        done = []
        for number, start in enumerate(range(0, len(data), part), 1):
            answer = plain.upload_part(Bucket=s3_bucket, Key="big.bin", UploadId=upload, PartNumber=number,
                                       Body=io.BytesIO(data[start:start + part]))
            done.append({"PartNumber": number, "ETag": answer["ETag"]})
        plain.complete_multipart_upload(Bucket=s3_bucket, Key="big.bin", UploadId=upload,
                                        MultipartUpload={"Parts": done})

    log = s3.requests(key="big.bin")
    assert all(r.status == 200 for r in log), [(r.method, r.query, r.status) for r in log]
    create, *parts, complete = log
    assert (create.method, create.query) == ("POST", "uploads")
    assert [r.method for r in parts] == ["PUT"] * 3
    assert sorted(parse_qs(r.query)["partNumber"][0] for r in parts) == ["1", "2", "3"]
    assert len(data) <= sum(r.received for r in parts) < len(data) + 64 * 1024  # each part once (+ any framing)
    assert complete.method == "POST" and complete.query.startswith("uploadId=")

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert fs.cat_file(f"{s3_bucket}/big.bin") == data
    assert fs.cat_file(f"{s3_bucket}/big.bin", start=part - 10, end=part + 10) == data[part - 10:part + 10]
    info = fs.info(f"{s3_bucket}/big.bin")
    assert info["size"] == len(data) and info["ETag"].endswith('-3"')


def test_put_folder_uploads_every_file(s3, s3_bucket, tmp_path):
    files = {"config.json": b"{}", "sub/deeper/a.bin": blob(1000, seed=5), "sub/b.bin": blob(9 * MIB, seed=6),
             "sub/odd name+plus=%.json": b"[1]"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)

    keys = s3.put_folder(tmp_path, f"s3://{s3_bucket}/model/v1")

    assert sorted(keys) == sorted(f"model/v1/{n}" for n in files)
    fs = s3fs.S3FileSystem()
    assert sorted(fs.find(f"{s3_bucket}/model")) == sorted(f"{s3_bucket}/model/v1/{n}" for n in files)
    for name, data in files.items():
        assert fs.cat_file(f"{s3_bucket}/model/v1/{name}") == data, name


# ---- a server that goes away, and one that never comes ---------------------------------------------------------

def measure_giving_up(weed: str) -> dict:
    """On a server of its own (the session's must live on): how long an s3fs read takes to give up, with defaults
    and with no retries, on a server that answers 503 ServiceUnavailable to everything and on one that went away
    (kill()). Returns what was seen; the test judges it."""
    seen: dict = {}
    server = S3Server.start(weed=weed)
    try:
        bucket = server.new_bucket("give-up")
        server.put_bytes(f"s3://{bucket}/f", b"0123456789")
        path = f"{bucket}/f"
        # Key, secret and region given: the tests change this process's environment meanwhile.
        explicit = dict(endpoint_url=server.url, key="rank0", secret="x", client_kwargs={"region_name": REGION},
                        skip_instance_cache=True)
        default = s3fs.S3FileSystem(**explicit)
        bare = s3fs.S3FileSystem(**explicit, config_kwargs={"retries": {"total_max_attempts": 1}})
        bare.retries = 1
        # Connected and pooled: kill() must close kept-alive connections too.
        seen["warm"] = [fs.cat_file(path, start=2, end=5) for fs in (default, bare)]

        def attempt(fs):
            t0 = time.monotonic()
            try:
                fs.cat_file(path, start=2, end=5)
                error = None
            except Exception as e:  # judged by the test
                error = e
            return time.monotonic() - t0, error

        server.clear_log()
        server.fail_next(5)
        seen["503-default"] = attempt(default)
        seen["503-gets"] = [(r.status, r.range) for r in server.requests(method="GET")]
        seen["503-pending"] = server.pending_faults()
        seen["healed"] = default.cat_file(path, start=2, end=5)

        weed, port = server.proc, int(server.url.rsplit(":", 1)[1])
        t0 = time.monotonic()
        server.kill()
        seen["kill"] = time.monotonic() - t0
        seen["weed-exit"] = weed.poll()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            seen["connect"] = "accepted"
        except OSError as e:
            seen["connect"] = type(e).__name__
        seen["gone-minimal"] = attempt(bare)
        seen["gone-default"] = attempt(default)
    finally:
        server.stop()
    seen["left"] = [p for p in (server.data_dir, *server._sockets) if p.exists()]
    return seen


@pytest.fixture(scope="module", autouse=True)
def giving_up(request):
    """`measure_giving_up`, in the background from this module's first test on when its test is selected: its
    seconds are a server start and backoff sleeps (up to 2 x 15 s), so they cost this file no time."""
    if not any(item.name == "test_kill_and_how_long_s3fs_takes_to_give_up" for item in request.session.items):
        yield None
        return
    measuring: Future = Future()
    weed = shutil.which("weed")  # found now: later tests change PATH

    def measure():
        try:
            measuring.set_result(measure_giving_up(weed))
        except BaseException as e:  # handed to the test
            measuring.set_exception(e)

    # A daemon thread: an interrupted session does not wait for its backoff sleeps; its server's atexit stop()
    # still runs. It ends only after that server stopped: weed is tied to the thread that started it.
    threading.Thread(target=measure, name="s3-give-up", daemon=True).start()
    yield measuring


def test_kill_and_how_long_s3fs_takes_to_give_up(giving_up):
    """The server that goes away refuses at once. With defaults a read gives up after botocore's 5 attempts
    (legacy mode, backoff rand * (1 + 2 + 4 + 8) s: at most 15 s; s3fs adds no retry for these errors), with no
    retries at once; the errors differ by cause: OSError(EBUSY) for a 503, botocore's EndpointConnectionError for a
    refused connection."""
    seen = giving_up.result(timeout=120)
    print("\ns3fs gives up after (s): " + ", ".join(f"{k} {seen[k][0]:.2f}" for k in
                                                    ("503-default", "gone-default", "gone-minimal")))
    assert seen["warm"] == [b"234", b"234"]

    took, error = seen["503-default"]
    assert isinstance(error, OSError) and error.errno == errno.EBUSY and "injected by the test proxy" in str(error)
    assert seen["503-gets"] == [(503, "bytes=2-4")] * 5 and seen["503-pending"] == 0 and took < 15 + 3, took
    assert seen["healed"] == b"234"

    assert seen["kill"] < 2 and seen["weed-exit"] == -signal.SIGKILL and seen["connect"] == "ConnectionRefusedError"
    for name, limit in (("gone-minimal", 1), ("gone-default", 15 + 3)):
        took, error = seen[name]
        assert isinstance(error, EndpointConnectionError) and took < limit, (name, took, error)
    assert seen["left"] == []  # stop(): no data dir, no unix socket of weed's in /tmp


def test_the_session_server_started_in_time(s3_server):
    print(f"\nS3 server start: {s3_server.start_seconds:.2f} s")
    assert 0 < s3_server.start_seconds < 20


def fake_weed(folder: Path, body: str) -> None:
    """A `weed` in `folder` that runs the shell script `body`."""
    folder.mkdir()
    (folder / "weed").write_text("#!/bin/sh\n" + body)
    (folder / "weed").chmod(0o755)


def test_start_names_a_missing_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(S3ServerError, match="`weed` is not on PATH"):
        S3Server.start()


def test_start_shows_the_output_of_a_weed_that_exits(tmp_path, monkeypatch):
    fake_weed(tmp_path / "bin", f"env > {tmp_path / 'env'}\necho 'fake weed: no volume today' >&2\nexit 3\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone")
    with pytest.raises(S3ServerError, match="exited with status 3") as err:
        S3Server.start(timeout=10)
    message = str(err.value)
    assert str(tmp_path / "bin" / "weed") in message and "exited with status 3" in message
    assert "fake weed: no volume today" in message
    # weed would make that key its admin and then reject every other one: it never sees an AWS_* variable.
    names = [line.split("=", 1)[0] for line in (tmp_path / "env").read_text().splitlines()]
    assert "PATH" in names and not [n for n in names if n.startswith("AWS_")]


def test_start_times_out_and_kills_a_weed_that_never_serves(tmp_path, monkeypatch):
    fake_weed(tmp_path / "bin", f"echo $$ > {tmp_path / 'pid'}\necho 'fake weed: thinking'\nexec sleep 120\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    t0 = time.monotonic()
    with pytest.raises(S3ServerError, match="did not serve S3") as err:
        S3Server.start(timeout=1.5)
    assert time.monotonic() - t0 < 10
    assert "fake weed: thinking" in str(err.value)
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no orphan
        os.kill(pid, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_killed_test_process_leaves_no_weed_behind(tmp_path):
    """SIGKILL runs no finalizer and no atexit: weed must still die with the process that started it."""
    fake_weed(tmp_path / "bin", f"echo $$ > {tmp_path / 'pid'}\nexec sleep 120\n")
    (tmp_path / "tmp").mkdir()
    code = "import sys; sys.path.insert(0, sys.argv[1]); import s3_server; s3_server.S3Server.start(timeout=60)"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp")}
    tests = Path(__file__).parent
    starter = subprocess.Popen([sys.executable, "-c", code, str(tests)], env=env, start_new_session=True)
    try:
        for _ in range(200):  # bounded: 20 s for python and the fake weed to start
            if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip():
                break
            time.sleep(0.1)
        pid = int((tmp_path / "pid").read_text())
        assert running(pid)
    finally:
        starter.kill()
        starter.wait(timeout=10)
    for _ in range(50):  # bounded: 5 s
        if not running(pid):
            break
        time.sleep(0.1)
    assert not running(pid), f"weed {pid} outlived the process that started it"


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's corpse waits for whoever reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
