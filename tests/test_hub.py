"""Hub sources against a local Hub (tests/hub_server.py): the real huggingface_hub client, `HF_ENDPOINT` pointed at
127.0.0.1, an isolated cache per test. Nothing is mocked and nothing leaves the machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from reshard.read import HEADER_PROBE

import hub_server
from conftest import rank_reports, run_ranks, two_file_source

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/tiny"
WEIGHTS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
# copies of the same weights for other runtimes, and git's own files: a Hub source must download none of them
NEVER = {"original/params.json": b"{}", "original/consolidated.00.pth": b"\0" * 20_000,
         "consolidated.safetensors": b"\0" * 20_000, "pytorch_model.bin": b"\0" * 20_000,
         ".gitattributes": b"*.safetensors filter=lfs\n"}
PROBE = HEADER_PROBE  # a remote safetensors header is read with one `Range: bytes=0-65535` request (if it fits)


@pytest.fixture(scope="module")
def hub(tiny, tmp_path_factory):
    """The local Hub: `org/tiny` main (2 experts, two weight files + extras) and branch `v1` (4 experts)."""
    root = tmp_path_factory.mktemp("hub")
    local = {}
    server_hub = hub_server.LocalHub()
    for branch, experts in (("v1", 4), ("main", None)):
        # a larger vocabulary than the default tiny's: each weight file must be bigger than the header probe
        local[branch], _ = two_file_source(tiny("qwen3_moe", experts=experts, hidden_size=256), root / branch)
        server_hub.add_folder(REPO, local[branch], branch=branch, extra={**NEVER, "README.md": b"# tiny\n"})
    server = hub_server.start(server_hub)
    server_hub.local = local
    yield server_hub
    server.shutdown()


def cli(hub, home, *args, offline=False):
    env = {**hub_environ(hub, home), **({"HF_HUB_OFFLINE": "1"} if offline else {})}
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)


def cached_weights(home):
    return sorted(p.name for p in (home / "hub").rglob("*.safetensors"))


def test_plan_reads_the_headers_through_range_requests_only(hub, tmp_path):
    hub.log.clear()
    result = cli(hub, tmp_path, "plan", REPO, "--fsdp", 4, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model_type"] == "qwen3_moe"
    for name in WEIGHTS:
        size = len(hub.repos[REPO][hub.refs[REPO]["main"]][name])
        assert size > PROBE  # else the probe would be the whole file and prove nothing
        gets = [r for r in hub.served(REPO, name) if r.method == "GET"]
        assert gets and all(r.range == f"bytes=0-{PROBE - 1}" for r in gets), gets
        assert sum(r.sent for r in gets) == PROBE  # one probe per file: the header, never the tensor data past it
    assert hub.downloaded(REPO) == {*WEIGHTS, "config.json", "model.safetensors.index.json", "generation_config.json",
                                    "README.md"}
    assert cached_weights(tmp_path) == []  # the probes are not cached as files


@pytest.mark.slow  # two commits pushed and read back: 15-40 s
def test_revision_picks_that_commit(hub, tmp_path):
    def experts(*revision):
        result = cli(hub, tmp_path, "plan", REPO, "--fsdp", 4, "--json", *revision)
        assert result.returncode == 0, result.stderr
        return {tuple(f["shape"]) for f in json.loads(result.stdout)["families"] if f["role"] == "expert"}

    main, v1 = experts(), experts("--revision", "v1")
    assert {s[0] for s in main} == {2} and {s[0] for s in v1} == {4}
    assert experts("--revision", hub.refs[REPO]["v1"]) == v1  # a commit id, as a training config pins it
    result = cli(hub, tmp_path, "plan", REPO, "--fsdp", 4, "--revision", "nope")
    assert result.returncode == 1 and "nope" in result.stderr


def test_write_downloads_only_what_it_needs_and_the_cache_works_offline(hub, tmp_path):
    import reshard

    home = tmp_path / "home"
    hub.log.clear()
    result = cli(hub, home, "write", REPO, tmp_path / "out", "--fsdp", 4, "-q")
    assert result.returncode == 0, result.stderr
    assert hub.downloaded(REPO) == {*WEIGHTS, "config.json", "model.safetensors.index.json", "generation_config.json",
                                    "README.md"}  # no original/, *.pth, *.bin, consolidated.*, .gitattributes
    assert reshard.verify(tmp_path / "out", against=hub.local["main"]).ok

    # offline, fully cached: the same write, and not one request
    hub.log.clear()
    result = cli(hub, home, "write", REPO, tmp_path / "offline", "--fsdp", 4, "-q", offline=True)
    assert result.returncode == 0, result.stderr
    assert hub.log == []
    # offline, partly cached (one weight file gone from the cache): huggingface_hub refuses the snapshot
    for path in (home / "hub").rglob(WEIGHTS[1]):
        os.unlink(path.resolve())
        path.unlink()
    result = cli(hub, home, "write", REPO, tmp_path / "partial", "--fsdp", 4, "-q", offline=True)
    assert result.returncode == 1
    assert "HF_HUB_OFFLINE is set and the repo is not in the local cache (or only some of the files it needs are)" \
        in result.stderr, result.stderr
    assert not (tmp_path / "partial").exists()
    # a plan reads the cached snapshot as a local folder, and names the missing shard
    result = cli(hub, home, "plan", REPO, "--fsdp", 4, offline=True)
    assert result.returncode == 1 and f"'{WEIGHTS[1]}': the file does not exist" in result.stderr, result.stderr
    # online again: only the missing file is downloaded
    hub.log.clear()
    result = cli(hub, home, "write", REPO, tmp_path / "partial", "--fsdp", 4, "-q")
    assert result.returncode == 0, result.stderr
    assert {n for n in hub.downloaded(REPO) if n.endswith(".safetensors")} == {WEIGHTS[1]}
    # offline, never cached
    result = cli(hub, tmp_path / "empty", "plan", REPO, "--fsdp", 4, offline=True)
    assert result.returncode == 1 and "HF_HUB_OFFLINE is set and the repo is not in the local cache" in result.stderr


def test_a_download_that_fails_halfway_leaves_nothing_and_the_next_run_succeeds(hub, tmp_path):
    import reshard

    out, home = tmp_path / "models" / "out", tmp_path / "home"
    out.parent.mkdir()
    hub.fail(REPO, WEIGHTS[1])  # half the body, the connection dropped, then 500 on the retry
    try:
        result = cli(hub, home, "write", REPO, out, "--fsdp", 4, "-q")
    finally:
        hub.heal()
    assert result.returncode == 1 and "cannot fetch from the Hub" in result.stderr, result.stderr
    assert list(out.parent.iterdir()) == []  # no OUT, no temporary folder, no lock beside it
    assert WEIGHTS[1] not in cached_weights(home)
    assert not [p for p in (home / "hub").rglob("*") if p.name.endswith(".incomplete")]
    result = cli(hub, home, "write", REPO, out, "--fsdp", 4, "-q")
    assert result.returncode == 0, result.stderr
    assert reshard.verify(out, against=hub.local["main"]).ok
    shutil.rmtree(out)


def test_a_sub_byte_dtype_in_remote_headers_is_refused(hub, tmp_path):
    """A header read in ranges (the weights are not cached) is validated like a local one: an F4 entry is refused
    with its dtype named, no traceback."""
    import struct

    header = json.dumps({"w": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + b"\0" * (HEADER_PROBE + 4)
    hub.add("org/f4", {"config.json": json.dumps({"model_type": "qwen3_moe"}).encode(), "model.safetensors": blob})
    result = cli(hub, tmp_path, "plan", "org/f4", "--fsdp", 2)
    assert result.returncode == 1 and "'w' has dtype F4 (4 bits per element)" in result.stderr, result.stderr
    assert "sub-byte" in result.stderr and "Traceback" not in result.stderr
    assert [r.range for r in hub.served("org/f4", "model.safetensors") if r.method == "GET"] == \
        [f"bytes=0-{HEADER_PROBE - 1}"]  # the header only


def test_write_stream_reads_ranges_caches_no_weights_and_writes_the_same_bytes(hub, tmp_path):
    """`--stream`: the weights come in ranged requests, fewer than the tensors, and none lands in the cache; the
    folder equals the one written from a local copy. Files already cached are read there: no weight request."""
    import reshard

    home = tmp_path / "home"
    hub.log.clear()
    result = cli(hub, home, "write", REPO, tmp_path / "streamed", "--fsdp", 4, "--stream", "-q")
    assert result.returncode == 0, result.stderr
    assert cached_weights(home) == []
    reshard.write_checkpoint(hub.local["main"], tmp_path / "local", reshard.MeshSpec(fsdp=4), progress=False)
    for path in sorted((tmp_path / "local").glob("*.safetensors")):
        assert path.read_bytes() == (tmp_path / "streamed" / path.name).read_bytes(), path.name
    tensors = len(json.loads((tmp_path / "local" / "reshard.json").read_text())["order"])
    for name in WEIGHTS:
        gets = [r for r in hub.served(REPO, name) if r.method == "GET"]
        assert gets and all(r.range for r in gets), gets  # ranges only: never the whole file
        assert len(gets) < tensors, len(gets)

    cli(hub, home, "write", REPO, tmp_path / "downloaded", "--fsdp", 4, "-q")  # into the cache, whole
    hub.log.clear()
    result = cli(hub, home, "write", REPO, tmp_path / "again", "--fsdp", 4, "--stream", "-q")
    assert result.returncode == 0, result.stderr
    assert not [r for r in hub.log if r.path in WEIGHTS and r.method == "GET" and r.range != f"bytes=0-{PROBE - 1}"]
    assert (tmp_path / "again" / "reshard.json").read_text().count('"crc32"') > 0
    for path in sorted((tmp_path / "local").glob("*.safetensors")):
        assert path.read_bytes() == (tmp_path / "again" / path.name).read_bytes(), path.name


def hub_environ(hub, home) -> dict:
    """The environment of a process that reads `hub` with its own cache under `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.multirank
def test_a_flipped_byte_in_a_rank_file_fails_a_load_from_the_hub_on_every_rank(hub, tmp_path):
    """A reshard folder published on the Hub with one bit of rank 1's data flipped: a 2-rank load of the repo id
    stops both ranks naming the file and its CRC-32 (a mutant that skipped the check for remote loads passed every
    default test)."""
    import reshard

    folder = tmp_path / "fsdp2"
    reshard.write_checkpoint(hub.local["main"], folder, reshard.MeshSpec(fsdp=2), progress=False)
    name = "shard-00002-model-00001-of-00001.safetensors"
    data = bytearray((folder / name).read_bytes())
    data[-5] ^= 0x10
    (folder / name).write_bytes(bytes(data))
    hub.add_folder("org/flipped", folder)
    reports = tmp_path / "reports"
    reports.mkdir()
    result = run_ranks("load_remote.py", 2, "org/flipped", hub.local["main"], reports,
                       env=hub_environ(hub, tmp_path / "home"), timeout=180, check=False)
    assert result.returncode != 0
    for report in rank_reports(reports, 2):
        assert report["error"].startswith("LoadError"), report
        assert f"rank 1: {name} is corrupt (CRC-32" in report["error"], report["error"]
        assert report["seconds"] < 60, report


@pytest.mark.parametrize("times", [1, 100])
def test_an_honest_hub_answer_cut_short_is_tried_again(hub, tmp_path, times):
    """Issue 61, row 10 on the Hub: a 206 whose Content-Length and Content-Range say 1000 bytes fewer than asked.
    Once: tried again, the streamed folder is the local write's byte for byte. Always: 4 attempts, then the error
    says the server sent fewer bytes than asked."""
    import reshard

    home = tmp_path / "home"
    hub.short(REPO, WEIGHTS[0], times, 1000)
    try:
        result = cli(hub, home, "write", REPO, tmp_path / "streamed", "--fsdp", 4, "--stream", "-q")
    finally:
        left = hub.shorts[(REPO, WEIGHTS[0])][0]
        hub.heal()
    assert left == max(0, times - 4)  # once: one short answer; always: 4 attempts, no more
    if times == 1:
        assert result.returncode == 0, result.stderr
        reshard.write_checkpoint(hub.local["main"], tmp_path / "local", reshard.MeshSpec(fsdp=4), progress=False)
        for path in sorted((tmp_path / "local").glob("*.safetensors")):
            assert path.read_bytes() == (tmp_path / "streamed" / path.name).read_bytes(), path.name
    else:
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert re.search(r"failed after 4 attempts \(ShortAnswer: the server sent \d+ of the \d+ bytes asked",
                         result.stderr), result.stderr
        assert not (tmp_path / "streamed").exists()


@pytest.mark.parametrize("down, said", [
    ("/tree/|/resolve/", "listing failed after 4 attempts"),  # the API's file listing and every file
    ("/resolve/", "a ranged read of bytes 0-65535 failed after 4 attempts"),  # files only: the header reads fail
    (".", "listing failed after 4 attempts")])  # everything: the metadata comes from the cache, the listing fails
def test_a_hub_answering_500_fails_a_streaming_write_within_a_minute_one_error(hub, tmp_path, down, said):
    """Row 5: reshard's 4 attempts are the only retries (huggingface_hub's own back-off, 5 tries inside each of them,
    took 98 s and printed 40 `HTTP Error 500` / `Retrying in Ns` lines), and nothing is printed per attempt."""
    home = tmp_path / "home"
    assert cli(hub, home, "plan", REPO, "--fsdp", 4).returncode == 0  # the metadata files in the cache
    hub.log.clear()
    hub.down = down
    try:
        started = time.monotonic()
        result = cli(hub, home, "write", REPO, tmp_path / "out", "--fsdp", 4, "--stream", "-q")
        took = time.monotonic() - started
    finally:
        hub.down = None
    assert result.returncode == 1 and said in result.stderr, result.stderr
    assert "Nothing was kept" in result.stderr and not (tmp_path / "out").exists()
    assert took < 60, took
    assert "Retrying" not in result.stderr and "HTTP Error" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 4, result.stderr  # the one error (the server's text in it)
    tries = Counter(r.path for r in hub.log if re.search(down, r.path) and re.search("/tree/|/resolve/", r.path))
    assert tries and set(tries.values()) == {4}, tries  # 4 requests for each listing or header read, no more


@pytest.mark.parametrize("command", ["plan", "write"])
def test_stream_offline_reads_a_complete_cache(hub, tmp_path, command):
    """Row 8: `--stream` with HF_HUB_OFFLINE=1 on a fully cached repo works from the cache, as without `--stream`
    (it failed: `listing failed ... check the endpoint, the credentials and the network`)."""
    home = tmp_path / "home"
    assert cli(hub, home, "write", REPO, tmp_path / "downloaded", "--fsdp", 4, "-q").returncode == 0
    hub.log.clear()
    out = [tmp_path / "out", "-q"] if command == "write" else []
    result = cli(hub, home, command, REPO, *out, "--fsdp", 4, "--stream", offline=True)
    assert result.returncode == 0, result.stderr
    assert hub.log == []  # not one request
    if command == "write":
        for path in sorted((tmp_path / "downloaded").glob("*.safetensors")):
            assert path.read_bytes() == (tmp_path / "out" / path.name).read_bytes(), path.name


PAUSED_WRITE = """
import sys, time
from pathlib import Path
from reshard.cli import cli
from reshard.runs._engine import Engine

marker, go = Path(sys.argv[1]), Path(sys.argv[2])
def paused(fill):  # after every header was read, before the first byte of data
    def pausing(self, *args, **kwargs):
        if not marker.exists():
            marker.touch()
            deadline = time.monotonic() + 60
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return fill(self, *args, **kwargs)
    return pausing

Engine.fill, Engine.fill_together = paused(Engine.fill), paused(Engine.fill_together)
cli(sys.argv[3:])
"""


def test_a_push_to_the_branch_during_a_streaming_write_changes_nothing_read(hub, tmp_path):
    """A Hub file is read at the commit `main` resolved to when the metadata was fetched: a new commit pushed to
    `main` between the header reads and the data (other bytes in every weight file) is not read."""
    home, marker, go = tmp_path / "home", tmp_path / "paused", tmp_path / "go"
    env = {**hub_environ(hub, home), "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", PAUSED_WRITE, marker, go, "write", REPO, tmp_path / "streamed",
                               "--fsdp", "4", "--stream", "-q"], env=env, stderr=subprocess.PIPE, text=True)
    before = hub.refs[REPO]["main"]
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), writer.stderr.read() if writer.poll() is not None else "the write never paused"
        files = dict(hub.repos[REPO][before])
        for name in WEIGHTS:  # the same headers, every data byte reversed
            start = 8 + int.from_bytes(files[name][:8], "little")
            files[name] = files[name][:start] + files[name][start:][::-1]
        assert hub.add(REPO, files, branch="main") != before
        go.touch()
        assert writer.wait(timeout=120) == 0, writer.stderr.read()
    finally:
        hub.refs[REPO]["main"] = before
        if writer.poll() is None:
            writer.kill()
    import reshard

    reshard.write_checkpoint(hub.local["main"], tmp_path / "local", reshard.MeshSpec(fsdp=4), progress=False)
    for path in sorted((tmp_path / "local").glob("*.safetensors")):
        assert path.read_bytes() == (tmp_path / "streamed" / path.name).read_bytes(), path.name
