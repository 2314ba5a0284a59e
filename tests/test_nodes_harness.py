"""The simulated-nodes harness (tests/nodes.py) itself: each node sees only its own disk at the shared path, faults
land on one node, a killed node takes the job down, and a hang or a broken setup fails the test with no process
left behind."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

import nodes as nodes_module
from conftest import rank_reports
from nodes import Kill, read_only, run_nodes, tmpfs_disk

pytestmark = pytest.mark.multirank


@pytest.fixture
def disks(tmp_path):
    """`(mount_at, node_dirs, reports)`: the shared path (empty on the host), three node disks, a report folder."""
    mount_at, reports = tmp_path / "disk", tmp_path / "reports"
    node_dirs = [tmp_path / f"node{k}" for k in range(3)]
    for folder in (mount_at, reports, *node_dirs):
        folder.mkdir()
    return mount_at, node_dirs, reports


def mounted_at_host(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def processes_naming(text: str, grace: float = 5.0) -> list[str]:
    """Command lines of live processes that mention `text` (every node process has the test's folder in its argv);
    waits up to `grace` for the kernel to finish tearing a namespace down."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if text in cmdline and state != "Z" and proc.name != str(os.getpid()):
                found.append(f"{proc.name}: {cmdline}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.slow  # the simulated-node harness on real torchrun agents
def test_each_node_sees_only_its_own_disk_and_a_taken_port_is_retried(disks):
    mount_at, node_dirs, reports = disks
    with socket.socket() as held:  # the probed port taken before node 0's agent listens: the race it must survive
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        result = run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=node_dirs[:2],
                           timeout=120, port=taken)
    assert [n.returncode for n in result.nodes] == [0, 0], [n.stderr[-2000:] for n in result.nodes]
    assert result.attempts == 2 and result.port != taken
    print(f"2 nodes x 2 ranks: {max(n.seconds for n in result.nodes):.1f} s (after a failed first attempt)")
    found = rank_reports(reports, 4)
    for r, report in enumerate(found):
        assert (report["world"], report["local_world"]) == (4, 2)
        assert report["rank"] == r == report["group_rank"] * 2 + report["local_rank"], report
    for r, names in found[0]["seen"].items():
        node = int(r) // 2
        assert names == [f"rank{2 * node}", f"rank{2 * node + 1}"], (r, names)
    assert all(report["seen"] == found[0]["seen"] for report in found)  # the gather itself agreed
    for node in (0, 1):
        assert sorted(p.name for p in node_dirs[node].iterdir()) == [f"rank{2 * node}", f"rank{2 * node + 1}"]
    assert list(mount_at.iterdir()) == [] and not mounted_at_host(mount_at)  # private: nothing leaked to the host
    assert processes_naming(str(mount_at)) == []


@pytest.mark.slow  # the simulated-node harness on real torchrun agents
def test_a_full_disk_and_a_read_only_disk_fail_on_their_node_only(disks):
    """Three nodes of one rank each (the fault is per node, and fewer processes keep the test short)."""
    mount_at, node_dirs, reports = disks
    result = run_nodes("nodes_smoke.py", "write", mount_at, reports, nodes=3, nproc=1, mount_at=mount_at,
                       node_dirs=node_dirs, timeout=150, setup={1: tmpfs_disk(64 * 1024), 2: read_only()})
    assert [n.returncode for n in result.nodes] == [0, 0, 0], [n.stderr[-2000:] for n in result.nodes]
    written = [(r["group_rank"], r["written"]) for r in rank_reports(reports, 3)]
    assert written[:2] == [(0, "ok"), (1, "ENOSPC")], written
    assert written[2][0] == 2 and written[2][1] in ("EROFS", "EACCES"), written
    assert [p.name for p in node_dirs[0].iterdir()] == ["big-rank0"]
    assert (node_dirs[0] / "big-rank0").stat().st_size == 1 << 20
    assert list(node_dirs[1].iterdir()) == [] and list(node_dirs[2].iterdir()) == []  # a tmpfs instead; read-only
    assert list(mount_at.iterdir()) == []


@pytest.mark.slow  # the simulated-node harness on real torchrun agents
def test_a_killed_node_takes_the_other_down_within_seconds(disks):
    """Node 1 is SIGKILLed once its ranks are up; node 0's ranks wait on it in a barrier, which must fail, and
    node 0's agent must then exit non-zero, all well within the test's bound."""
    mount_at, node_dirs, reports = disks
    result = run_nodes("nodes_smoke.py", "kill", mount_at, reports, 1, mount_at=mount_at, node_dirs=node_dirs[:2],
                       timeout=120, kill=Kill(node=1, when_file="started-1"))
    assert result.killed_at is not None, [n.stderr[-2000:] for n in result.nodes]
    assert result.nodes[1].returncode == -9
    assert result.nodes[0].returncode not in (0, None), result.nodes[0].stderr[-2000:]
    print(f"node 1 killed {result.killed_at:.1f} s after launch; node 0 exited {result.kill_to_exit:.1f} s later")
    assert result.kill_to_exit < 30
    found = rank_reports(reports, 4)
    for report in found[:2]:
        assert "error" in report and report["waited"] < 30, report
    assert "error" not in found[2] and "error" not in found[3]  # the victim's ranks never left their sleep
    assert (node_dirs[1] / "started-1").exists()  # seen by the kill through node 1's namespace: the host's is empty
    for report in found:
        assert not Path(f"/proc/{report['pid']}").exists(), f"rank {report['rank']} survived"
    assert processes_naming(str(mount_at)) == []


@pytest.mark.slow  # the simulated-node harness on real torchrun agents
def test_a_kill_after_seconds_reaches_processes_in_their_own_session(disks):
    """`after`: node 0 is killed by time, with a process that left the agent's session in its namespace (as
    torchrun's workers do): the namespace's teardown must take it too. No torch: it never gets that far."""
    mount_at, node_dirs, reports = disks
    stall = "setsid bash -c 'sleep 600; :' \"$MOUNT_AT\""  # $0 names the folder: processes_naming finds it
    result = run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=node_dirs[:2],
                       timeout=60, setup={0: stall, 1: "exit 0"}, kill=Kill(node=0, after=1.0))
    assert [n.returncode for n in result.nodes] == [-9, 0]
    assert 1.0 <= result.killed_at < 5 and result.kill_to_exit < 5
    assert processes_naming(str(mount_at)) == []


@pytest.mark.slow  # the simulated-node harness on real torchrun agents
def test_a_hang_fails_with_each_nodes_output_and_leaves_no_process(disks):
    mount_at, node_dirs, reports = disks
    stall = "echo node 1 stalls; setsid bash -c 'sleep 600; :' \"$MOUNT_AT\""  # node 0's agent waits for it
    with pytest.raises(pytest.fail.Exception, match="did not finish within 8s") as failure:
        run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=node_dirs[:2],
                  timeout=8, setup={1: stall})
    message = str(failure.value)
    assert "did not finish within 8s" in message and "node 1 stalls" in message
    assert "--- node 0 (exit -9)" in message and "--- node 1 (exit -9)" in message
    assert processes_naming(str(mount_at)) == []


def test_a_broken_setup_fails_at_once(disks):
    mount_at, node_dirs, reports = disks
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="node setup failed: false"):
        run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=node_dirs[:2],
                  timeout=60, setup={0: "false"})
    assert time.monotonic() - start < 30  # not the timeout: node 1's agent would wait for node 0 forever
    assert processes_naming(str(mount_at)) == []


def test_no_root_or_no_unshare_fails_instead_of_skipping(disks, monkeypatch):
    mount_at, node_dirs, reports = disks
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="needs root"):
        run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=node_dirs[:2])
    monkeypatch.undo()
    monkeypatch.setattr(nodes_module.shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="unshare"):
        run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=node_dirs[:2])
