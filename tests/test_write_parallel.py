"""`reshard write --workers N` and a torchrun write: the same bytes as `--workers 1`, and nothing kept on a fault.

Byte-identical means every file of OUT (shards, copied metadata, `reshard.json`) has the same name and bytes as the
folder `--workers 1` writes from the same arguments. Faults (a killed worker or rank, a full disk on one writer, a
missing source file on one node, Ctrl-C, SIGTERM) must leave no OUT and nothing beside it, end every process of the
write under a timeout, and say what happened. Faults are injected by tests/ranks/write_cli.py, in the process that
writes a given coordinate (spawned workers import that script, so they get the patch too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import RANK_SCRIPTS
from reshard.api import plan_checkpoint
from reshard.cli import cli
from reshard.plan import MeshSpec
from reshard.write._workers import assign_shares, default_workers
from reshard.plan import summarize

pytestmark = pytest.mark.multirank

TIMEOUT = 240  # any process of a write still running by then is a hang (a busy machine: four ranks import for a minute)
WRITE_CLI = RANK_SCRIPTS / "write_cli.py"

# (id, tiny checkpoint, write arguments, workers): stock layouts that leave ranks without experts, balanced ones,
# files split by --max-shard-size, expert parallelism, and fewer coordinates than the 4 ranks of the torchrun job
CASES = [
    ("qwen3_moe-fsdp4-stock", ("qwen3_moe", 2), ["--fsdp", "4", "--layout", "stock"], 2),
    ("qwen3_moe-fsdp4-split", ("qwen3_moe", 2), ["--fsdp", "4", "--max-shard-size", "40KiB"], 2),
    ("mixtral-fsdp5-split", ("mixtral", 8), ["--fsdp", "5", "--max-shard-size", "100KB"], 3),
    ("glm4_moe-fsdp4-ep2-stock", ("glm4_moe", 10), ["--fsdp", "4", "--ep", "2", "--layout", "stock"], 2),
    ("qwen3_moe-fsdp2", ("qwen3_moe", 2), ["--fsdp", "2"], 2),
]


def contents(out: Path) -> dict[str, bytes]:
    """Every file in OUT by name, with its bytes (the manifest's text included)."""
    assert out.is_dir(), f"{out} was not written"
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def assert_identical(out: Path, reference: Path) -> None:
    got, want = contents(out), contents(reference)
    assert sorted(got) == sorted(want), f"{out.name}: other files than --workers 1"
    differ = [name for name in want if got[name] != want[name]]
    assert differ == [], f"{out.name}: these files differ from --workers 1: {differ}"


def beside(out: Path) -> list[str]:
    """What a write to `out` may leave next to it: temporaries, the lock file."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.reshard-*"))


def assert_nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} exists after a failed write"
    assert beside(out) == [], f"left beside OUT: {beside(out)}"


def survivors(tag: str, grace: float = 5.0) -> list[int]:
    """Processes started with RESHARD_TEST_TAG=`tag` (the command and everything it started, whatever their session:
    torchrun starts each rank in its own) still running after `grace` seconds. Zombies waiting to be reaped do not
    count; helpers such as multiprocessing's resource tracker exit on their own right after the write."""
    needle = f"RESHARD_TEST_TAG={tag}".encode()
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if needle in environ.read_bytes().split(b"\0"):
                    alive.append(int(environ.parent.name))
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {cmdline[:200]}")
        except OSError:
            out.append(str(pid))
    return out


def tagged_env(**extra: str) -> tuple[str, dict]:
    tag = uuid.uuid4().hex
    return tag, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RESHARD_TEST_TAG": tag, **extra}


def run_group(cmd: list[str], *, timeout: float = TIMEOUT, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd`; fail if it, or any process it started, is still running at `timeout` or once it has returned."""
    tag, full_env = tagged_env(**(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(survivors(tag, grace=0))
        out, err = proc.communicate()
        pytest.fail(f"{cmd[:6]} did not finish within {timeout} s (hang?)\n{out[-3000:]}\n{err[-6000:]}")
    left = survivors(tag)
    if left:
        kill_all(left)
        pytest.fail(f"processes {describe(left)} of the write outlived it\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(nproc: int, *args: str, monitor_interval: float = 0.5, **kwargs) -> subprocess.CompletedProcess:
    return run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                      f"--monitor-interval={monitor_interval}", *args], **kwargs)


def write_cases(path: Path, cases: list[dict]) -> Path:
    path.write_text(json.dumps(cases))
    return path


def reports(folder: Path, case: int, ranks: int) -> list[dict]:
    return [json.loads((folder / f"case{case}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def references(tiny, tmp_path_factory):
    """Each case written with --workers 1 (in this process): the folders every other write must equal."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for case_id, (model_type, experts), args, _ in CASES:
        src = tiny(model_type, experts=experts)
        result = CliRunner().invoke(cli, ["write", str(src), str(root / case_id), *args, "--workers", "1", "-q"])
        assert result.exit_code == 0, result.output
        out[case_id] = (src, root / case_id)
    return out


# ---- shares ------------------------------------------------------------------------------------------------------

def test_shares_are_balanced_by_bytes_and_deterministic():
    sizes = [30, 10, 10, 50, 20, 20, 0]
    shares = assign_shares(sizes, 3)
    assert sorted(c for share in shares for c in share) == list(range(len(sizes)))  # every coordinate exactly once
    # largest first (50, 30, 20, 20, 10, 10, 0), each to the least loaded writer, ties to the lower one
    assert shares == [[3], [0, 1, 2], [4, 5, 6]]
    assert [sum(sizes[c] for c in share) for share in shares] == [50, 50, 40]
    assert assign_shares(sizes, 3) == shares
    assert assign_shares([5, 5], 4) == [[0], [1], [], []]  # more writers than coordinates: some write nothing


def test_default_workers():
    gib = 1 << 30
    assert default_workers(100 * gib, 64, cores=16) == 4  # capped for one disk
    assert default_workers(100 * gib, 64, cores=2) == 1  # each writer keeps about two cores busy
    assert default_workers(100 * gib, 2, cores=16) == 2  # no more writers than coordinates
    assert default_workers(gib // 2, 64, cores=16) == 1  # a small write is over before a worker has started
    assert default_workers(3 * gib, 64, cores=16) == 3


# ---- --workers N -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_workers_write_the_same_bytes(references, tmp_path, case):
    case_id, _, args, workers = case
    src, reference = references[case_id]
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["write", str(src), str(out), *args, "--workers", str(workers), "-q"])
    assert result.exit_code == 0, result.output
    assert_identical(out, reference)
    assert beside(out) == []


def test_the_cases_cover_empty_ranks_and_split_files(references):
    stock = plan_checkpoint(references["qwen3_moe-fsdp4-stock"][0], MeshSpec(fsdp=4), mode="stock").plan
    families, _ = summarize(stock)
    assert any(f.planned_empty for f in families), "the stock case must leave some ranks without experts"
    for case_id in ("qwen3_moe-fsdp4-split", "mixtral-fsdp5-split"):
        names = [p.name for p in references[case_id][1].glob("shard-00001-*")]
        assert len(names) > 1, f"{case_id}: --max-shard-size did not split coordinate 0's files"


@pytest.fixture(scope="module")
def worker_faults(tiny, tmp_path_factory):
    """Four writes with --workers 2, started at once (they spend most of their time starting): a killed worker, a full
    disk in a worker, SIGTERM to the parent, and Ctrl-C (SIGINT to the whole process group, as a terminal sends it)."""
    src = tiny("qwen3_moe", experts=2)
    root = tmp_path_factory.mktemp("worker-faults")
    runs = {}
    for name, fault in (("kill", "kill:1"), ("enospc", "enospc:1"), ("SIGTERM", "sleep:1:{marker}"),
                        ("SIGINT", "sleep:1:{marker}")):
        folder = root / name
        folder.mkdir()
        out, marker = folder / "out", folder / "first-file-written"
        cases = write_cases(folder / "cases.json", [
            {"argv": ["write", str(src), str(out), "--fsdp", "4", "--workers", "2", "-q"],
             "fault": fault.format(marker=marker)}])
        tag, env = tagged_env()
        proc = subprocess.Popen([sys.executable, str(WRITE_CLI), str(cases), str(folder / "reports")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=env)
        proc.tag = tag
        runs[name] = (proc, out, marker, folder / "reports")
    yield runs
    for proc, *_ in runs.values():
        kill_all(survivors(proc.tag, grace=0))
        proc.wait()


def finish(proc, timeout: float = TIMEOUT) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(survivors(proc.tag, grace=0))
        pytest.fail(f"the write did not stop within {timeout} s")
    left = survivors(proc.tag)
    if left:
        kill_all(left)
        pytest.fail(f"processes {describe(left)} outlived the write")
    return err


@pytest.mark.parametrize("name, fragments", [
    ("kill", ["write worker ", " of 2 (pid ", "was killed by SIGKILL", "every worker was stopped",
              "nothing was kept"]),
    ("enospc", ["no space left on the device while writing; nothing was kept"]),
])
def test_a_failed_worker_stops_every_worker_and_keeps_nothing(worker_faults, name, fragments):
    proc, out, _, report_dir = worker_faults[name]
    err = finish(proc)
    report = json.loads((report_dir / "case0-rank0.json").read_text())
    assert report["exit"] == 1, err
    for fragment in fragments:
        assert fragment in report["stderr"], report["stderr"]
    assert "Traceback" not in report["stderr"]
    assert_nothing_left(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_parallel_write_stops_every_worker(worker_faults, sig):
    proc, out, marker, report_dir = worker_faults[sig.name]
    deadline = time.monotonic() + TIMEOUT
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no worker wrote its first file in time"
        time.sleep(0.05)
    assert Path(marker.read_text()).parent.name.startswith(".out.reshard-tmp-")
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the parent and its workers
    else:
        proc.send_signal(sig)
    stopped = time.monotonic()
    err = finish(proc, timeout=30)
    assert time.monotonic() - stopped < 30
    assert proc.returncode == 128 + sig, err
    report = json.loads((report_dir / "case0-rank0.json").read_text())
    assert f"interrupted ({sig.name})" in report["stderr"] and "Traceback" not in report["stderr"]
    assert_nothing_left(out)


# ---- torchrun ----------------------------------------------------------------------------------------------------

def test_torchrun_write(references, tiny, tmp_path):
    """One 4-rank torchrun job runs, as `python -m reshard` would, a write of every case (each byte-identical to
    --workers 1), an --overwrite of an existing output, three writes that fail on every rank together (a full disk
    on the rank writing coordinate 1, a source file missing on rank 2's node, an OUT that exists), and a
    dequantizing write of an FP8 source (byte-identical to one process)."""
    ranks = 4
    outs = tmp_path / "outs"
    cases = [{"argv": ["write", str(references[case_id][0]), str(outs / case_id), *args, "-q"]}
             for case_id, _, args, _ in CASES]
    first_id, _, first_args, _ = CASES[0]
    first_src = str(references[first_id][0])
    cases.append({"argv": ["write", first_src, str(outs / first_id), *first_args]})  # exists: refused
    cases.append({"argv": ["write", first_src, str(outs / first_id), *first_args, "--overwrite", "-q"]})
    disk_full = outs / "disk-full"
    cases.append({"argv": ["write", first_src, str(disk_full), "--fsdp", "4", "-q"], "fault": "enospc:1"})
    sources = tmp_path / "sources"  # one SRC per "node", at the path each rank is given
    for r in range(ranks):
        shutil.copytree(tiny("qwen3_moe", experts=2), sources / f"src-{r}")
    (sources / "src-2" / "model.safetensors").unlink()
    missing = outs / "missing-source"
    cases.append({"argv": ["write", str(sources / "src-{rank}"), str(missing), "--fsdp", "4", "-q"]})
    # a quantized source: every rank computes its coordinates' bf16 chunks, byte-identical to one process
    from reshard.api import write_checkpoint
    from reshard.tiny import quantize_checkpoint

    fp8 = quantize_checkpoint(tiny("qwen3_moe", experts=2), tmp_path / "fp8", method="fp8", block=(32, 32))
    write_checkpoint(fp8, tmp_path / "fp8-one-process", MeshSpec(fsdp=4), dequantize="bf16", progress=False)
    cases.append({"argv": ["write", str(fp8), str(outs / "fp8"), "--fsdp", "4", "--dequantize", "bf16", "-q"]})
    # a reshard folder with one flipped data byte: rank 0 refuses it from the ranks' reads, so every rank fails
    damaged = tmp_path / "damaged"
    write_checkpoint(tiny("qwen3_moe", experts=2), damaged, MeshSpec(fsdp=2), progress=False)
    victim = damaged / "shard-00001-model-00001-of-00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x01
    victim.write_bytes(bytes(raw))
    cases.append({"argv": ["write", str(damaged), str(outs / "from-damaged"), "--fsdp", "4", "-q"]})
    report_dir = tmp_path / "reports"
    result = torchrun(ranks, str(WRITE_CLI), str(write_cases(tmp_path / "cases.json", cases)), str(report_dir),
                      timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]

    for i, (case_id, _, _, _) in enumerate(CASES):
        got = reports(report_dir, i, ranks)
        assert [g["exit"] for g in got] == [0] * ranks, [g["stderr"] for g in got]
        assert_identical(outs / case_id, references[case_id][1])
        assert beside(outs / case_id) == []
        assert [len(g["bars"]) for g in got] == [1, 0, 0, 0], "only rank 0 may show a progress bar"

    exists, overwrite, enospc, lost, dequantized, restamped = (reports(report_dir, i, ranks)
                                                               for i in range(len(CASES), len(cases)))
    assert [g["exit"] for g in exists] == [1] * ranks
    assert all("already exists" in g["stderr"] and "--overwrite" in g["stderr"] for g in exists)
    assert [g["exit"] for g in overwrite] == [0] * ranks, [g["stderr"] for g in overwrite]
    assert_identical(outs / first_id, references[first_id][1])
    assert beside(outs / first_id) == []

    assert [g["exit"] for g in enospc] == [1] * ranks
    for g in enospc:  # every rank names the failing rank and the cause
        assert "1 of 4 ranks failed while writing (rank 1: " in g["stderr"], g["stderr"]
        assert "no space left on the device" in g["stderr"] and "Traceback" not in g["stderr"]
    assert_nothing_left(disk_full)

    assert [g["exit"] for g in lost] == [1] * ranks
    for g in lost:
        assert "1 of 4 ranks cannot write (rank 2: " in g["stderr"] and "src-2" in g["stderr"], g["stderr"]
    assert_nothing_left(missing)

    assert [g["exit"] for g in dequantized] == [0] * ranks, [g["stderr"] for g in dequantized]
    assert_identical(outs / "fp8", tmp_path / "fp8-one-process")
    assert "quantization_config" not in json.loads((outs / "fp8" / "config.json").read_text())

    assert [g["exit"] for g in restamped] == [1] * ranks, [g["stderr"] for g in restamped]
    for g in restamped:  # damage is never re-stamped: the damaged file named, nothing kept
        assert victim.name in g["stderr"] and "CRC-32" in g["stderr"] and "Traceback" not in g["stderr"]
    # rank 0 checks the source files from every rank's reads once the files are written, before the swap
    assert all("rank 0 could not complete" in g["stderr"] for g in restamped[1:]), [g["stderr"] for g in restamped]
    assert_nothing_left(outs / "from-damaged")


@pytest.mark.slow  # torchrun faults and merge on 4 ranks
def test_torchrun_write_with_a_killed_rank(tiny, tmp_path):
    """The rank writing coordinate 2 is SIGKILLed mid-write: torchrun stops the others, which remove the temporary
    folder and exit non-zero; no OUT appears, and no process of the job is left."""
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    killed_at = tmp_path / "killed-at"
    cases = write_cases(tmp_path / "cases.json", [
        {"argv": ["write", str(src), str(out), "--fsdp", "4", "-q"], "fault": f"kill:2:{killed_at}"}])
    result = torchrun(4, str(WRITE_CLI), str(cases), str(tmp_path / "reports"))
    assert result.returncode != 0
    assert "SIGKILL" in result.stderr or "Signal 9" in result.stderr, result.stderr[-4000:]
    assert time.time() - float(killed_at.read_text()) < 60, "the job took more than 60 s to stop after the kill"
    for r in (0, 1, 3):
        report = tmp_path / "reports" / f"case0-rank{r}.json"
        if report.exists():  # a rank stopped by torchrun while outside the write has no report
            assert json.loads(report.read_text())["exit"] != 0
    assert_nothing_left(out)


@pytest.mark.slow  # torchrun faults and merge on 4 ranks
@pytest.mark.parametrize("killed", [2, 0])
def test_a_killed_rank_without_an_agent(tiny, tmp_path, killed):
    """Under a launcher that stops nobody (srun, mpirun; here tests/ranks/spawn.py), the other ranks notice the killed
    rank's missing heartbeats, stop with the cause and remove the temporary folder. Rank 0 hosts the job's store
    there: when it is the one killed, the others stop on the store's silence, with that cause."""
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    killed_at = tmp_path / "killed-at"
    cases = write_cases(tmp_path / "cases.json", [
        {"argv": ["write", str(src), str(out), "--fsdp", "4", "-q"], "fault": f"kill:{killed}:{killed_at}"}])
    summary = tmp_path / "summary.json"
    run_group([sys.executable, str(RANK_SCRIPTS / "spawn.py"), "4", str(summary), str(WRITE_CLI), str(cases),
               str(tmp_path / "reports")], env={"RESHARD_TEST_STALE_S": "3"})
    exits = json.loads(summary.read_text())
    assert exits[str(killed)]["exitcode"] == -signal.SIGKILL
    cause = ("rank 2 stopped responding 3 s ago (killed, or its node is down)" if killed else
             "the job's store stopped answering")
    for r in sorted({0, 1, 2, 3} - {killed}):
        assert exits[str(r)]["exitcode"] is not None, f"rank {r} did not stop"
        report_path = tmp_path / "reports" / f"case0-rank{r}.json"
        assert report_path.exists(), f"rank {r} left no report: {exits}"
        report = json.loads(report_path.read_text())
        assert report["exit"] == 1
        assert cause in report["stderr"] and "Traceback" not in report["stderr"], report["stderr"]
    if killed:
        assert_nothing_left(out)
    else:  # the others removed rank 0's temporary folder; its lock file stays, unlocked by the kernel
        assert not out.exists() and beside(out) == [f".{out.name}.reshard-lock"], beside(out)
        rerun = CliRunner().invoke(cli, ["write", str(src), str(out), "--fsdp", "4", "-q"])
        assert rerun.exit_code == 0, rerun.output
        assert beside(out) == []


@pytest.mark.slow  # torchrun faults and merge on 4 ranks
def test_torchrun_write_stopped_while_ranks_wait(tiny, tmp_path):
    """SIGTERM to torchrun while three ranks wait for a slow fourth: torchrun passes it to every rank, and each (the
    waiting ones too: they wait by polling the store, never inside a blocking collective) stops at once, removes what
    it can and exits 143; no OUT appears."""
    src = tiny("qwen3_moe", experts=2)
    out = tmp_path / "out"
    marker = tmp_path / "first-file-written"
    cases = write_cases(tmp_path / "cases.json", [
        {"argv": ["write", str(src), str(out), "--fsdp", "4", "-q"], "fault": f"sleep:2:{marker}"}])
    tag, env = tagged_env()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             "--monitor-interval=0.5", str(WRITE_CLI), str(cases), str(tmp_path / "reports")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the slow rank did not write its first file in time"
            time.sleep(0.05)
        time.sleep(1.0)  # the other ranks have written their share by now and wait for rank 2
        assert not out.exists()
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - stopped < 20, "the ranks did not stop promptly"
    finally:
        left = survivors(tag)
        kill_all(left)
    assert left == [], f"processes {describe(left)} outlived the job"
    assert proc.returncode != 0
    for r in range(4):
        report = json.loads((tmp_path / "reports" / f"case0-rank{r}.json").read_text())
        assert report["exit"] == 143, (r, report, err[-3000:])
        assert "interrupted (SIGTERM)" in report["stderr"]
        assert report["seconds"] < TIMEOUT  # from its own imports: it waited for the slowest rank to start
    assert_nothing_left(out)


# ---- merge: --workers N and a torchrun merge ---------------------------------------------------------------------

MERGE_SOURCE = "mixtral-fsdp5-split"  # a reshard folder of 5 coordinates, split files
MERGE_CASES = [("original", ["--max-shard-size", "60KB"]), ("fused", ["--max-shard-size", "100KB"]),
               ("original-one-file", ["--max-shard-size", "1GB"])]


@pytest.fixture(scope="module")
def merge_references(references, tmp_path_factory):
    """Each merge case with --workers 1 (in this process)."""
    root = tmp_path_factory.mktemp("merge-reference")
    folder = references[MERGE_SOURCE][1]
    out = {}
    for name, args in MERGE_CASES:
        layout = name.split("-")[0]
        result = CliRunner().invoke(cli, ["merge", str(folder), str(root / name), "--layout", layout, *args,
                                          "--workers", "1", "-q"])
        assert result.exit_code == 0, result.output
        out[name] = root / name
    assert len(list(out["original"].glob("model-*.safetensors"))) > 3, "the case must split into several files"
    return folder, out


@pytest.mark.parametrize("name,args", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_workers_write_the_same_bytes(merge_references, tmp_path, name, args):
    folder, expected = merge_references
    dest = tmp_path / "dest"
    result = CliRunner().invoke(cli, ["merge", str(folder), str(dest), "--layout", name.split("-")[0], *args,
                                      "--workers", "3", "-q"])
    assert result.exit_code == 0, result.output
    assert_identical(dest, expected[name])
    assert beside(dest) == []


def test_merge_workers_in_a_distributed_merge_are_refused(merge_references, tmp_path):
    folder, _ = merge_references
    result = CliRunner().invoke(cli, ["merge", str(folder), str(tmp_path / "dest"), "--distributed", "--workers", "2"])
    assert result.exit_code == 2 and "--workers 2 is for a merge on one machine" in result.output, result.output
    assert not (tmp_path / "dest").exists()


@pytest.mark.slow  # torchrun faults and merge on 4 ranks
def test_torchrun_merge(merge_references, tiny, tmp_path):
    """A 4-rank torchrun job merges every case (each byte-identical to one process), then two merges that fail on
    every rank together: a full disk on the rank writing the second file, and a source with a flipped byte."""
    folder, expected = merge_references
    ranks, outs = 4, tmp_path / "outs"
    cases = [{"argv": ["merge", str(folder), str(outs / name), "--layout", name.split("-")[0], *args, "-q"]}
             for name, args in MERGE_CASES]
    cases.append({"argv": ["merge", str(folder), str(outs / "disk-full"), *MERGE_CASES[0][1], "-q"],
                  "fault": "enospc:1"})
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    victim = sorted(damaged.glob("shard-00002-*.safetensors"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x01
    victim.write_bytes(bytes(raw))
    cases.append({"argv": ["merge", str(damaged), str(outs / "from-damaged"), "-q"]})
    report_dir = tmp_path / "reports"
    result = torchrun(ranks, str(WRITE_CLI), str(write_cases(tmp_path / "cases.json", cases)), str(report_dir),
                      timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    for i, (name, _) in enumerate(MERGE_CASES):
        got = reports(report_dir, i, ranks)
        assert [g["exit"] for g in got] == [0] * ranks, [g["stderr"] for g in got]
        assert_identical(outs / name, expected[name])
        assert beside(outs / name) == []
        assert [len(g["bars"]) for g in got] == [1, 0, 0, 0], "only rank 0 may show a progress bar"
    enospc, restamped = (reports(report_dir, i, ranks) for i in range(len(MERGE_CASES), len(cases)))
    assert [g["exit"] for g in enospc] == [1] * ranks
    for g in enospc:
        assert "1 of 4 ranks failed while writing (rank " in g["stderr"], g["stderr"]
        assert "no space left on the device" in g["stderr"] and "Traceback" not in g["stderr"]
    assert_nothing_left(outs / "disk-full")
    assert [g["exit"] for g in restamped] == [1] * ranks, [g["stderr"] for g in restamped]
    for g in restamped:  # damage is never re-stamped: the damaged file named, nothing kept
        assert victim.name in g["stderr"] and "CRC-32" in g["stderr"] and "Traceback" not in g["stderr"]
    # rank 0 checks the source files from every rank's reads once the files are written, before the swap
    assert all("rank 0 could not complete" in g["stderr"] for g in restamped[1:]), [g["stderr"] for g in restamped]
    assert_nothing_left(outs / "from-damaged")
