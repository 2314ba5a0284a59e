"""Shared fixtures: tiny generated checkpoints (cached per session) and a real multi-process gloo runner."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from reshard.tiny import make_tiny_checkpoint

HERE = Path(__file__).parent
RANK_SCRIPTS = HERE / "ranks"

# The processes the tests start (ranks, torchrun agents, the CLI) import this checkout's package, whatever another
# install on the machine points at.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))


# Hypothesis: the README's test command runs each property on a fifth of its examples (at least 25), CI on all of
# them (.ci/run sets HYPOTHESIS_PROFILE=ci, which also loads hypothesis' profile of that name).
FULL_EXAMPLES = os.environ.get("HYPOTHESIS_PROFILE") == "ci"
settings.register_profile("ci", print_blob=True)
if FULL_EXAMPLES:
    settings.load_profile("ci")


def examples(n: int) -> int:
    """`max_examples` for a property that CI runs on `n` examples."""
    return n if FULL_EXAMPLES else max(25, n // 5)


@pytest.fixture(scope="session", autouse=True)
def layout_cache(tmp_path_factory):
    """Keep the layout cache inside the test session (never the user's home)."""
    folder = tmp_path_factory.mktemp("layout-cache")
    previous = os.environ.get("RESHARD_CACHE_DIR")
    os.environ["RESHARD_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("RESHARD_CACHE_DIR", None)
    else:
        os.environ["RESHARD_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """`tiny(model_type, experts=None, fused=False, **overrides) -> Path`, generated once per session."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("tiny")

    def make(model_type: str, *, experts: int | None = None, fused: bool = False, **overrides) -> Path:
        key = (model_type, experts, fused, tuple(sorted(overrides.items())))
        if key not in cache:
            name = "-".join(str(k) for k in key[:3]) + "".join(f"-{k}{v}" for k, v in key[3])
            cache[key] = make_tiny_checkpoint(model_type, root / name, experts=experts, fused=fused, **overrides)
        return cache[key]

    return make


def run_ranks(script: str, nproc: int, *args: str, timeout: float = 180, env: dict | None = None,
              check: bool = True, monitor_interval: float = 0.5) -> subprocess.CompletedProcess:
    """Run `tests/ranks/<script>` on `nproc` real gloo processes with torchrun, under a timeout.

    A hang fails the test (the process group is killed at `timeout`) instead of freezing CI. `monitor_interval`: how
    often torchrun's agent looks for a failed rank (and then kills the others).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--monitor-interval={monitor_interval}", str(RANK_SCRIPTS / script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                                start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} on {nproc} ranks did not finish within {timeout}s (hang?)\n"
                    f"{(e.stdout or b'')[-4000:]!r}\n{(e.stderr or b'')[-4000:]!r}")
    if check and result.returncode != 0:
        pytest.fail(f"{script} on {nproc} ranks exited {result.returncode}\n{result.stdout[-3000:]}\n"
                    f"{result.stderr[-6000:]}")
    return result


def rank_reports(folder: Path, nproc: int) -> list[dict]:
    """The JSON each rank script wrote to `folder/rank{r}.json`."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(nproc)]


def two_file_source(src: Path, dest: Path) -> tuple[Path, list[str]]:
    """`src` (a one-file tiny checkpoint) re-saved into `dest` as two safetensors files plus
    `model.safetensors.index.json`, with its config files; returns `dest` and the two file names."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    dest.mkdir()
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = sorted(tensors)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    for name, part in zip(names, halves):
        save_file({k: tensors[k] for k in part}, dest / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in zip(names, halves) for k in part}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    for other in ("config.json", "generation_config.json"):
        shutil.copy2(src / other, dest / other)
    return dest, names


def tensors_of(folder: Path) -> dict:
    """Every tensor of every safetensors file in `folder`, by key."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_equal_tensors(found: dict, expected: dict) -> None:
    """The same keys, and each tensor of the same dtype and bit for bit equal."""
    import torch

    assert found.keys() == expected.keys(), sorted(found.keys() ^ expected.keys())[:4]
    for key, tensor in expected.items():
        assert found[key].dtype == tensor.dtype and torch.equal(found[key], tensor), key


class Hang(Exception):
    """A guarded block ran past its time: it hangs."""


@contextlib.contextmanager
def hang_guard(seconds: int):
    """Fail (instead of hanging) when the block takes longer: SIGALRM interrupts a blocking open of a FIFO or an
    absurd loop."""
    def expired(signum, frame):
        raise Hang(f"no answer within {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def file_chunks(document: dict, entry: dict) -> list:
    """The chunks file `entry` of a manifest document holds (tests read and tamper with `reshard.json` as JSON; the
    chunks come from the typed manifest, as every reader derives them)."""
    from reshard.manifest import Manifest

    manifest = Manifest.from_document(document, "<test>")
    return manifest.chunks(manifest.file_entry(entry["name"]))


# ---- a real S3 server: SeaweedFS behind a logging, fault-injecting proxy (tests/s3_server.py) ----------------------

@pytest.fixture(scope="session")
def s3_server():
    """The S3 server of the session, started once (a few seconds) and killed at the end. Tests use `s3`."""
    from s3_server import S3Server

    server = S3Server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server with an empty log and no faults, and this process's environment pointed at it (as
    access key "test"; the developer's own AWS_* variables removed), so `s3fs.S3FileSystem()` reads from it.

    Never `kill()` it: a test that needs a server that goes away starts its own `S3Server`."""
    if not s3_server.alive:
        pytest.fail("the session's S3 server is gone: a test killed it (kill() needs a server of its own)")
    s3_server.clear_faults()
    s3_server.release_stalls()
    s3_server.wait_idle(30)  # an earlier test's requests still in flight land before the log is cleared
    s3_server.clear_log()
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env("test").items():
        monkeypatch.setenv(name, value)
    _forget_s3fs_instances()  # fsspec caches filesystems by arguments, not by environment
    yield s3_server
    s3_server.clear_faults()
    s3_server.release_stalls()
    _forget_s3fs_instances()


@pytest.fixture
def s3_bucket(s3, request):
    """A fresh, empty bucket named after the test."""
    return s3.new_bucket(request.node.name)


def _forget_s3fs_instances() -> None:
    if "s3fs" in sys.modules:
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()
